"""The passes as `torch.library` custom ops, with fake (meta) implementations.

    vocab_fwd         logits -> per token (logp, H, stats = (row max, log S, 1 - p_y), flags); no autograd
    vocab_bwd         the gradient pass into a fresh tensor
    vocab_bwd_inplace the gradient pass written over the logits (inplace=True)
    attach_grad       (logits, value) -> value; its autograd rule (autograd.py) runs vocab_bwd
    raw_conflicts     the raw conflict flags of spec section 3

`scale` and `softcap` (after logits_start, before backend) are the tile's transforms of spec 11,
applied by the kernels to the raw logits (dispatch.vocab_fwd); the defaults leave the logits as they are.
`backend` defaults to 'auto' (resolved by dispatch). Being custom ops, the passes are opaque to
`torch.compile`, which traces everything around them without graph breaks. Which implementation runs is
`dispatch`'s choice.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from . import dispatch
from ..core.layout import float_dtype_for
from .eager import eager


def as_tensor_param(x):
    """A hyper-parameter as the 0-d tensor the custom ops take (a Python float becomes a CPU tensor;
    a tensor is passed as it is, so torch.compile sees an input, not a constant to specialize on)."""
    return x if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=torch.float64)


def temperature_param(temperature, like, backend):
    """tau as the passes take it, made once per call (never per tile or per launch): for the Triton
    kernels a float32 tensor on `like`'s device, one element read by every row through a stride 0 (a
    number becomes a fill there, never a host-to-device copy; a host tensor is copied once; a float32
    tensor already there is passed as it is, so an in-place schedule stays live); for the torch path
    as_tensor_param (a number stays on the host, float64 logits keep tau's float64 value)."""
    if backend == "auto":
        backend = dispatch.resolve_backend(backend, like.device, like.dtype)
    if backend != "triton":
        return as_tensor_param(temperature)
    if isinstance(temperature, torch.Tensor):
        if temperature.device == like.device and temperature.dtype == torch.float32:
            return temperature
        return temperature.detach().to(device=like.device, dtype=torch.float32)
    return torch.full((1,), float(temperature), dtype=torch.float32, device=like.device)


def tau_arg(temperature, like, backend):
    """tau as the kernels' launchers take it: a Python number on the Triton backend by value (a launch
    argument: no fill, no copy), else temperature_param's tensor. (The custom ops take a float as
    temperature=None, tau_value=it.)"""
    if backend == "triton" and not isinstance(temperature, torch.Tensor):
        return float(temperature)
    return temperature_param(temperature, like, backend)


def acc_dtype(logits3, backend):
    """The dtype the passes accumulate in: the torch path float64 for float64 logits, else float32
    (the Triton backend refuses float64 logits: dispatch.resolve_backend)."""
    return float_dtype_for(logits3) if backend == "torch" else torch.float32


@torch.library.custom_op("gtpo_kernels::vocab_fwd", mutates_args=())
def vocab_fwd(logits3: torch.Tensor, ids: torch.Tensor, counted: torch.Tensor, temperature: torch.Tensor,
              logits_start: int, scale: float = 1.0, softcap: Optional[float] = None,
              backend: str = "auto") -> List[torch.Tensor]:
    return list(dispatch.vocab_fwd(backend, logits3, ids, counted, temperature, logits_start, scale, softcap))


def fwd_outputs_like(logits3, n, backend):
    """The forward passes' outputs for n tokens, uninitialized (the fake implementations' shapes and
    dtypes): logp, H, stats (n, 3) in the accumulation dtype, flags int8."""
    acc = acc_dtype(logits3, backend)
    return [logits3.new_empty(n, dtype=acc), logits3.new_empty(n, dtype=acc),
            logits3.new_empty((n, 3), dtype=acc), logits3.new_empty(n, dtype=torch.int8)]


@vocab_fwd.register_fake
def _(logits3, ids, counted, temperature, logits_start, scale=1.0, softcap=None, backend="auto"):
    return fwd_outputs_like(logits3, ids.numel(), backend)


@torch.library.custom_op("gtpo_kernels::vocab_bwd", mutates_args=())
def vocab_bwd(logits3: torch.Tensor, ids: torch.Tensor, stats: torch.Tensor, ent: torch.Tensor,
              c: torch.Tensor, e: Optional[torch.Tensor], temperature: Optional[torch.Tensor],
              logits_start: int, scale: float = 1.0, softcap: Optional[float] = None,
              backend: str = "auto", g: Optional[torch.Tensor] = None, tau_value: float = 1.0,
              keep_s: Optional[torch.Tensor] = None, keep_id: Optional[torch.Tensor] = None,
              id_start: int = 0, tau_seq: int = 0, cu: Optional[torch.Tensor] = None) -> torch.Tensor:
    """g: the upstream gradient, multiplied into c and e by the pass (None: already in them); temperature
    None: tau_value, passed by value. keep_s, keep_id: each token's kept set (kept_rule_triton; Triton).
    id_start: the slice's first id (each target is ids - id_start). tau_seq, cu: a temperature per
    completion (vocab_triton.vocab_fwd's; Triton)."""
    grad3 = torch.empty(logits3.shape, dtype=logits3.dtype, device=logits3.device)
    dispatch.vocab_bwd(backend, logits3, grad3, ids, stats, ent, c, e,
                       float(tau_value) if temperature is None else temperature, logits_start, scale, softcap, g,
                       None if keep_s is None else (keep_s, keep_id), id_start, tau_seq, cu)
    return grad3


@vocab_bwd.register_fake
def _(logits3, ids, stats, ent, c, e, temperature, logits_start, scale=1.0, softcap=None, backend="auto", g=None,
      tau_value=1.0, keep_s=None, keep_id=None, id_start=0, tau_seq=0, cu=None):
    return torch.empty(logits3.shape, dtype=logits3.dtype, device=logits3.device)


@torch.library.custom_op("gtpo_kernels::vocab_bwd_inplace", mutates_args=("logits3",))
def vocab_bwd_inplace(logits3: torch.Tensor, ids: torch.Tensor, stats: torch.Tensor, ent: torch.Tensor,
                      c: torch.Tensor, e: Optional[torch.Tensor], temperature: Optional[torch.Tensor],
                      logits_start: int, scale: float = 1.0, softcap: Optional[float] = None,
                      backend: str = "auto", g: Optional[torch.Tensor] = None, tau_value: float = 1.0,
                      keep_s: Optional[torch.Tensor] = None, keep_id: Optional[torch.Tensor] = None,
                      id_start: int = 0, tau_seq: int = 0, cu: Optional[torch.Tensor] = None) -> None:
    """vocab_bwd written over logits3 itself (inplace=True); the same arguments."""
    dispatch.vocab_bwd(backend, logits3, logits3, ids, stats, ent, c, e,
                       float(tau_value) if temperature is None else temperature, logits_start, scale, softcap, g,
                       None if keep_s is None else (keep_s, keep_id), id_start, tau_seq, cu)


@vocab_bwd_inplace.register_fake
def _(logits3, ids, stats, ent, c, e, temperature, logits_start, scale=1.0, softcap=None, backend="auto", g=None,
      tau_value=1.0, keep_s=None, keep_id=None, id_start=0, tau_seq=0, cu=None):
    return None


@torch.library.custom_op("gtpo_kernels::attach_grad", mutates_args=())
def attach_grad(logits3: torch.Tensor, value: torch.Tensor, ids: torch.Tensor, stats: torch.Tensor,
                ent: torch.Tensor, c: torch.Tensor, e: Optional[torch.Tensor],
                temperature: Optional[torch.Tensor], logits_start: int, scale: float = 1.0,
                softcap: Optional[float] = None, backend: str = "auto", inplace: bool = False,
                tau_value: float = 1.0, id_start: int = 0) -> torch.Tensor:
    return value.clone()


@attach_grad.register_fake
def _(logits3, value, ids, stats, ent, c, e, temperature, logits_start, scale=1.0, softcap=None, backend="auto",
      inplace=False, tau_value=1.0, id_start=0):
    return torch.empty_like(value)


@torch.library.custom_op("gtpo_kernels::raw_conflicts", mutates_args=())
def raw_conflicts(ids: torch.Tensor, m: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor,
                  group_size: int, backend: str) -> torch.Tensor:
    return dispatch.raw_conflicts(backend, ids, m, pos, neg, group_size)


@raw_conflicts.register_fake
def _(ids, m, pos, neg, group_size, backend):
    return torch.empty(ids.shape, dtype=torch.bool, device=ids.device)


@torch.library.custom_op("gtpo_kernels::conflict_weights", mutates_args=())
def conflict_weights(ids: torch.Tensor, mask: Optional[torch.Tensor], adv: torch.Tensor, cu: Optional[torch.Tensor],
                     T: int, group_size: int, w_pos: float, w_neg: float) -> List[torch.Tensor]:
    """lam (N,), n_conf (B,) float32 in one Triton launch, from the call's tensors as given (the loss's
    three-launch path, spec 8): conflict_triton.conflict_weights."""
    from .conflict_triton import conflict_weights as impl
    lam = torch.empty(ids.numel(), dtype=torch.float32, device=ids.device)
    n_conf = torch.empty(adv.numel(), dtype=torch.float32, device=ids.device)
    impl(ids, mask, adv, cu, T, group_size, w_pos, w_neg, lam, n_conf)
    return [lam, n_conf]


@conflict_weights.register_fake
def _(ids, mask, adv, cu, T, group_size, w_pos, w_neg):
    return [ids.new_empty(ids.numel(), dtype=torch.float32), adv.new_empty(adv.numel(), dtype=torch.float32)]


# called eagerly without torch.library's per-call Python (kernels/eager.py; attach_grad: kernels/autograd.py;
# vocab_bwd_inplace mutates its argument: the op's call)
vocab_fwd, vocab_bwd, raw_conflicts, conflict_weights = (eager(op) for op in (vocab_fwd, vocab_bwd, raw_conflicts,
                                                                              conflict_weights))
