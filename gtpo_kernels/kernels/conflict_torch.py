"""The raw conflict flags of spec section 3 in PyTorch (the CPU twin of conflict_triton.py).

A token of an active completion is a raw conflict when, in its group and at the same aligned position,
its id stands masked-in in at least one positive and one negative completion. We find that without a
table indexed by vocabulary id and without Python loops: sort the keys (group, position, id), mark the
segments of equal keys, and count positives and negatives per segment (O(B*T) memory, sort time).
"""
from __future__ import annotations

import torch

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
