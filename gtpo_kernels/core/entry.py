"""What an entry point's call may launch around its passes: its decorator (backend_kernels) records whether
its checks and a process group's checksums may run Triton kernels (not with backend='torch' or 'reference'),
and runs a call on a process group eagerly under torch.compile."""
from __future__ import annotations

import contextvars
import functools
import inspect
import math

import torch

from .flags import NonFiniteRowError, tau_or_nan

# whether the call may run Triton kernels of its own around its passes (not with backend='torch' or 'reference')
_KERNELS = contextvars.ContextVar("gtpo_kernels_allowed", default=True)


def kernels_allowed():
    """Whether this call's checks and agreement may launch Triton kernels (its backend is not 'torch')."""
    return _KERNELS.get()


def backend_kernels(fn):
    """An entry point's decorator: with backend='torch' or 'reference' its checks (and a process group's
    checksums) are formed by torch alone, as its passes are (no Triton kernel launched for them). Under
    torch.compile a call with a process group (or a DTensor) runs eagerly: the ranks' agreement, a collective
    and a host read, cannot be traced (fullgraph=True is refused with that reason)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.compiler.is_compiling():  # (no host checks run there)
            if _grouped(args, kwargs):  # fullgraph=True stops at the break, with this reason; else it runs eagerly
                torch._dynamo.graph_break(f"{fn.__name__} with a process_group (or a DTensor): the ranks' agreement, "
                                          "a collective and a host read, cannot be traced; compile with "
                                          "fullgraph=False (the call then runs eagerly), or call it outside the "
                                          "compiled region")
                return torch.compiler.disable(fn)(*args, **kwargs)
            return fn(*args, **kwargs)
        token = _KERNELS.set(kwargs.get("backend", "auto") not in ("torch", "reference"))
        try:
            return fn(*args, **kwargs)
        except NonFiniteRowError:
            _refuse_temperature(fn, args, kwargs)
            raise
        finally:
            _KERNELS.reset(token)
    return run


def _refuse_temperature(fn, args, kwargs):
    """Every counted row flagged not finite, validating: where the config's temperature is a 0-d tensor
    changed in place to a value that is not > 0 since the config checked it (a schedule), the error names
    it (read here, on the error's path alone: the kernels NaN such a tau without a read)."""
    from .config import GTPOConfig
    try:
        config = inspect.signature(fn).bind(*args, **kwargs).arguments.get("config")
    except TypeError:
        return
    tau = getattr(config, "temperature", None) if isinstance(config, GTPOConfig) else None
    if isinstance(tau, torch.Tensor) and tau.numel() == 1 and math.isnan(tau_or_nan(float(tau))):
        raise ValueError(f"GTPOConfig.temperature must be > 0, with temperature and 1 / temperature finite in float32, got {tau!r}: "
                         "the 0-d tensor was changed in place since the config checked it") from None


def _grouped(args, kwargs):
    """A call on a process group: process_group given, or a DTensor first argument (its mesh's group)."""
    if kwargs.get("process_group") is not None:
        return True
    dtensor = getattr(getattr(torch.distributed, "tensor", None), "DTensor", ())
    return bool(args) and isinstance(args[0], dtensor)
