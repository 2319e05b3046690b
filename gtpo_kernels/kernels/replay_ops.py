"""The replay passes as `torch.library` custom ops (opaque to torch.compile, traced without graph breaks),
mirroring ops.vocab_fwd / vocab_bwd / attach_grad for the entry points that compute the per-token
coefficients c = dL/dlogp, e = dL/dH in closed form:

    replay_fwd          logits -> per token (logp, H, stats = (m_K, log S_K, 1 - p^K_y), flags) over the
                        kept sets, NaN where invalid, 0 at uncounted tokens (replay.finish); no autograd
    replay_bwd          the gradient pass into a fresh zero tensor (exactly 0 outside the kept sets)
    attach_replay_grad  (logits, value) -> value; its backward runs replay_bwd with (c g, e g)

The tokens and their sets are as in replay.replay_logprobs (rows_b, rows_t, y, tau per token, token_ids,
offsets: counted or flat layout). tau is a tensor (0-d or per token) so that compiling never specializes
on it. Which implementation runs is replay's choice (replay_triton | replay_torch).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from .dispatch import scale_by as _scale
from .ops import fwd_outputs_like
from .replay import _impl, finish
from .eager import eager


@torch.library.custom_op("gtpo_kernels::replay_fwd", mutates_args=())
def replay_fwd(logits3: torch.Tensor, rows_b: torch.Tensor, rows_t: torch.Tensor, y: torch.Tensor,
               tau: torch.Tensor, token_ids: torch.Tensor, offsets: torch.Tensor, invalid: Optional[torch.Tensor],
               counted: Optional[torch.Tensor], scale: float = 1.0, softcap: Optional[float] = None,
               backend: str = "torch") -> List[torch.Tensor]:
    out = _impl(backend).replay_fwd(logits3, rows_b, rows_t, y, tau, token_ids, offsets, scale, softcap)
    return list(finish(*out, invalid, counted))


@replay_fwd.register_fake
def _(logits3, rows_b, rows_t, y, tau, token_ids, offsets, invalid, counted, scale=1.0, softcap=None,
      backend="torch"):
    return fwd_outputs_like(logits3, y.numel(), backend)


@torch.library.custom_op("gtpo_kernels::replay_bwd", mutates_args=())
def replay_bwd(logits3: torch.Tensor, rows_b: torch.Tensor, rows_t: torch.Tensor, y: torch.Tensor,
               tau: torch.Tensor, token_ids: torch.Tensor, offsets: torch.Tensor, stats: torch.Tensor,
               ent: torch.Tensor, c: torch.Tensor, e: Optional[torch.Tensor], scale: float = 1.0,
               softcap: Optional[float] = None, backend: str = "torch") -> torch.Tensor:
    grad3 = torch.zeros(logits3.shape, dtype=logits3.dtype, device=logits3.device)
    _impl(backend).replay_bwd(logits3, grad3, rows_b, rows_t, y, tau, token_ids, offsets, stats, ent, c, e,
                              scale, softcap)
    return grad3


@replay_bwd.register_fake
def _(logits3, rows_b, rows_t, y, tau, token_ids, offsets, stats, ent, c, e, scale=1.0, softcap=None,
      backend="torch"):
    return torch.empty(logits3.shape, dtype=logits3.dtype, device=logits3.device)


@torch.library.custom_op("gtpo_kernels::attach_replay_grad", mutates_args=())
def attach_replay_grad(logits3: torch.Tensor, value: torch.Tensor, rows_b: torch.Tensor, rows_t: torch.Tensor,
                       y: torch.Tensor, tau: torch.Tensor, token_ids: torch.Tensor, offsets: torch.Tensor,
                       stats: torch.Tensor, ent: torch.Tensor, c: torch.Tensor, e: Optional[torch.Tensor],
                       scale: float = 1.0, softcap: Optional[float] = None, backend: str = "torch") -> torch.Tensor:
    return value.clone()


@attach_replay_grad.register_fake
def _(logits3, value, rows_b, rows_t, y, tau, token_ids, offsets, stats, ent, c, e, scale=1.0, softcap=None,
      backend="torch"):
    return torch.empty_like(value)


def _setup_context(ctx, inputs, output):
    logits3, _value, rows_b, rows_t, y, tau, token_ids, offsets, stats, ent, c, e, scale, softcap, backend = inputs
    ctx.save_for_backward(logits3, rows_b, rows_t, y, tau, token_ids, offsets, stats, ent, c, e)
    ctx.meta = (scale, softcap, backend)


def _backward(ctx, grad):
    logits3, rows_b, rows_t, y, tau, token_ids, offsets, stats, ent, c, e = ctx.saved_tensors
    scale, softcap, backend = ctx.meta
    g = grad.reshape(-1).to(c.dtype)  # scalar loss: (1,); per token: one each
    grad3 = replay_bwd(logits3, rows_b, rows_t, y, tau, token_ids, offsets, stats, ent, _scale(c, g), _scale(e, g),
                       scale, softcap, backend)
    return (grad3,) + (None,) * 14


attach_replay_grad.register_autograd(_backward, setup_context=_setup_context)


# called eagerly without torch.library's per-call Python (kernels/eager.py)
replay_fwd, replay_bwd = eager(replay_fwd), eager(replay_bwd)
attach_replay_grad = eager(attach_replay_grad, _backward, _setup_context)
