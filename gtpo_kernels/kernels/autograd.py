"""The autograd rule of `ops.attach_grad`: the loss value's backward is the gradient pass.

`gtpo_loss` computes the loss value and the per-token coefficients c = dL/dlogp, e = dL/dH in closed
form between the passes (surrogate.py, O(tokens)); `attach_grad` hands the value back with

    dL/dlogits = g * (c * dlogp/dz + e * dH/dz)   (see vocab_bwd_triton's docstring)

with z the raw logits (scale and softcap, the tile's transforms, are in the chain rule of the kernels).

attached, g being the incoming gradient (a scalar, or one per token with loss_agg='none'). Saved for
backward: the logits by reference and O(1) numbers per token (ids, stats, H, c, e).
"""
from __future__ import annotations

import torch

from . import ops
from .eager import eager


def _setup_context(ctx, inputs, output):
    logits3, _value, ids, stats, ent, c, e, temperature, logits_start, scale, softcap, backend, inplace, tau, \
        id_start = inputs
    ctx.save_for_backward(logits3, ids, stats, ent, c, e, temperature)
    ctx.meta = (logits_start, scale, softcap, backend, inplace, tau, id_start)


def _backward(ctx, grad):
    logits3, ids, stats, ent, c, e, temperature = ctx.saved_tensors
    logits_start, scale, softcap, backend, inplace, tau, id_start = ctx.meta
    g = grad.reshape(-1)  # scalar loss: (1,); loss_agg='none': one per token
    if inplace:  # (the pass multiplies c and e by g too)
        ops.vocab_bwd_inplace(logits3, ids, stats, ent, c, e, temperature, logits_start, scale, softcap, backend,
                              g=g.to(c.dtype), tau_value=tau, id_start=id_start)
        grad3 = logits3.view(logits3.shape)  # a fresh view: autograd can take it as .grad without a copy
    else:  # the pass multiplies c and e by g itself
        grad3 = ops.vocab_bwd(logits3, ids, stats, ent, c, e, temperature, logits_start, scale, softcap, backend,
                              g=g.to(c.dtype), tau_value=tau, id_start=id_start)
    return (grad3,) + (None,) * 14


ops.attach_grad.register_autograd(_backward, setup_context=_setup_context)


ops.attach_grad = eager(ops.attach_grad, _backward, _setup_context)  # (kernels/eager.py)
