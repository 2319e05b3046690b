"""Argument checks shared by the public calls. Errors name the argument and what was expected (the
Batch is built from the checked arguments in `batch`)."""
from __future__ import annotations

import contextlib
import functools
import math
import numbers
import os
import sys
import warnings

import torch

from .entry import kernels_allowed
from .flags import BAD_NONFINITE, BAD_RULE, BAD_TARGET_NEG_INF, NonFiniteRowError
from .host_read import check_on_device, in_row, one_host_read, read_once  # noqa: F401 (the checks' home: checks.*)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

def host_checks(validate) -> bool:
    """Whether the host-side checks run: `validate`, except inside torch.compile or CUDA-graph capture,
    where a host read would sync or break the graph (invalid tokens then give NaN instead)."""
    if not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool, got {validate!r}")
    if not validate or torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def check_inplace(inplace, logits):
    """inplace=True writes the gradient over the logits: each element must own its memory."""
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool, got {inplace!r}")
    if not inplace:
        return
    if torch.compiler.is_compiling():
        raise ValueError("inplace=True is not supported inside torch.compile: the compiled backward would "
                         "copy the logits to write them, which loses the memory saving; use inplace=False")
    if logits.numel() == 0:  # nothing is written: no stride or overlap to speak of
        return
    if logits.shape[-1] > 1 and logits.stride(-1) != 1:  # (a dimension of 1: any stride)
        raise ValueError("inplace=True needs logits with vocabulary stride 1 (it writes the gradient "
                         "into their storage)")
    dims = sorted((st, n) for st, n in zip(logits.stride(), logits.shape) if n > 1)
    span = 1
    for st, n in dims:
        if st < span:
            raise ValueError(f"inplace=True needs logits whose rows do not overlap in memory; these have "
                             f"shape {tuple(logits.shape)} and strides {logits.stride()} (an expanded or "
                             f"broadcast view?): pass a copy, or inplace=False")
        span = st * n


def check_num_items(num_items, loss_agg, device, dtype, validate=True, raw=False):
    """num_items_in_batch: the denominator of 'token-mean', or None. One rule for numbers and tensors: it
    must be finite and > 0, never clamped (a global token count over the world size may be fractional).
    A tensor is read on the host only when validating; unvalidated, an invalid one gives a NaN loss.
    raw: an unvalidated tensor already on `device` is returned as it is (a 0-d view; the epilogue kernel
    makes it NaN unless finite and > 0)."""
    if num_items is None:
        return None
    if loss_agg != "token-mean":
        raise ValueError(f"num_items_in_batch is the denominator of loss_agg='token-mean' only; with "
                         f"loss_agg={loss_agg!r} the denominators are per completion or per batch (spec 4): "
                         f"scale the loss instead (docs/usage.md, 'Normalizers')")
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1 or num_items.dtype == torch.bool or num_items.dtype.is_complex:
            raise ValueError(f"num_items_in_batch must be a positive number or a one-element real tensor, "
                             f"got a {num_items.dtype} tensor of shape {tuple(num_items.shape)}")
        if raw and not validate and num_items.device == device:
            return num_items.reshape(())
        x = num_items.reshape(()).to(device, dtype)
        ok = (x > 0) & torch.isfinite(x)
        if validate:
            def fail():
                raise ValueError(f"num_items_in_batch must be finite and > 0, got {float(x)}")
            check_on_device(~ok, fail)
        return torch.where(ok, x, torch.full((), float("nan"), dtype=dtype, device=device))
    if isinstance(num_items, numbers.Real) and not isinstance(num_items, bool) and math.isfinite(num_items) \
            and num_items > 0:
        x = _rounded(float(num_items), dtype)  # a host number: no device involved
        if math.isfinite(x) and x > 0:
            return float(num_items)
        raise ValueError(f"num_items_in_batch must be finite and > 0 in the loss's dtype {dtype}, got "
                         f"{num_items!r} (it rounds to {x})")
    raise ValueError(f"num_items_in_batch must be a finite number > 0 or a one-element tensor, got {num_items!r}")


def _rounded(v, dtype):
    """v rounded to `dtype` on the host (inf past its range), without a tensor for float32 / float64."""
    import struct
    if dtype == torch.float64:
        return v
    if dtype == torch.float32:
        try:
            return struct.unpack("f", struct.pack("f", v))[0]
        except OverflowError:
            return math.inf
    return float(torch.tensor(v, dtype=dtype))


