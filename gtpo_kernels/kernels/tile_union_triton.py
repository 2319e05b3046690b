"""The tiles' unions of kept sets (tile_union.py holds the definition and the torch twin) in five launches
however many tiles: keys, a sort, the first copies, their running count, the unions' starts, the columns.

Each kept id v of token m in tile t becomes the key t * W + (v - lo) (W = V_r + 1; V_r for an id outside
[lo, lo + V_r)); sorted, the keys of tile t are contiguous and each distinct key is one column of U_t:

    _keys_kernel     per token: its tile (a binary search of the tiles' starts), its ids' keys, its
                     sampled id's key, its offsets from its tile's first kept id
    (torch.sort)     the keys, and where each came from
    _first_kernel    per sorted key: 1 where it is the first copy of a key inside the slice
    (torch.cumsum)   rank: the first copies' running count
    _starts_kernel   per tile: the first copies before its keys (a binary search): U_t's start
    _columns_kernel  per sorted key: its column in U_t, written where the key came from, and each first
                     copy's id into U; per token: its sampled id's column (a binary search), or -1

Offsets are int64 throughout; no size is a compile-time constant.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 256


@triton.jit
def _lower_bound(keys_ptr, n, target, steps):
    """The first position in keys[0:n] (sorted) whose key is >= target (n where none), per lane; steps:
    at least n's bit length + 1."""
    lo = tl.zeros_like(target)
    hi = lo + n
    for _ in range(steps):
        live = lo < hi
        mid = (lo + hi) // 2
        k = tl.load(keys_ptr + mid, mask=live, other=0)
        go = live & (k < target)
        lo = tl.where(go, mid + 1, lo)
        hi = tl.where(live & (k >= target), mid, hi)
    return lo


