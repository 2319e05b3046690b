"""The loss math in the epilogue kernel when the per-token log-probs and entropies come from elsewhere, as
`torch.library` custom ops (opaque to torch.compile, with fake implementations; nothing reads the device
on the host):

    logps_epilogue(logp, ent, ...)      the caller's log-probs (and entropies): _prep_kernel, then the
                                        epilogue (two launches); autograd: d value / d logp = c g and
                                        d value / d ent = e g (one launch, _scale_kernel)
        -> [value, logp, H, loss_tok, c, e, lam, n_conf, kept (uint8), Hbar, metrics (9,), status (1,),
            flags (n,)]
    replay_epilogue(logits3, ids, token_ids, offsets, ...)
                                        the sampler's recorded kept sets (spec 13): _flat_sets_kernel, the
                                        replay kernel, _set_check_kernel, the epilogue (four launches);
                                        autograd: _scale_kernel, a zero gradient and the replay's
                                        gradient kernel (three launches)
        -> logps_epilogue's 13, then stats (n, 3), flat offsets (n + 1,), the rows of logits3 and of its
           gradient (n,), tau (n,), spec 13's metrics (2,) = (mean_kept_size, replay_restored_frac)

`floats` and `flags` are the epilogue's (loss_ops.FLOATS / FLAGS), with PACKED set: the epilogue reads the
cu_seqlens the first kernel writes (logps_triton's docstring). T: tokens per completion in the padded form
(0 packed, where `cu` is the caller's cu_seqlens). check: unvalidated, a non-finite entropy at a counted
token makes every output NaN (spec 6).
"""
from __future__ import annotations

from typing import List, Optional

import torch
import triton
from torch import Tensor

from . import loss_ops
from .logps_triton import (BLOCK, DUP_BLOCK, _flat_sets_kernel, _prep_kernel, _scale_kernel,
                           _set_check_kernel)
from .replay_triton import BLOCK_K, _replay_bwd_kernel, _replay_fwd_kernel
from .eager import eager


def _flat(x):
    return None if x is None else x.reshape(-1).contiguous()


def _has_e(flags):
    return bool(dict(zip(loss_ops.FLAGS, flags))["HAS_E"])


def scale(grad, c, e, dtypes):
    """(c g, e g or None) in `dtypes`, exactly 0 where c (e) is 0; grad: the value's upstream gradient
    (one element, or one per token, any stride)."""
    n = c.numel()
    g = grad.reshape(-1)
    per_token = g.numel() > 1 and g.stride(0) != 0  # (an expanded one, as sum()'s backward gives: one element)
    g = g.contiguous() if per_token else g[:1]
    gc = torch.empty(n, dtype=dtypes[0], device=c.device)
    ge = None if e is None else torch.empty(n, dtype=dtypes[1], device=c.device)
    if n:
        _scale_kernel[(triton.cdiv(n, BLOCK),)](g, c, c if e is None else e, gc,
                                                gc if ge is None else ge, n, PER_TOKEN=per_token,
                                                HAS_E=e is not None, BLOCK=BLOCK, num_warps=4)
    return gc, ge


@torch.library.custom_op("gtpo_kernels::logps_epilogue", mutates_args=())
def logps_epilogue(logp: Tensor, ent: Optional[Tensor], mask: Optional[Tensor], cu: Optional[Tensor], adv: Tensor,
                   old: Optional[Tensor], ref: Optional[Tensor], lam: Optional[Tensor], n_conf: Optional[Tensor],
                   num_items: Optional[Tensor], roll: Optional[Tensor], floats: List[float], flags: List[int],
                   B: int, T: int, check: bool, ids: Optional[Tensor], rw: Optional[Tensor],
                   hp: Optional[Tensor], draws: Optional[Tensor]) -> List[Tensor]:
    """ids (n,): validating, the tokens' ids (the prep kernel flags a counted one outside [0, 2**31) and a
    non-finite counted entropy, for the status word); None: no such checks. rw: the rollout weights as the
    epilogue reads them (flags' RW); hp: the hyper-parameters it reads by pointer (flags' HP); draws: clip_cov's
    uniform draws (n,)."""
    n = logp.numel()
    outs = loss_ops.epilogue_outputs(logp, n, B, flags)
    bad = torch.empty(n, dtype=torch.int8, device=logp.device)
    cu_out = torch.empty(B + 1, dtype=torch.int64, device=logp.device)
    lp, en = _flat(logp), _flat(ent)
    _prep_kernel[(1,)](lp, lp if en is None else en, lp if mask is None else mask, cu_out if cu is None else cu,
                       bad if ids is None else ids, outs[1], outs[2], bad, cu_out, B, T, n, HAS_ENT=en is not None,
                       HAS_MASK=mask is not None, PACKED=cu is not None, CHECK=check and en is not None, BLOCK=BLOCK,
                       VALIDATE=ids is not None, num_warps=4)
    loss_ops.epilogue(outs[1], outs[2], bad, mask, cu_out, adv, old, ref, lam, n_conf, num_items, floats, flags, B,
                      roll, outs, rw=rw, hp=hp, draws=draws)
    return outs + [bad]


