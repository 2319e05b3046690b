"""The union tiles' bounds formed on the device (spec 11 and 13): the tiles that
pipeline/head_replay.plan_union cuts on the host, written where the union kernels read them, so that the
head over kept sets copies nothing from the host to the device.

One program, in two phases over the counted tokens' kept-set offsets (M + 1,):

    sums    S[m]: the running sums of the sets' sizes, each clamped into [0, V]: a negative size (an
            unvalidated malformed offset, its tokens NaN whatever their tile) counts as 0 as on the host,
            and a size over V changes no min(S[e] - S[m0], V) below while no sum can overflow
    tiles   from m0 = 0, the tile's end is m0 + r for the largest r <= max_rows, m0 + r <= M, with
            per_entry * r * min(S[m0 + r] - S[m0], V) <= budget: S grows with m, so the
            rows that fit are a prefix, counted at once over ROWS >= max_rows lanes; as many tiles as
            the host planned

The host reads the bounds with the unions' sizes, in the read it already makes, and checks them against
its own plan. Offsets are int64; no size is a compile-time constant (ROWS is the planner's fixed cap).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256


@triton.jit(do_not_specialize=["M", "n_tiles", "V", "per_entry", "budget", "max_rows"])
def _union_plan_kernel(off_ptr, sums_ptr, bounds_ptr, M, n_tiles, V, per_entry, budget, max_rows,
                       ROWS: tl.constexpr, BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    M = M.to(tl.int64)
    carry = M * 0
    tl.store(sums_ptr, carry)
    for b0 in range(0, M, BLOCK):  # S[1..M]
        m = b0 + lanes
        live = m < M
        size = tl.load(off_ptr + m + 1, mask=live, other=0).to(tl.int64) - tl.load(off_ptr + m, mask=live, other=0)
        size = tl.minimum(tl.maximum(size, 0), V.to(tl.int64))
        tl.store(sums_ptr + m + 1, carry + tl.cumsum(size, 0), mask=live)
        carry += tl.sum(size, 0)
    tl.debug_barrier()
    r = tl.arange(0, ROWS).to(tl.int64) + 1  # the candidate rows of a tile
    m0 = M * 0
    for j in range(n_tiles):
        tl.store(bounds_ptr + j, m0)
        end = m0 + r
        inside = (end <= M) & (r <= max_rows)
        s0 = tl.load(sums_ptr + m0, volatile=True)
        s = tl.load(sums_ptr + end, mask=inside, other=0, volatile=True)
        fits = inside & (per_entry.to(tl.int64) * r * tl.minimum(s - s0, V.to(tl.int64)) <= budget)
        m0 += tl.sum(fits.to(tl.int64), 0)  # (at least 1: plan_union refused a budget that holds no row)
    tl.store(bounds_ptr + n_tiles, m0)


def union_bounds(offsets, n_tiles, V, per_entry, budget, max_rows):
    """The tiles' starts and their end (n_tiles + 1,) int64 on the device, as plan_union(sizes of `offsets`
    (M + 1,), V, per_entry, budget, max_rows) cuts them (n_tiles: how many it cut); the last entry is M when
    the two agree."""
    M = offsets.numel() - 1
    dev = offsets.device
    # no tile holds more than per_entry * max_rows * V bytes: a larger budget cuts the same tiles (and a budget
    # of 2**64 bytes or more would not pass as a launch argument)
    budget = min(int(budget), int(per_entry) * int(max_rows) * max(int(V), 1))
    sums = torch.empty(M + 1, dtype=torch.int64, device=dev)
    bounds = torch.empty(n_tiles + 1, dtype=torch.int64, device=dev)
    _union_plan_kernel[(1,)](offsets.contiguous(), sums, bounds, M, n_tiles, V, per_entry, budget, max_rows,
                             ROWS=triton.next_power_of_2(max_rows), BLOCK=BLOCK)
    return bounds
