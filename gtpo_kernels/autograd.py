"""The vocabulary passes as `torch.library` custom ops, and the autograd rule that joins them.

    vocab_fwd   : logits -> per token (logp, H, stats = (row max, log S, 1 - p_y), flags); no autograd
    attach_grad : (logits, value) -> value, whose backward is the gradient pass:
                  dL/dlogits = g * (c * dlogp/dz + e * dH/dz)   (see vocab_triton's docstring)

`gtpo_loss` computes the loss value and the per-token coefficients c = dL/dlogp, e = dL/dH in closed
form between the passes (surrogate.py, O(tokens)); `attach_grad` hands the value back with this
gradient attached. Saved for backward: the logits by reference and O(1) numbers per token (ids,
stats, H, c, e). Being custom ops with fake (meta) implementations, the passes are opaque to
`torch.compile`, which traces everything around them without graph breaks.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from . import dispatch
from .checks import float_dtype_for


def as_tensor_param(x):
    """A hyper-parameter as the 0-d tensor the custom ops take (a Python float becomes a CPU tensor;
    a tensor is passed as it is, so torch.compile sees an input, not a constant to specialize on)."""
    return x if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=torch.float64)


out_dtype = float_dtype_for  # outputs other than the gradient (spec 6)


def _acc_dtype(logits3, backend):
    # the torch path accumulates float64 logits in float64; the Triton kernels always in float32
    return float_dtype_for(logits3) if backend == "torch" else torch.float32


@torch.library.custom_op("gtpo_kernels::vocab_fwd", mutates_args=())
def vocab_fwd(logits3: torch.Tensor, ids: torch.Tensor, counted: torch.Tensor, temperature: torch.Tensor,
              logits_start: int, backend: str) -> List[torch.Tensor]:
    return list(dispatch.logprob_fwd(backend, logits3, ids, counted, temperature, logits_start))


@vocab_fwd.register_fake
def _(logits3, ids, counted, temperature, logits_start, backend):
    n = ids.numel()
    acc = _acc_dtype(logits3, backend)
    return [logits3.new_empty(n, dtype=acc), logits3.new_empty(n, dtype=acc),
            logits3.new_empty((n, 3), dtype=acc), logits3.new_empty(n, dtype=torch.int8)]


@torch.library.custom_op("gtpo_kernels::vocab_bwd", mutates_args=())
def vocab_bwd(logits3: torch.Tensor, ids: torch.Tensor, stats: torch.Tensor, ent: torch.Tensor,
              c: torch.Tensor, e: Optional[torch.Tensor], temperature: torch.Tensor,
              logits_start: int, backend: str) -> torch.Tensor:
    grad3 = torch.empty(logits3.shape, dtype=logits3.dtype, device=logits3.device)
    dispatch.logprob_bwd(backend, logits3, grad3, ids, stats, ent, c, e, temperature, logits_start)
    return grad3


@vocab_bwd.register_fake
def _(logits3, ids, stats, ent, c, e, temperature, logits_start, backend):
    return torch.empty(logits3.shape, dtype=logits3.dtype, device=logits3.device)


@torch.library.custom_op("gtpo_kernels::vocab_bwd_inplace", mutates_args=("logits3",))
def vocab_bwd_inplace(logits3: torch.Tensor, ids: torch.Tensor, stats: torch.Tensor, ent: torch.Tensor,
                      c: torch.Tensor, e: Optional[torch.Tensor], temperature: torch.Tensor,
                      logits_start: int, backend: str) -> None:
    dispatch.logprob_bwd(backend, logits3, logits3, ids, stats, ent, c, e, temperature, logits_start)


@torch.library.custom_op("gtpo_kernels::attach_grad", mutates_args=())
def attach_grad(logits3: torch.Tensor, value: torch.Tensor, ids: torch.Tensor, stats: torch.Tensor,
                ent: torch.Tensor, c: torch.Tensor, e: Optional[torch.Tensor],
                temperature: torch.Tensor, logits_start: int, backend: str, inplace: bool) -> torch.Tensor:
    return value.clone()


@attach_grad.register_fake
def _(logits3, value, ids, stats, ent, c, e, temperature, logits_start, backend, inplace):
    return torch.empty_like(value)


def _setup_context(ctx, inputs, output):
    logits3, _value, ids, stats, ent, c, e, temperature, logits_start, backend, inplace = inputs
    ctx.save_for_backward(logits3, ids, stats, ent, c, e, temperature)
    ctx.meta = (logits_start, backend, inplace)


def _backward(ctx, grad):
    logits3, ids, stats, ent, c, e, temperature = ctx.saved_tensors
    logits_start, backend, inplace = ctx.meta
    g = grad.reshape(-1).to(c.dtype)  # scalar loss: (1,); loss_agg='none': one per token
    c = c * g
    e = None if e is None else e * g
    if inplace:
        vocab_bwd_inplace(logits3, ids, stats, ent, c, e, temperature, logits_start, backend)
        grad3 = logits3.view(logits3.shape)  # a fresh view: autograd can take it as .grad without a copy
    else:
        grad3 = vocab_bwd(logits3, ids, stats, ent, c, e, temperature, logits_start, backend)
    return (grad3,) + (None,) * 10


attach_grad.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("gtpo_kernels::raw_conflicts", mutates_args=())
def raw_conflicts_op(ids: torch.Tensor, m: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor,
                     group_size: int) -> torch.Tensor:
    from .conflict_triton import raw_conflicts
    return raw_conflicts(ids, m, pos, neg, group_size)


@raw_conflicts_op.register_fake
def _(ids, m, pos, neg, group_size):
    return torch.empty(ids.shape, dtype=torch.bool, device=ids.device)
