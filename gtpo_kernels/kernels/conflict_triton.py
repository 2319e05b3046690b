"""Triton kernel for the raw conflict flags of spec section 3 (the CUDA path of `conflict.py`).

One program takes one group and a block of aligned positions: a (BLOCK_G, BLOCK_T) tile of ids. It
walks the group's G members once (a runtime loop) and marks, for each tile entry, whether the same id
stands masked-in at that position in a positive and in a negative member. Work is O(G^2 T) per group,
linear in tokens for a fixed group size; memory is the (B, T) flags; no table indexed by vocabulary id.
The leading runs (a cumulative product along positions) and the right alignment stay in torch ops,
which need no host sync either.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T", "n_t_blocks"])
def _raw_conflicts_kernel(
    # pointers
    ids_ptr, mask_ptr, pos_ptr, neg_ptr,  # (B, T) int64 contiguous, (B, T) bool, (B,) bool, (B,) bool
    raw_ptr,  # out: (B, T) int8
    # sizes
    T, n_t_blocks, G,
    # meta
    BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)  # 1-D grid over (group, block of positions): no 65,535 limit
    grp = pid // n_t_blocks
    t0 = (pid - grp * n_t_blocks) * BLOCK_T
    gi = tl.arange(0, BLOCK_G)
    tt = t0 + tl.arange(0, BLOCK_T)
    rows = grp * G + gi  # the group's members
    in_g = gi < G
    in_t = tt < T
    tile = in_g[:, None] & in_t[None, :]
    offs = rows[:, None] * T + tt[None, :]
    ids = tl.load(ids_ptr + offs, mask=tile, other=-1)
    m = tl.load(mask_ptr + offs, mask=tile, other=0) != 0
    has_pos = tl.zeros([BLOCK_G, BLOCK_T], tl.int1)
    has_neg = tl.zeros([BLOCK_G, BLOCK_T], tl.int1)
    for j in range(0, G):
        row_j = grp * G + j
        ids_j = tl.load(ids_ptr + row_j * T + tt, mask=in_t, other=-2)
        m_j = tl.load(mask_ptr + row_j * T + tt, mask=in_t, other=0) != 0
        pos_j = tl.load(pos_ptr + row_j) != 0
        neg_j = tl.load(neg_ptr + row_j) != 0
        same = (ids == ids_j[None, :]) & m_j[None, :]
        has_pos = has_pos | (same & pos_j)
        has_neg = has_neg | (same & neg_j)
    pos_i = tl.load(pos_ptr + rows, mask=in_g, other=0) != 0
    neg_i = tl.load(neg_ptr + rows, mask=in_g, other=0) != 0
    active = (pos_i | neg_i)[:, None]
    raw = has_pos & has_neg & m & active
    tl.store(raw_ptr + offs, raw.to(tl.int8), mask=tile)


def raw_conflicts(ids, m, pos, neg, group_size, block_t=None):
    """Same contract as conflict.raw_conflicts: ids (B, T) int64, m (B, T) bool -> (B, T) bool."""
    B, T = ids.shape
    raw = torch.empty((B, T), dtype=torch.int8, device=ids.device)
    if B * T == 0:
        return raw.bool()
    block_g = triton.next_power_of_2(group_size)
    bt = block_t or max(16, 2048 // block_g)  # from the group size only: no recompile as T changes
    n_t_blocks = triton.cdiv(T, bt)
    grid = ((B // group_size) * n_t_blocks,)
    _raw_conflicts_kernel[grid](
        ids.contiguous(), m.contiguous(), pos.contiguous(), neg.contiguous(), raw,
        T, n_t_blocks, group_size, BLOCK_G=block_g, BLOCK_T=bt)
    return raw.bool()
