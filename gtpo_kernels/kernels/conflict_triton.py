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


ID_LIMIT = tl.constexpr(2 ** 31)  # counted ids must lie in [0, 2**31) (objective.conflict.ID_LIMIT)


@triton.jit
def _row_bounds(cu_ptr, rows, ok, N, T, PACKED: tl.constexpr):
    """(first token, length) of completions `rows` (0 where not `ok`): padded row i is [i T, (i + 1) T);
    packed [cu[i], cu[i + 1]) clamped into [0, N] (a malformed cu_seqlens is flagged by the caller, and
    never read out of bounds)."""
    if PACKED:
        s = tl.minimum(tl.maximum(tl.load(cu_ptr + rows, mask=ok, other=0).to(tl.int64), 0), N)
        e = tl.minimum(tl.maximum(tl.load(cu_ptr + rows + 1, mask=ok, other=0).to(tl.int64), s), N)
        return s, tl.where(ok, e - s, 0)
    return rows * T, tl.where(ok, rows * 0 + T, 0)


@triton.jit
def _tokens(ids_ptr, mask_ptr, offs, inside, HAS_MASK: tl.constexpr):
    """ids and whether each takes part in conflicts (inside, counted, id in [0, 2**31)), and whether it is
    a counted invalid id."""
    ids = tl.load(ids_ptr + offs, mask=inside, other=0).to(tl.int64)
    m = inside
    if HAS_MASK:
        m = m & (tl.load(mask_ptr + offs, mask=inside, other=0) != 0)
    bad = m & ((ids < 0) | (ids >= ID_LIMIT))
    return ids, m & ~bad, bad


@triton.jit
def _raw(ids, m, act, last, gi, at, ids_ptr, mask_ptr, adv_ptr, cu_ptr, grp, G, N, T,
         ALIGN_END: tl.constexpr, PACKED: tl.constexpr, HAS_MASK: tl.constexpr):
    """raw conflict flags of a (BLOCK_G, BLOCK_T) tile: the same id counted at the same aligned position
    `at` (BLOCK_T,) in a positive and in a negative member of the group; aligned at the start, or with
    ALIGN_END at each member's last counted token (`last` (BLOCK_G,): position last - at)."""
    has_pos = tl.zeros(ids.shape, tl.int1)
    has_neg = tl.zeros(ids.shape, tl.int1)
    for j in range(0, G):
        row_j = grp * G + j
        s_j, n_j = _row_bounds(cu_ptr, row_j, row_j >= 0, N, T, PACKED)
        t_j = at
        if ALIGN_END:
            t_j = tl.sum(tl.where(gi == j, last, 0)) - at
        ids_j, m_j, _ = _tokens(ids_ptr, mask_ptr, s_j + t_j, (t_j >= 0) & (t_j < n_j), HAS_MASK)
        a_j = tl.load(adv_ptr + row_j).to(tl.float32)
        same = (ids == ids_j[None, :]) & m_j[None, :]
        has_pos = has_pos | tl.where(a_j > 0, same, False)  # (a scalar condition: where, not &)
        has_neg = has_neg | tl.where(a_j < 0, same, False)
    return has_pos & has_neg & m & act[:, None]


@triton.jit
def _run(raw, inside, alive):
    """The leading run of raw flags continued from the previous block (`alive` (BLOCK_G,): no break yet):
    (this block's part of the run, alive after it). A position outside the completion breaks it."""
    brk = tl.where(inside & raw, 0, 1)
    conf = alive[:, None] & (tl.cumsum(brk, axis=1) == 0)
    return conf, alive & (tl.sum(brk, axis=1) == 0)


@triton.jit
def _weight(conf, pos, neg, w_pos, w_neg):
    return tl.where(conf & pos[:, None], w_pos, tl.where(conf & neg[:, None], w_neg, 1.0))