@logps_epilogue.register_fake
def _(logp, ent, mask, cu, adv, old, ref, lam, n_conf, num_items, roll, floats, flags, B, T, check, ids, rw, hp,
      draws):
    n = logp.numel()
    return loss_ops.epilogue_outputs(logp, n, B, flags) + [logp.new_empty(n, dtype=torch.int8)]


def _logps_setup(ctx, inputs, output):
    logp, ent, flags = inputs[0], inputs[1], inputs[12]
    ctx.save_for_backward(output[4], output[5] if _has_e(flags) and ent is not None else None)
    ctx.meta = (logp.shape, logp.dtype, None if ent is None else (ent.shape, ent.dtype))
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # no zero gradients made for the outputs without one


@torch.library.custom_op("gtpo_kernels::logps_epilogue_bwd", mutates_args=())
def logps_epilogue_bwd(grad: Tensor, c: Tensor, e: Optional[Tensor], lp_dtype: torch.dtype,
                       ent_dtype: torch.dtype) -> List[Tensor]:
    """logps_epilogue's backward: [c g, e g (empty without e)] (one launch)."""
    gc, ge = scale(grad, c, e, (lp_dtype, ent_dtype))
    return [gc, c.new_empty(0, dtype=ent_dtype) if ge is None else ge]


@logps_epilogue_bwd.register_fake
def _(grad, c, e, lp_dtype, ent_dtype):
    return [c.new_empty(c.shape, dtype=lp_dtype), c.new_empty(c.shape if e is not None else 0, dtype=ent_dtype)]


def _logps_backward(ctx, grads):
    c, e = ctx.saved_tensors
    (shape, dtype, ent_meta), grad = ctx.meta, grads[0]
    need_lp, need_ent = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and e is not None
    if grad is None or not (need_lp or need_ent):
        return (None,) * 20
    gc, ge = logps_epilogue_bwd(grad, c, e if need_ent else None, dtype,
                                dtype if ent_meta is None else ent_meta[1])
    return (gc.view(shape) if need_lp else None, ge.view(ent_meta[0]) if need_ent else None) + (None,) * 18


logps_epilogue.register_autograd(_logps_backward, setup_context=_logps_setup)


def _replay_outputs(like, n, B, flags):
    f32, i64 = dict(device=like.device, dtype=torch.float32), dict(device=like.device, dtype=torch.int64)
    return loss_ops.epilogue_outputs(like, n, B, flags) + [
        torch.empty(n, device=like.device, dtype=torch.int8), torch.empty((n, 3), **f32), torch.empty(n + 1, **i64),
        torch.empty(n, **i64), torch.empty(n, **i64), torch.empty(n, **f32), torch.empty(2, **f32)]


