"""The autograd Function around the two vocabulary passes.

forward : vocabulary pass (logp, H, lse per token) -> O(N) surrogate -> loss, and the per-token
          coefficients c = dL/dlogp, e = dL/dH of the surrogate.
backward: vocabulary pass that recomputes the softmax from lse and writes
          dL/dlogits = g * (c * dlogp/dz + e * dH/dz)   (see vocab_triton's docstring).
Saved for backward: the logits by reference and O(1) numbers per token (ids, lse, H, 1 - p_y, c, e).
"""
from __future__ import annotations

import torch

from . import dispatch
from .checks import raise_on_flags
from .surrogate import surrogate


def out_dtype(logits):
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


class GTPOLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, batch, cfg, backend, inplace, validate, num_items, aux):
        b = batch
        logp, ent, lse, q, bad = dispatch.logprob_fwd(backend, b.logits3, b.ids, b.counted, cfg.temperature,
                                                  b.logits_start)
        if validate:
            raise_on_flags(bad, b.tok_shape)
        dt = out_dtype(logits)
        res = surrogate(logp.to(dt), ent.to(dt), b.counted, b.seg, b.B, b.adv, cfg, old=b.old, ref=b.ref,
                        lam=b.lam, n_conf=b.n_conf, num_items=num_items, max_len=b.max_len)
        weighted = res["weight"] * res["loss_tok"]
        loss = weighted.reshape(b.tok_shape) if cfg.loss_agg == "none" else weighted.sum()
        # the kernel's coefficients: float32 for Triton, the accumulation dtype for torch
        cdt = torch.float32 if backend == "triton" else lse.dtype
        c = res["c"].to(cdt)
        e = None if res["e"] is None else res["e"].to(cdt)
        tensors = (b.logits3, b.ids, lse, ent, q, c) + (() if e is None else (e,))
        ctx.save_for_backward(*tensors)
        ctx.meta = (backend, inplace, cfg.temperature, b.logits_start, tuple(logits.shape), e is not None)
        logps = res["logp"].reshape(b.tok_shape)
        entropy = res["ent"].reshape(b.tok_shape)
        per_token = res["loss_tok"].reshape(b.tok_shape)
        ctx.mark_non_differentiable(logps, entropy, per_token)
        aux.update(kept=res["kept"], seq_entropy=res["seq_entropy"], metrics=res["metrics"])
        return loss, logps, entropy, per_token

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        backend, inplace, temperature, logits_start, shape, has_e = ctx.meta
        saved = ctx.saved_tensors
        logits3, ids, lse, ent, q, c = saved[:6]
        e = saved[6] if has_e else None
        if not ctx.needs_input_grad[0]:
            return (None,) * 8
        g = grad_loss.reshape(-1).to(c.dtype)  # scalar loss: (1,); 'none': one per token
        c = c * g
        e = None if e is None else e * g
        grad3 = logits3 if inplace else torch.empty(logits3.shape, dtype=logits3.dtype, device=logits3.device)
        dispatch.logprob_bwd(backend, logits3, grad3, ids, lse, ent, q, c, e, temperature, logits_start)
        return (grad3.view(shape),) + (None,) * 7
