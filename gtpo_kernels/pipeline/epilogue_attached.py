"""The loss math in the epilogue kernel where the vocabulary passes are not the fused custom op's
(kernels/loss_ops.fused_loss): logits split over the vocabulary across ranks (process_group, spec 12).

    forward     each rank's vocabulary kernel with the statistics merged over the group
                (vocab_parallel.vp_forward), so every rank holds the same per-token logp, H and flags
    epilogue    one launch (loss_ops.epilogue; clip_cov and kl_cov: two around a sort, which sorts the
                top-entropy mask's keys too): the loss, its outputs and metrics, and c = dL/dlogp, e = dL/dH
    backward    ops.attach_grad: the backward vocabulary kernel on this rank's slice (in place or not)

The batch was checked on the host when validating (not in the kernel); the status word is the call's one
more host read, and a flagged counted row raises there (checks.raise_on_flags). Every rank runs the same
epilogue on the same merged numbers, so whatever it decides (that error, the entropy filter's warning) is
the same on every rank.
"""
from __future__ import annotations

import torch

from ..distributed import vocab_parallel as parallel
from ..kernels import loss_ops, ops
from . import epilogue


def takes(logits3, cfg, backend):
    """Whether this path computes the loss: the Triton backend, 16- or 32-bit logits, a config the epilogue
    covers (epilogue.covers)."""
    return backend == "triton" and logits3.dtype != torch.float64 and epilogue.covers(cfg)


def loss(b, cfg, backend, inplace, host, num_items, vp, tau=None):
    """GTPOOutput of the call (see the module docstring); tau: the call's temperature per token or None."""
    with torch.no_grad():
        temperature = ops.tau_arg(cfg.temperature if tau is None else tau, b.logits3, backend)  # (a number: by value)
        # (the epilogue reads the flags itself: a flagged counted token's outputs are NaN)
        logp, ent, stats, bad = parallel.vp_forward(b, b.ids, temperature, backend, vp.group, vp.V, sizes=vp.sizes,
                                                    id_start=vp.start)
        floats, flags = epilogue.arguments(b, cfg, num_items, 1.0, False)
        mask, adv, old, ref, lam, n_conf, cu, roll, rw, hp, u = epilogue.tensors(b, cfg)
        outs = loss_ops.epilogue_outputs(logp, logp.numel(), b.B, flags)
        loss_ops.epilogue(logp, ent, bad, mask, cu, adv, old, ref, lam, n_conf,
                          num_items if isinstance(num_items, torch.Tensor) else None, floats, flags, b.B, roll, outs,
                          rw=rw, hp=hp, draws=u)
    cdt = stats.dtype
    has_e = flags[loss_ops.FLAGS.index("HAS_E")]
    value = outs[0].reshape(b.tok_shape) if cfg.loss_agg == "none" else outs[0]
    # (the epilogue's H: 0 where not counted, NaN where flagged, as the backward reads it)
    attached = ops.attach_grad(b.logits3, value, b.ids, stats, outs[2].to(cdt),
                               outs[4].to(cdt), outs[5].to(cdt) if has_e else None,
                               None if isinstance(temperature, float) else temperature, b.logits_start, backend=backend,
                               inplace=inplace, tau_value=temperature if isinstance(temperature, float) else 1.0,
                               id_start=vp.start)
    # validating: a flagged counted row raises (every rank alike)
    out = epilogue.output(outs, bad, b, cfg, host)
    out.loss = attached
    return out
