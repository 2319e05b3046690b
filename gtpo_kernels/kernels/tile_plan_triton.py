"""The fused LM head's tile plan formed on the device, before its one planning read (spec 11): the same
tiles as pipeline/tile_plan.plan(counts, per_tile, whole=True), the tile of each counted row and the
number of rows per tile that may have a gradient, so that the host reads them with the counts and copies
nothing back to the device.

One program, in three phases over the tokens and the completions:

    counts      the counted rows per completion (by each token's completion, `seg`)
    tiles       the greedy cut of pipeline/tile_plan.plan: a completion that would overflow the tile
                starts the next one, a completion longer than a tile is split into full tiles
    rows        each counted token's place j among the counted rows (flat order), its tile (the last
                tile start <= j: a binary search) and, where the row may have a gradient, one more
                in its tile's count

Offsets are int64; no size is a compile-time constant.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256


@triton.jit(do_not_specialize=["N", "B", "per_tile", "n_slots", "steps"])
def _tile_plan_kernel(counted_ptr, seg_ptr, live_ptr, plan_ptr, starts_ptr, tile_ptr, N, B, per_tile, n_slots,
                      steps, BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    zero = tl.zeros((BLOCK,), dtype=tl.int64)
    N, B, P = N.to(tl.int64), B.to(tl.int64), per_tile.to(tl.int64)
    for i0 in range(0, B + n_slots + 1, BLOCK):  # counts, rows per tile, number of tiles: 0
        tl.store(plan_ptr + i0 + lanes, zero, mask=i0 + lanes < B + n_slots + 1)
    tl.debug_barrier()
    for t0 in range(0, N, BLOCK):  # the counted rows per completion
        offs = t0 + lanes
        c = tl.load(counted_ptr + offs, mask=offs < N, other=0) != 0
        seg = tl.load(seg_ptr + offs, mask=c, other=0).to(tl.int64)
        tl.atomic_add(plan_ptr + seg, zero + 1, mask=c)
    tl.debug_barrier()
    k = B * 0  # tiles so far, the next tile's first row, the rows in the open tile
    start = B * 0
    size = B * 0
    for i in range(B):
        c = tl.load(plan_ptr + i, volatile=True)
        cut = (size > 0) & (size + c > P)  # the completion does not fit: the open tile is closed
        tl.store(starts_ptr + k, start, mask=cut)
        k += cut.to(tl.int64)
        start += tl.where(cut, size, 0)
        size = tl.where(cut, 0, size) + c
        full = tl.maximum(size - 1, 0) // P  # a completion longer than a tile: full tiles while size > P
        for _ in range(full):
            tl.store(starts_ptr + k, start)
            k += 1
            start += P
        size -= full * P
    last = size > 0
    tl.store(starts_ptr + k, start, mask=last)
    k += last.to(tl.int64)
    tl.store(plan_ptr + B + n_slots, k)
    tl.debug_barrier()
    before = B * 0  # counted rows before this block
    for t0 in range(0, N, BLOCK):
        offs = t0 + lanes
        inb = offs < N
        ci = (tl.load(counted_ptr + offs, mask=inb, other=0) != 0).to(tl.int64)
        j = before + tl.cumsum(ci, 0) - ci
        before += tl.sum(ci, 0)
        lo = zero
        hi = zero + k - 1
        for _ in range(steps):  # the last tile whose start <= j
            open_ = lo < hi
            mid = (lo + hi + 1) // 2
            go = open_ & (tl.load(starts_ptr + mid, mask=open_, other=0, volatile=True) <= j)
            lo = tl.where(go, mid, lo)
            hi = tl.where(open_ & ~go, mid - 1, hi)
        c = ci != 0
        tl.store(tile_ptr + offs, tl.where(c, lo, -1), mask=inb)
        lv = c & (tl.load(live_ptr + offs, mask=c, other=0) != 0)
        tl.atomic_add(plan_ptr + B + lo, zero + 1, mask=lv)


def slots(B, N, per_tile):
    """An upper bound on the number of tiles of N tokens in B completions at per_tile rows a tile: each
    tile but the last is closed either before a completion or full."""
    return int(B) + int(N) // max(int(per_tile), 1) + 1


def tile_plan(counted, seg, live, B, per_tile):
    """-> (plan, tile): plan int64 (B + slots + 1,): the counted rows per completion, then the rows that
    may have a gradient (`live`) per tile (slots entries, the tiles' number after them, 0 beyond), then
    the number of tiles; tile (N,): the tile of each counted token, -1 elsewhere. counted, live: (N,) any
    dtype, nonzero counts; seg: each token's completion in [0, B)."""
    N, dev = counted.numel(), counted.device
    n_slots = slots(B, N, per_tile)
    plan = torch.empty(B + n_slots + 1, dtype=torch.int64, device=dev)
    starts = torch.empty(n_slots, dtype=torch.int64, device=dev)
    tile = torch.empty(N, dtype=torch.int64, device=dev)
    _tile_plan_kernel[(1,)](counted.reshape(-1).contiguous(), seg.reshape(-1).contiguous(),
                            live.reshape(-1).contiguous(), plan, starts, tile, N, B, max(int(per_tile), 1), n_slots,
                            n_slots.bit_length() + 1, BLOCK=BLOCK)
    return plan, tile
