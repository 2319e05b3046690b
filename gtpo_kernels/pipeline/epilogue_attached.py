"""The loss on logits split over the vocabulary across ranks (process_group, spec 12), its epilogue and
backward those of the fused custom op (kernels/loss_ops.fused_loss), its forward merged over the group.

    forward     each rank's vocabulary kernel, its statistics merged over the group: the merged sums
                (vocab_parallel.vp_sums), the same on every rank; where the top-entropy mask's key reads H
                before the epilogue (without clip_cov or kl_cov), or the slices merge block by block, the
                finished logp, H, flags and stats (vocab_parallel.vp_forward)
    epilogue    one launch in loss_ops.fused_loss, given either (clip_cov and kl_cov: two around a sort, which
                sorts the top-entropy mask's keys too): from the merged sums it first forms each token's logp,
                H, flags and the backward's stats (vp_merge_triton._finish_at); then the loss, its outputs and
                metrics, and c = dL/dlogp, e = dL/dH
    backward    fused_loss's: the backward vocabulary kernel on this rank's slice (in place or not)

The batch was checked on the host when validating (not in the kernel); the status word is the call's one
more host read, and a flagged counted row raises there (checks.raise_on_flags). Every rank runs the same
epilogue on the same merged numbers, so whatever it decides (that error, the entropy filter's warning) is
the same on every rank.
"""
from __future__ import annotations

import torch

from ..distributed import vocab_parallel as parallel
from ..kernels import loss_ops, ops
from ..core import vocab_block
from ..core.layout import spread_rows
from . import epilogue


def takes(logits3, cfg, backend):
    """Whether this path computes the loss: the Triton backend, 16- or 32-bit logits, a config the epilogue
    covers (epilogue.covers)."""
    return backend == "triton" and logits3.dtype != torch.float64 and epilogue.covers(cfg)


def first(b, cfg):
    """Whether this rank's forward pass may run before the agreement, its row formed in the same launch
    (vocab_parallel.Pending; spec 8): the merged sums' path (not the top-entropy key's, which reads H first),
    on a slice whose size is no multiple of VOCAB_BLOCK (so not all the slices merge by blocks, or this is the
    last rank's: then its pass is spent and the block merge runs). A per-rank choice that changes no number."""
    return not (cfg.top_entropy_on and not cfg.batch_term) and b.logits3.shape[-1] % vocab_block.VOCAB_BLOCK != 0


def loss(b, cfg, backend, inplace, host, num_items, vp, tau=None):
    """GTPOOutput of the call (see the module docstring); tau: the call's temperature per token, or per
    completion (B,) (the kernels read it at each token's completion: b.tau_per_row), or None. vp: the
    VocabParallel, or a Pending agreement (first), made in the forward pass's launch."""
    with torch.no_grad():
        temperature = ops.tau_arg(cfg.temperature if tau is None else tau, b.logits3, backend)  # (a number: by value)
        per_seq = tau is not None and b.tau_per_row  # (tau is b.tau: one per completion)
        fwd = None
        if isinstance(vp, parallel.Pending):  # this slice's pass and the agreement's row in one launch
            ids = b.given["ids"]
            if vp.plan is not None:
                fwd = parallel.vp_sums(b, ids, temperature, backend, None, pending=vp,
                                       tau_seq=(2 if b.packed else 1) * per_seq, conflicts=b.conflicts)
            vp = vp.vp if vp.vp is not None else vp.made()
        # (the epilogue reads the flags itself: a flagged counted token's outputs are NaN)
        if fwd is None and (vp.blockwise or (cfg.top_entropy_on and not cfg.batch_term)):  # (the key reads H first)
            if per_seq:  # (one per completion: spread on the tokens for these passes)
                temperature, per_seq = spread_rows(temperature, b.seq_rows), False
            ids = b.ids
            fwd = parallel.vp_forward(b, ids, temperature, backend, vp.group, vp.V, sizes=vp.sizes, id_start=vp.start)
        elif fwd is None:  # the merged sums, finished by the epilogue kernel (no launch of the merge's finish); the ids
            ids = b.given["ids"]  # as given (the epilogue kernel flags every token of a malformed cu_seqlens itself)
            fwd = parallel.vp_sums(b, ids, temperature, backend, vp.group, id_start=vp.start,
                                   tau_seq=(2 if b.packed else 1) * per_seq, conflicts=b.conflicts)
    if b.conflicts is not None:  # the conflict weights computed in the call, where no launch took them
        b.conflicts.launch()
    by_value = isinstance(temperature, float)
    floats, flags = epilogue.arguments(b, cfg, num_items, temperature if by_value else 1.0, False, not by_value)
    mask, adv, old, ref, lam, n_conf, cu, roll, rw, hp, u = epilogue.tensors(b, cfg)
    # the epilogue in the op whose backward is the vocabulary kernel on this slice (its value is the loss itself)
    outs = loss_ops.fused_loss(b.logits3, ids, mask, cu, adv, old, ref, lam, n_conf,
                               num_items if isinstance(num_items, torch.Tensor) else None,
                               None if by_value else temperature, floats, flags, b.logits_start, b.B, roll, rw, hp,
                               u, [None] * 3, [float("nan")] * 3, list(fwd), inplace,
                               (2 if b.packed else 1) * per_seq, vp.start, vp.V)
    # validating: a flagged counted row raises (every rank alike)
    return epilogue.output(outs[:12], fwd[3] if len(fwd) == 4 else outs[13], b, cfg, host)