@triton.jit(do_not_specialize=["B", "T", "N", "G"])
def _conflict_weights_kernel(
    ids_ptr, mask_ptr, adv_ptr, cu_ptr,  # the caller's ids (N,), mask (N,) any dtype, advantages (B,), cu (B + 1,)
    lam_ptr, nconf_ptr,  # out: lam (N,), n_conf (B,)
    B, T, N, G, w_pos, w_neg,  # completions, padded length, tokens, group size, the weights
    PACKED: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """_conflict_group: one program per group."""
    _conflict_group(tl.program_id(0).to(tl.int64), tl.num_programs(0), ids_ptr, mask_ptr, adv_ptr, cu_ptr, lam_ptr,
                    nconf_ptr, B, T, N, G, w_pos, w_neg, PACKED, HAS_MASK, BLOCK_G, BLOCK_T)


@triton.jit
def _conflict_group(grp, n_groups, ids_ptr, mask_ptr, adv_ptr, cu_ptr, lam_ptr, nconf_ptr, B, T, N, G, w_pos, w_neg,
                    PACKED: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr):
    """lam and n_conf of spec 3 for group `grp` (of n_groups) of G consecutive completions: a pass
    for each completion's last counted token and invalid ids, one in forward alignment (lam_f written),
    one in backward alignment (lam = lam_f lam_b). A counted id outside [0, 2**31) makes its completion's
    lam and n_conf NaN, a NaN advantage its group's; a malformed cu_seqlens makes every one NaN (each group
    then fills its share).
    Its own launch (_conflict_weights_kernel), or programs of the merge's sums launch (vp_merge_triton)."""
    gi = tl.arange(0, BLOCK_G)
    rows = grp * G + gi
    in_g = gi < G
    nan = float("nan")
    broken = grp < 0
    if PACKED:  # malformed: not from 0 to N, or decreasing (every program reads all of it, O(B))
        broken = (tl.load(cu_ptr).to(tl.int64) != 0) | (tl.load(cu_ptr + B).to(tl.int64) != N)
        for b0 in range(0, B, BLOCK_T):
            k = b0 + tl.arange(0, BLOCK_T)
            lo = tl.load(cu_ptr + k, mask=k < B, other=0).to(tl.int64)
            hi = tl.load(cu_ptr + k + 1, mask=k < B, other=0).to(tl.int64)
            broken = broken | (tl.max(tl.where((k < B) & (hi < lo), 1, 0)) > 0)
        share = tl.cdiv(N, n_groups)
        first = grp * share
        end = tl.where(broken, tl.minimum(first + share, N), first)  # then this program's share of lam: NaN
        for t0 in range(first, end, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            tl.store(lam_ptr + t, tl.full([BLOCK_T], nan, tl.float32), mask=t < end)
    start, n = _row_bounds(cu_ptr, rows, in_g, N, T, PACKED)
    adv = tl.load(adv_ptr + rows, mask=in_g, other=0).to(tl.float32)
    pos, neg = adv > 0, adv < 0
    lost = tl.max(tl.where(adv != adv, 1, 0)) > 0  # a NaN advantage: its whole group NaN (its sign decides all)
    act = pos | neg
    L = tl.where(broken, 0, tl.max(n))  # (no pass runs over a malformed cu_seqlens)
    last = tl.full([BLOCK_G], -1, tl.int64)
    bad = tl.zeros([BLOCK_G], tl.int1)
    for t0 in range(0, L, BLOCK_T):  # each completion's last counted position and invalid ids
        t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        inside = t[None, :] < n[:, None]
        _, m, bad_t = _tokens(ids_ptr, mask_ptr, start[:, None] + t[None, :], inside, HAS_MASK)
        last = tl.maximum(last, tl.max(tl.where(m, t[None, :], -1), axis=1))
        bad = bad | (tl.max(bad_t.to(tl.int32), axis=1) > 0)
    alive = in_g
    n_f = tl.zeros([BLOCK_G], tl.int32)
    for t0 in range(0, L, BLOCK_T):  # forward alignment: position t of every member
        t = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        inside = t[None, :] < n[:, None]
        offs = start[:, None] + t[None, :]
        ids, m, _ = _tokens(ids_ptr, mask_ptr, offs, inside, HAS_MASK)
        raw = _raw(ids, m, act, last, gi, t, ids_ptr, mask_ptr, adv_ptr, cu_ptr, grp, G, N, T,
                   False, PACKED, HAS_MASK)
        conf, alive = _run(raw, inside, alive)
        n_f += tl.sum(conf.to(tl.int32), axis=1)
        lam_f = tl.where(bad[:, None] | lost, nan, _weight(conf, pos, neg, w_pos, w_neg))
        tl.store(lam_ptr + offs, lam_f, mask=inside)
    tl.debug_barrier()  # the backward pass reads lam_f back
    alive = in_g
    n_b = tl.zeros([BLOCK_G], tl.int32)
    for r0 in range(0, L, BLOCK_T):  # backward alignment: r tokens before each member's last counted one
        r = r0 + tl.arange(0, BLOCK_T).to(tl.int64)
        t = last[:, None] - r[None, :]
        inside = (t >= 0) & in_g[:, None]
        offs = start[:, None] + t
        ids, m, _ = _tokens(ids_ptr, mask_ptr, offs, inside, HAS_MASK)
        raw = _raw(ids, m, act, last, gi, r, ids_ptr, mask_ptr, adv_ptr, cu_ptr, grp, G, N, T,
                   True, PACKED, HAS_MASK)
        conf, alive = _run(raw, inside, alive)
        n_b += tl.sum(conf.to(tl.int32), axis=1)
        lam_f = tl.load(lam_ptr + offs, mask=inside, other=1.0)
        tl.store(lam_ptr + offs, lam_f * _weight(conf, pos, neg, w_pos, w_neg), mask=inside)
    n_conf = tl.maximum(tl.maximum(n_f, n_b), 1).to(tl.float32)
    tl.store(nconf_ptr + rows, tl.where(bad | broken | lost, nan, n_conf), mask=in_g)


def conflict_weights(ids, mask, adv, cu, T, group_size, w_pos, w_neg, lam, n_conf):
    """lam (N,) and n_conf (B,) (float32, written) of B // group_size groups of consecutive completions,
    from the caller's tensors as given: ids (N,), mask (N,) or None, adv (B,), cu (B + 1,) (packed) or
    None (padded rows of T tokens). One launch; nothing read on the host."""
    B = adv.numel()
    N = ids.numel()
    if B == 0:
        return
    _conflict_weights_kernel[(B // group_size,)](
        ids, ids if mask is None else mask, adv, ids if cu is None else cu, lam, n_conf,
        B, T, N, group_size, float(w_pos), float(w_neg),
        PACKED=cu is not None, HAS_MASK=mask is not None, **_tiles(group_size))


def _tiles(group_size):
    """A group's (BLOCK_G, BLOCK_T) tile, from the group size only (no recompile as the lengths change)."""
    block_g = triton.next_power_of_2(group_size)
    return dict(BLOCK_G=block_g, BLOCK_T=max(16, 1024 // block_g))


class Deferred:
    """The call's conflict weights (conflict_weights' arguments), their launch deferred: folded into a later
    launch as programs of its own (`fold`: the merge's sums kernel on a split vocabulary, vp_merge_triton), or
    made by their own (`launch`) where no launch took them. lam (N,) and n_conf (B,) float32 are written by
    whichever runs, once; neither reads the host."""

    def __init__(self, ids, mask, adv, cu, T, group_size, w_pos, w_neg):
        self.args = (ids, mask, adv, cu, T, group_size, float(w_pos), float(w_neg))
        self.lam = torch.empty(ids.numel(), dtype=torch.float32, device=ids.device)
        self.n_conf = torch.empty(adv.numel(), dtype=torch.float32, device=ids.device)
        self.done = False

    def launch(self):
        if not self.done:
            self.done = True
            conflict_weights(*self.args, self.lam, self.n_conf)

    def fold(self, n_sums):
        """The kernel arguments of its groups as programs n_sums and after of another launch (the c_ names of
        vp_merge_triton._vp_sums_kernel) and the number of those programs; it is then done."""
        ids, mask, adv, cu, T, G, w_pos, w_neg = self.args
        self.done = True
        n_groups = adv.numel() // G
        return n_groups, dict(
            n_sums=n_sums, CONFLICT=True, c_ids=ids, c_mask=ids if mask is None else mask, c_adv=adv,
            c_cu=ids if cu is None else cu, c_lam=self.lam, c_nconf=self.n_conf, c_B=adv.numel(), c_T=T,
            c_N=ids.numel(), c_G=G, w_pos=w_pos, w_neg=w_neg, n_groups=max(n_groups, 1), C_PACKED=cu is not None,
            C_HAS_MASK=mask is not None, **_tiles(G))