@torch.library.custom_op("gtpo_kernels::replay_epilogue", mutates_args=())
def replay_epilogue(logits3: Tensor, ids: Tensor, token_ids: Tensor, offsets: Tensor, tau: Optional[Tensor],
                    tau_value: float, logits_start: int, mask: Optional[Tensor], cu: Optional[Tensor], adv: Tensor,
                    old: Optional[Tensor], ref: Optional[Tensor], lam: Optional[Tensor], n_conf: Optional[Tensor],
                    num_items: Optional[Tensor], roll: Optional[Tensor], floats: List[float], flags: List[int],
                    B: int, T: int, rw: Optional[Tensor], hp: Optional[Tensor],
                    draws: Optional[Tensor]) -> List[Tensor]:
    """tau: None (tau_value), one element or one per token (n,); logits3 (B, T_l, V) (packed: (1, N_l, V))
    with vocabulary stride 1; ids (n,) the sampled ids; token_ids, offsets the recorded sets (M + 1,); rw: the
    rollout weights as the epilogue reads them (flags' RW); hp: the hyper-parameters it reads by pointer (flags' HP);
    draws: clip_cov's uniform draws (n,)."""
    n, V = ids.numel(), logits3.shape[-1]
    outs = _replay_outputs(logits3, n, B, flags)
    flags_t, stats, flat, rows, grows, tau_n, met = outs[12:]
    cu_out = torch.empty(B + 1, dtype=torch.int64, device=logits3.device)
    mode = 0 if tau is None else (2 if tau.numel() == 1 else 1)
    _flat_sets_kernel[(1,)](flat if mask is None else mask, offsets, cu_out if cu is None else cu,
                            tau_n if tau is None else tau, flat, rows, grows, tau_n, cu_out, met, B, T, n,
                            offsets.numel() - 1, token_ids.numel(), logits_start, logits3.stride(0),
                            logits3.stride(1), logits3.shape[1] * V, V, tau_value, HAS_MASK=mask is not None,
                            PACKED=cu is not None, TAU_MODE=mode, BLOCK=BLOCK,
                            VALIDATE=bool(flags[loss_ops.FLAGS.index("VALIDATE")]), num_warps=4)
    kept = token_ids if token_ids.numel() else flat  # (an empty set list: never read)
    if n:
        _replay_fwd_kernel[(n,)](logits3, rows, rows, ids, tau_n, kept, flat, outs[1], outs[2], stats, flags_t, V,
                                 1, 0, 1, 1.0, 1.0, 1.0, TAU_PTR=True, HAS_SCALE=False, HAS_SOFTCAP=False,
                                 BLOCK_K=BLOCK_K)  # (rows: offsets formed by _flat_sets_kernel)
        _set_check_kernel[(n,)](flat if mask is None else mask, flat, kept, flags_t, outs[2], met,
                                HAS_MASK=mask is not None, DUP_BLOCK=DUP_BLOCK)
    loss_ops.epilogue(outs[1], outs[2], flags_t, mask, cu_out, adv, old, ref, lam, n_conf, num_items, floats, flags,
                      B, roll, outs[:12], rw=rw, hp=hp, draws=draws)
    return outs


@replay_epilogue.register_fake
def _(logits3, ids, token_ids, offsets, tau, tau_value, logits_start, mask, cu, adv, old, ref, lam, n_conf,
      num_items, roll, floats, flags, B, T, rw, hp, draws):
    return _replay_outputs(logits3, ids.numel(), B, flags)


def _replay_setup(ctx, inputs, output):
    logits3, ids, token_ids, flags = inputs[0], inputs[1], inputs[2], inputs[17]
    stats, flat, rows, grows, tau_n = output[13:18]
    ctx.save_for_backward(logits3, ids, token_ids, stats, flat, rows, grows, tau_n, output[2], output[4],
                          output[5] if _has_e(flags) else None)
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


@torch.library.custom_op("gtpo_kernels::replay_epilogue_bwd", mutates_args=())
def replay_epilogue_bwd(grad: Tensor, logits3: Tensor, ids: Tensor, token_ids: Tensor, stats: Tensor, flat: Tensor,
                        rows: Tensor, grows: Tensor, tau_n: Tensor, ent: Tensor, c: Tensor,
                        e: Optional[Tensor]) -> Tensor:
    """replay_epilogue's backward: c g and e g, then the replay's gradient kernel into zeros (3 launches)."""
    gc, ge = scale(grad, c, e, (torch.float32, torch.float32))
    grad3 = torch.zeros(logits3.shape, dtype=logits3.dtype, device=logits3.device)  # 0 outside the kept sets
    n = ids.numel()
    if n:
        _replay_bwd_kernel[(n,)](logits3, grad3, rows, rows, grows, grows, ids, tau_n,
                                 token_ids if token_ids.numel() else flat, flat, stats, ent, gc, gc if ge is None else ge,
                                 logits3.shape[-1], 1, 0, 1, 0, 1, 1.0, 1.0, 1.0, TAU_PTR=True, HAS_E=ge is not None,
                                 HAS_SCALE=False, HAS_SOFTCAP=False, BLOCK_K=BLOCK_K)
    return grad3


@replay_epilogue_bwd.register_fake
def _(grad, logits3, ids, token_ids, stats, flat, rows, grows, tau_n, ent, c, e):
    return torch.empty(logits3.shape, dtype=logits3.dtype, device=logits3.device)


def _replay_backward(ctx, grads):
    if grads[0] is None or not ctx.needs_input_grad[0]:
        return (None,) * 23
    return (replay_epilogue_bwd(grads[0], *ctx.saved_tensors),) + (None,) * 22


replay_epilogue.register_autograd(_replay_backward, setup_context=_replay_setup)


# called eagerly without torch.library's per-call Python (kernels/eager.py)
logps_epilogue = eager(logps_epilogue, _logps_backward, _logps_setup)
replay_epilogue = eager(replay_epilogue, _replay_backward, _replay_setup)
logps_epilogue_bwd, replay_epilogue_bwd = eager(logps_epilogue_bwd), eager(replay_epilogue_bwd)
