"""Conflict-token weights lambda (spec section 3) from the raw flags, vectorized over the whole batch.

For each alignment (forward: row t; backward: rows counted from each completion's last counted row) the
raw flags come from the `raw_conflicts` custom op (kernels: a Triton kernel or a sort); the conflict
region is the leading run of raw conflicts (a cumulative product along the positions); lambda is the
product of the two alignments' weights.
"""
from __future__ import annotations

import torch

from ..core.layout import pad, packed_layout
from ..kernels import ops


def _leading_run(raw):
    return torch.cumprod(raw.to(torch.int32), dim=1).bool()


def conflict_runs(ids, m, adv, group_size, backend="torch"):
    """Forward and backward conflict regions, each (B, T) bool, for padded ids/mask. The raw flags come
    from `ops.raw_conflicts`: the Triton kernel or the sort (kernels.dispatch)."""
    B, T = ids.shape
    ids = ids.long()
    pos, neg = adv > 0, adv < 0

    def raw(ids, m):
        return ops.raw_conflicts(ids, m, pos, neg, group_size, backend)
    conf_f = _leading_run(raw(ids, m))
    # right-align every completion at its last counted row: aligned index r = last - t
    t_idx = torch.arange(T, device=ids.device)
    # (a column of -1 closes each row: T may be 0, or a size known only at run time, which tracing never branches on)
    last = torch.cat([torch.where(m, t_idx, -1), torch.full((B, 1), -1, device=ids.device)], 1).amax(dim=1)
    src = last[:, None] - t_idx[None, :]  # row t of completion i seen at aligned index r
    valid = src >= 0
    src_c = src.clamp(min=0)
    ids_r = ids.gather(1, src_c)
    m_r = m.gather(1, src_c) & valid
    conf_r = _leading_run(raw(ids_r, m_r))
    conf_b = conf_r.gather(1, src_c) & valid  # back to row order: t = last - r  <=>  r = last - t
    return conf_f, conf_b


def weights_from_runs(conf_f, conf_b, adv, pos_weight, neg_weight, dtype=torch.float32):
    pos = (adv > 0)[:, None]
    neg = (adv < 0)[:, None]
    one = torch.ones((), dtype=dtype, device=adv.device)

    def lam(conf):
        return torch.where(conf & pos, pos_weight * one, torch.where(conf & neg, neg_weight * one, one))

    n_conf = torch.maximum(conf_f.sum(1), conf_b.sum(1)).clamp(min=1).to(dtype)
    return (lam(conf_f) * lam(conf_b)).to(dtype), n_conf


ID_LIMIT = 2 ** 31  # counted ids must lie in [0, 2**31) (the sort packs them into 31 bits)


def invalid_ids(ids, counted):
    """Counted tokens whose id lies outside [0, 2**31) (N,) bool."""
    ids = ids.long()  # an int32 tensor would wrap 2**31 around
    return counted & ((ids < 0) | (ids >= ID_LIMIT))


def conflict_flat(b, group_size, cfg, dtype, backend, layout=None):
    """lam (N,) flat and n_conf (B,) for a prepared batch (padded or packed). With a
    grouping.GroupLayout, rows are first moved to contiguous groups of layout.size slots. A completion
    with a counted id outside [0, 2**31) (unvalidated) gets lam = NaN and n_conf = NaN; its invalid tokens
    take part in no one's conflicts. An unvalidated malformed cu_seqlens (b.malformed) makes every one NaN.
    An unvalidated max_seqlen shorter than a completion makes its whole group NaN: the runs compared
    within a group (a suffix aligned at each completion's end) would miss the tokens left out; so too an
    unvalidated NaN advantage, whose sign decides every member's conflicts."""
    bad_tok = invalid_ids(b.ids, b.counted)
    counted = b.counted & ~bad_tok
    over = None
    if b.packed:
        L, pos = packed_layout(b)
        # an unvalidated max_seqlen shorter than a completion: its tokens past L go to a spare column,
        # masked out, and the completion's weights are NaN (spec 6: never a write out of bounds)
        over = pos >= L
        pos = torch.where(over, L, pos)
        ids, m = pad(b, b.ids.long(), L + 1, pos), pad(b, counted & ~over, L + 1, pos)
    else:
        ids, m = b.ids.reshape(b.tok_shape), counted.reshape(b.tok_shape)
    if layout is None:
        conf_f, conf_b = conflict_runs(ids, m, b.adv, group_size, backend)
    else:  # padding slots: masked out, advantage 0 (inactive): they change no weight
        conf_f, conf_b = conflict_runs(layout.to_slots(ids), layout.to_slots(m, False),
                                       layout.to_slots(b.adv), layout.size, backend)
        conf_f, conf_b = conf_f[layout.slot], conf_b[layout.slot]
    lam, n_conf = weights_from_runs(conf_f, conf_b, b.adv, cfg.conflict_pos_weight, cfg.conflict_neg_weight,
                                    dtype)
    lam = lam[b.seg, pos] if b.packed else lam.reshape(-1)
    bad = torch.zeros(b.B, dtype=torch.int32, device=lam.device).index_add_(0, b.seg, bad_tok.to(torch.int32)) > 0
    cut = torch.isnan(b.adv)  # a NaN advantage or a truncated completion: NaN for its whole group
    if over is not None:
        cut = cut | (torch.zeros(b.B, dtype=torch.int32, device=lam.device).index_add_(0, b.seg, over.to(torch.int32)) > 0)
    group = (torch.arange(b.B, device=lam.device) // group_size) if layout is None else layout.code
    n_groups = (b.B + group_size - 1) // group_size if layout is None else layout.n_groups
    hit = torch.zeros(n_groups, dtype=torch.int32, device=lam.device).index_add_(0, group, cut.to(torch.int32)) > 0
    bad = bad | hit[group]
    if b.malformed is not None:  # an unvalidated malformed cu_seqlens: every weight NaN (its stand-in is no layout)
        bad = bad | b.malformed
    nan = torch.full((), float("nan"), dtype=dtype, device=lam.device)
    return torch.where(bad[b.seg], nan, lam), torch.where(bad, nan, n_conf)