@triton.jit(do_not_specialize=["n_tiles", "lo", "V_r", "steps"])
def _keys_kernel(ids_ptr, off_ptr, y_ptr, bounds_ptr, key_ptr, ky_ptr, tile_ptr, loc_ptr, n_tiles, lo, V_r, steps,
                 BLOCK: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    W = V_r.to(tl.int64) + 1
    t = m * 0  # the tile: the last start <= m
    t_hi = t + n_tiles - 1
    for _ in range(steps):
        mid = (t + t_hi + 1) // 2
        go = tl.load(bounds_ptr + mid) <= m
        t = tl.where(go, mid, t)
        t_hi = tl.where(go, t_hi, mid - 1)
    k0 = tl.load(off_ptr + m)
    k1 = tl.load(off_ptr + m + 1)
    base = tl.load(off_ptr + tl.load(bounds_ptr + t))
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    for k in range(k0, k1, BLOCK):
        kk = k + lanes
        live = kk < k1
        v = tl.load(ids_ptr + kk, mask=live, other=0).to(tl.int64) - lo
        tl.store(key_ptr + kk, t * W + tl.where((v >= 0) & (v < V_r), v, V_r), mask=live)
    vy = tl.load(y_ptr + m).to(tl.int64) - lo
    tl.store(ky_ptr + m, t * W + tl.where((vy >= 0) & (vy < V_r), vy, V_r))
    tl.store(tile_ptr + m, t)
    tl.store(loc_ptr + m + t, k0 - base)
    last = m == tl.load(bounds_ptr + t + 1) - 1  # the tile's last token: its end too
    tl.store(loc_ptr + m + t + 1, k1 - base, mask=last)


@triton.jit(do_not_specialize=["K", "V_r"])
def _first_kernel(skey_ptr, first_ptr, K, V_r, BLOCK: tl.constexpr):
    k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = k < K
    s = tl.load(skey_ptr + k, mask=live, other=0)
    prev = tl.load(skey_ptr + k - 1, mask=live & (k > 0), other=-1)
    first = (s != prev) & (s % (V_r.to(tl.int64) + 1) != V_r)
    tl.store(first_ptr + k, first.to(tl.int64), mask=live)


@triton.jit(do_not_specialize=["K", "n_tiles", "V_r", "steps"])
def _starts_kernel(skey_ptr, first_ptr, rank_ptr, starts_ptr, K, n_tiles, V_r, steps, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = t <= n_tiles
    p = _lower_bound(skey_ptr, K, t * (V_r.to(tl.int64) + 1), steps)
    inside = live & (p < K)
    before = tl.load(rank_ptr + p, mask=inside, other=0) - tl.load(first_ptr + p, mask=inside, other=0)
    total = tl.load(rank_ptr + K - 1, mask=K > 0, other=0)  # every first copy
    tl.store(starts_ptr + t, tl.where(p < K, before, total), mask=live)


@triton.jit(do_not_specialize=["K", "M", "V_r", "steps"])
def _columns_kernel(skey_ptr, order_ptr, first_ptr, rank_ptr, starts_ptr, ky_ptr, tile_ptr, local_ptr, uids_ptr,
                    ly_ptr, K, M, V_r, steps, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    W = V_r.to(tl.int64) + 1
    n_k = (K + BLOCK - 1) // BLOCK
    lanes = tl.arange(0, BLOCK)
    if pid < n_k:  # the kept ids, in sorted order
        k = pid * BLOCK + lanes
        live = k < K
        s = tl.load(skey_ptr + k, mask=live, other=0)
        col = tl.load(rank_ptr + k, mask=live, other=0) - 1  # the key's position among the unions' ids
        t = s // W
        local = tl.where(s % W != V_r, col - tl.load(starts_ptr + t, mask=live, other=0), -1)
        tl.store(local_ptr + tl.load(order_ptr + k, mask=live, other=0), local, mask=live)
        tl.store(uids_ptr + col, s % W, mask=live & (tl.load(first_ptr + k, mask=live, other=0) != 0))
    else:  # the sampled ids
        m = (pid - n_k) * BLOCK + lanes
        live = m < M
        target = tl.load(ky_ptr + m, mask=live, other=0)
        p = _lower_bound(skey_ptr, K, target, steps)
        found = live & (p < K)
        hit = found & (tl.load(skey_ptr + p, mask=found, other=-1) == target) & (target % W != V_r)
        rank = tl.load(rank_ptr + p, mask=hit, other=0)
        start = tl.load(starts_ptr + tl.load(tile_ptr + m, mask=live, other=0), mask=live, other=0)
        tl.store(ly_ptr + m, tl.where(hit, rank - 1 - start, -1), mask=live)


def tile_unions(token_ids, offsets, y, bounds, V_r, lo):
    """(U's ids (K,: the first starts[-1] hold the unions), starts (n + 1,) device, local (K,), local offsets
    (M + n,), local y (M,)) as tile_union.tile_unions defines them; bounds: the tiles' starts and M, on the
    device."""
    dev, M, K, n = offsets.device, y.numel(), token_ids.numel(), bounds.numel() - 1
    i64 = dict(dtype=torch.long, device=dev)
    key, ky, tile = torch.empty(K, **i64), torch.empty(M, **i64), torch.empty(M, **i64)
    loc = torch.empty(M + n, **i64)
    offsets = offsets.long().contiguous()
    _keys_kernel[(M,)](token_ids.contiguous(), offsets, y.contiguous(), bounds, key, ky, tile, loc, n, lo, V_r,
                       n.bit_length() + 1, BLOCK=BLOCK)
    skey, order = torch.sort(key)
    first = torch.empty(K, **i64)
    if K:
        _first_kernel[(triton.cdiv(K, BLOCK),)](skey, first, K, V_r, BLOCK=BLOCK)
    rank = torch.cumsum(first, 0)
    starts = torch.empty(n + 1, **i64)
    steps = K.bit_length() + 1
    _starts_kernel[(triton.cdiv(n + 1, BLOCK),)](skey, first, rank, starts, K, n, V_r, steps, BLOCK=BLOCK)
    local, uids, ly = torch.empty(K, **i64), torch.empty(K, **i64), torch.empty(M, **i64)
    _columns_kernel[(triton.cdiv(K, BLOCK) + triton.cdiv(M, BLOCK),)](
        skey, order, first, rank, starts, ky, tile, local, uids, ly, K, M, V_r, steps, BLOCK=BLOCK)
    return uids, starts, local, loc, ly