# the predicates' one-launch form where Triton runs (kernels/check_triton registers it): (x, where, V) -> a
# 0-d bool, or None (then torch forms it here)
DEVICE_ANY = None


_HERE = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # the package
         os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)  # and torch (autograd, custom ops)
_HELPERS = (os.path.abspath(contextlib.__file__), os.path.abspath(functools.__file__))  # (a `with` block's exit)


def warn_at_caller(message, category=UserWarning):
    """warnings.warn pointing at the trainer's line: the first frame outside this package, torch and the
    standard library's contextlib and functools."""
    level, f = 1, sys._getframe(1)
    while f is not None and (os.path.abspath(f.f_code.co_filename).startswith(_HERE)
                             or os.path.abspath(f.f_code.co_filename) in _HELPERS):
        f, level = f.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)


def _any_bad(x, where, V, torch_bad):
    """Whether any value fails: DEVICE_ANY's one launch, else torch's torch_bad().any()."""
    found = None if DEVICE_ANY is None or not kernels_allowed() else DEVICE_ANY(x, where, V)
    return torch_bad().any() if found is None else found


def _check(x, where, kind, V, torch_bad, fail, row_length=None):
    """A value check (core.host_read.RowCheck's kinds): formed by a process group's agreement row (in_row),
    else DEVICE_ANY's one launch or torch's form ('binary'; 'cu' and 'cu_max': torch_bad() is the 0-d
    flag), read with the call's other checks."""
    if in_row(x, where, kind, V, torch_bad, fail, row_length):
        return
    if kind in ("cu", "cu_max"):
        check_on_device(torch_bad(), fail)
    else:
        check_on_device(torch_bad().any() if kind in ("binary", "atleast", "positive") else
                        _any_bad(x, where, V, torch_bad), fail)


def _selection(counted, where):
    """counted: None, a bool tensor, or a callable that makes it -> (the bool tensor's maker, what the
    kernels read: `where` beside a callable (the caller's mask as given, nonzero counts; None: every
    position), else the tensor)."""
    if callable(counted):
        return counted, where
    return (lambda: counted), counted


def check_finite(name, x, counted=None, where=None):
    """Host check (validate=True only): x finite (at counted positions when `counted` is given: a bool
    tensor, or a callable that makes it, read by the kernels as `where`, see _selection)."""
    made, where = _selection(counted, where)

    def bad():
        return ~torch.isfinite(x) if counted is None else made() & ~torch.isfinite(x.reshape(-1))

    def fail():
        k = int(bad().reshape(-1).nonzero()[0, 0])
        raise ValueError(f"{name} must be finite{' at counted positions' if counted is not None else ''}; "
                         f"flat position {k} holds {float(x.reshape(-1)[k])}")
    _check(x, where, "finite", None, bad, fail)


def check_binary(x, fail):
    """Host check (validate=True only): every value of x is 0 or 1; fail() raises the error."""
    _check(x, None, "binary", None, lambda: (x != 0) & (x != 1), fail)


def check_at_least(x, lo, counted, where, fail, seg=None):
    """Host check (validate=True only): x finite and >= lo (at counted positions when `counted` is given, as
    check_finite's); fail() raises the error. seg (T, a callable making each token's row): x holds one value
    per row of T tokens (or per completion of the packed form, T = (cu_seqlens, N): Batch.seq_rows),
    checked where a counted token reads it."""
    made, where = _selection(counted, where)

    def bad():
        out = ~(torch.isfinite(x) & (x >= lo))
        out = out if seg is None else out.reshape(-1)[seg[1]()]
        return out if counted is None else made() & out.reshape(-1)
    _check(x, where, "atleast", lo, bad, fail, None if seg is None else seg[0])


def check_cu_seqlens(cu_seqlens, N, malformed, fail):
    """Host check (validate=True only): cu_seqlens starts at 0, never decreases and ends at N; malformed():
    the 0-d flag (torch's form); fail() raises the error."""
    _check(cu_seqlens, None, "cu", N, malformed, fail)


def check_max_seqlen(cu_seqlens, max_seqlen, longest, fail):
    """Host check (validate=True only): no completion of cu_seqlens is longer than max_seqlen; longest(): the
    longest, 0-d (torch's form); fail() raises the error."""
    _check(cu_seqlens, None, "cu_max", max_seqlen, lambda: longest() > max_seqlen, fail)


def check_nonneg_int(name, x):
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 0:
        raise ValueError(f"{name} must be an int >= 0, got {x!r}")
    return int(x)


