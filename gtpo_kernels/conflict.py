"""Conflict-token weights lambda (spec section 3), vectorized over the whole batch.

For each alignment (forward: row t; backward: rows counted from each completion's last counted row),
a token of an active completion is a raw conflict when, in its group and at the same aligned position,
its id stands masked-in in at least one positive and one negative completion. We find that without a
table indexed by vocabulary id and without Python loops: sort the keys (group, position, id), mark the
segments of equal keys, and count positives and negatives per segment (O(B*T) memory, sort time).
The conflict region is the leading run of raw conflicts (a cumulative product along the positions).
"""
from __future__ import annotations

import torch

from . import ops

_ID_BITS = 31  # ids must fit in 31 bits to be packed with (group, position) into one int64 key


def raw_conflicts(ids, m, pos, neg, group_size):
    """ids (B, T) int64, m (B, T) bool, pos/neg (B,) bool -> raw conflict flags (B, T) bool."""
    B, T = ids.shape
    group = torch.arange(B, device=ids.device) // group_size
    cell = group[:, None] * T + torch.arange(T, device=ids.device)[None, :]
    key = (cell << _ID_BITS) | ids.clamp(0, (1 << _ID_BITS) - 1)
    key = key.reshape(-1)
    order = torch.argsort(key)
    k_sorted = key[order]
    new_seg = torch.ones_like(k_sorted, dtype=torch.bool)
    new_seg[1:] = k_sorted[1:] != k_sorted[:-1]
    seg_sorted = torch.cumsum(new_seg.to(torch.int64), 0) - 1
    seg = torch.empty_like(seg_sorted)
    seg[order] = seg_sorted  # segment of each (i, t)
    n_seg = key.numel()  # upper bound; no host sync for the true count
    in_pos = (m & pos[:, None]).reshape(-1).to(torch.int32)
    in_neg = (m & neg[:, None]).reshape(-1).to(torch.int32)
    cnt_pos = torch.zeros(n_seg, dtype=torch.int32, device=ids.device).index_add_(0, seg, in_pos)
    cnt_neg = torch.zeros(n_seg, dtype=torch.int32, device=ids.device).index_add_(0, seg, in_neg)
    both = ((cnt_pos > 0) & (cnt_neg > 0))[seg].reshape(B, T)
    return both & m & (pos | neg)[:, None]


def _leading_run(raw):
    return torch.cumprod(raw.to(torch.int32), dim=1).bool()


def conflict_runs(ids, m, adv, group_size, backend="torch"):
    """Forward and backward conflict regions, each (B, T) bool, for padded ids/mask. The raw flags come
    from `ops.raw_conflicts`: the Triton kernel (conflict_triton) or the sort above (dispatch)."""
    B, T = ids.shape
    ids = ids.long()
    pos, neg = adv > 0, adv < 0

    def raw(ids, m):
        return ops.raw_conflicts(ids, m, pos, neg, group_size, backend)
    conf_f = _leading_run(raw(ids, m))
    # right-align every completion at its last counted row: aligned index r = last - t
    t_idx = torch.arange(T, device=ids.device)
    last = torch.where(m, t_idx, -1).amax(dim=1) if T else torch.full((B,), -1, device=ids.device)
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