def check_tensor(name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_shape(name, x, want, what):
    if tuple(x.shape) != tuple(want):
        raise ValueError(f"{name} must have shape {what} = {tuple(want)}, got {tuple(x.shape)}")


def check_int_tensor(name, x):
    check_tensor(name, x)
    if x.dtype == torch.bool or x.dtype.is_floating_point or x.dtype.is_complex:
        raise TypeError(f"{name} must be an integer tensor (int32 or int64), got {x.dtype}")


def check_same_shape(name, x, tok_shape):
    check_shape(name, x, tok_shape, "completion_ids' shape")


def check_float_dtype(name, dtype):
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point torch.dtype (torch.float32, torch.float64, ...), got {dtype!r}")


def check_float_tensor(name, x):
    check_tensor(name, x)
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def check_device(name, x, device):
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but logits are on {device}")


def check_logits(logits, ndim, what, sliced=False):
    """sliced: a rank's slice of a vocabulary-parallel vocabulary, which may be empty (spec 12)."""
    check_tensor("logits", logits)
    if logits.dtype not in FLOAT_DTYPES:
        raise TypeError(f"logits must be float16, bfloat16, float32 or float64, got {logits.dtype}")
    if logits.dim() != ndim:
        raise ValueError(f"logits must be {what}, got shape {tuple(logits.shape)}")
    if logits.shape[-1] < 1 and not sliced:
        raise ValueError("logits must have a vocabulary dimension V >= 1")


def check_ids_in_range(ids, counted, V, where=None, name="completion_ids"):
    """Host check (validate=True only): ids in [0, V) at counted positions (counted, where: as check_finite's)."""
    made, where = _selection(counted, where)

    def bad():
        return made() & ((ids < 0) | (ids.long() >= V))  # int64: an int32 tensor would wrap V = 2**31

    def fail():
        k = int(bad().nonzero()[0, 0])
        span = f"[0, V) = [0, {V})" if V != float("inf") else "[0, V) (V: the whole vocabulary over the group)"
        raise ValueError(f"{name} must lie in {span} at counted positions; flat position {k} holds "
                         f"{int(ids[k])} (mask it out, or fix the ids)")
    _check(ids, where, "range", V, bad, fail)


def check_group_size(group_size, B):
    if group_size is None:
        raise ValueError("group_size is required to compute the conflict weights (or pass lam and "
                         "n_conf from conflict_weights, or turn use_conflict_mask off)")
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if B % group_size:
        raise ValueError(f"group_size = {group_size} must divide the number of completions B = {B}")
    return int(group_size)


def check_unused_group_size(group_size, B, cfg, config):
    """A group_size given to a config that computes no conflict weights (use_conflict_mask=False: the
    TRL-family presets): the loss does not depend on it, so one that does not divide B (a micro-batch
    split across groups is legitimate there) is accepted with a warning that names it and the config;
    one that is not a positive int is refused as when it is used."""
    if group_size is None or cfg.use_conflict_mask:
        return
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if B % group_size:
        name = f"config={config!r}" if isinstance(config, str) else "this config"
        warn_at_caller(f"group_size = {group_size} does not divide the number of completions B = {B}, and is "
                       f"unused: {name} computes no conflict weights (use_conflict_mask=False), so the loss "
                       "does not depend on group_size")


def raise_on_flags(bad, tok_shape):
    """Host-side report of the forward kernel's per-token flags (validate=True only): one read, of the
    largest flag (a reduction), and only when one is set the position's."""
    if bad.numel() == 0 or not int(bad.amax()):
        return
    nz = bad.nonzero()
    k = int(nz[0, 0])
    where = tuple(int(v) for v in torch.unravel_index(torch.tensor(k), tok_shape))
    f = int(bad[k])
    if f & BAD_NONFINITE:
        what = "contains NaN or +inf"
    elif f & BAD_TARGET_NEG_INF:
        what = "gives its own target token a logit of -inf (log-prob -inf)"
    elif f & BAD_RULE:
        what = "has a top_k, top_p or min_p value out of its range"
    else:
        what = "has a target id outside [0, V)"
    error = NonFiniteRowError if f & BAD_NONFINITE else ValueError
    raise error(f"logits: the row predicting completion token {where} {what}; {nz.shape[0]} counted row(s) are invalid")


def require_advantages(advantages):
    if advantages is None:
        raise TypeError("advantages is required: a (B,) tensor, one advantage per completion")


def refuse_reference_with_group(vp):
    """backend='reference' materializes the whole vocabulary on one process."""
    if vp is not None:
        raise ValueError("backend='reference' takes the whole vocabulary: no process_group")
