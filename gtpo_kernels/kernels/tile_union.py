"""The unions of kept sets a head tile projects (spec 11 and 13), every tile at once.

For tiles j = (m0, m1) of counted tokens, U_j is the sorted union of their kept sets; each token's set and
sampled id are rewritten as columns of its U_j. A head tile then projects only W[U_j],
z_tile = h_tile @ W[U_j].T, and replays on z_tile with rows 0..m1 - m0 - 1 and the local sets: the same
logp, H and, scattered back through U_j, the same gradient as on the full rows.

The definition below, in torch (the torch backend's path and the kernels' twin), keys each kept id v of a
token of tile t as t * W + (v - lo), W = V_r + 1, with the column V_r for an id outside [lo, lo + V_r) (a
vocabulary split: this rank's slice), and sorts the keys once; tile_union_triton.py forms the same in five
launches. Either way: one host read (the unions' sizes), however many tiles there are, and no copy to the
device where kernels/union_plan_triton.py has formed the tiles' starts there (else one copy of them).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.sampling import segment_of


class Unions(NamedTuple):
    ids: torch.Tensor  # the unions' ids (of the slice: id - lo), tile after tile, each sorted
    starts: list  # host ints (tiles + 1,): tile j's union is ids[starts[j]:starts[j + 1]]
    local: torch.Tensor  # (K,) each kept id as a column of its tile's union; -1 outside the slice
    offsets: torch.Tensor  # (M + tiles,) tile j's sets in local[k0:k1]: offsets[m0 + j:m1 + j + 1], from 0
    y: torch.Tensor  # (M,) each token's sampled id as a column of its tile's union; -1 where not in it
    plan: object = None  # with_plan: (3 (tiles + 1),) on the device: the tiles' bounds, their kept ids' and starts

    def tile(self, j, m0, m1, k0, k1):
        """Tile j's (union, local ids, local offsets, local y), all views: its sets as columns of z_tile."""
        return (self.ids[self.starts[j]:self.starts[j + 1]], self.local[k0:k1],
                self.offsets[m0 + j:m1 + j + 1], self.y[m0:m1])

    def saved(self):
        """The tensors a backward rebuilds these unions from (from_saved), with one host read, no sort."""
        return [self.ids, self.local, self.offsets, self.y, self.plan]

    @staticmethod
    def from_saved(ids, local, offsets, y, plan):
        """(Unions, tiles [(m0, m1)], the tiles' bounds in the kept ids (tiles + 1,)) from saved(): one host
        read, the plan's."""
        host = plan.tolist()  # sync: the tiles, as the forward planned them
        n = len(host) // 3 - 1
        bounds, kb, starts = host[:n + 1], host[n + 1:2 * n + 2], host[2 * n + 2:]
        return Unions(ids, starts, local, offsets, y, plan), list(zip(bounds[:-1], bounds[1:])), kb


def tile_unions(token_ids, offsets, y, tiles, V_r, lo=0, backend="torch", with_plan=False, bounds=None):
    """Unions of the tiles `tiles` [(m0, m1)] (host ints, covering 0..M in order) over the counted tokens'
    kept sets (token_ids, offsets (M + 1,) non-decreasing from 0 to len(token_ids): every kept id in one
    set) and sampled ids y (M,): only ids in [lo, lo + V_r) enter the
    unions; the others, and a sampled id outside its union, become -1 (the replay flags such a token; with
    a vocabulary split the merge over the group counts it on the rank that holds it). with_plan: the Unions
    carry their plan (two launches more), so that a backward rebuilds them with Unions.from_saved.
    bounds: the tiles' starts and M (tiles + 1,) already on the device (kernels/union_plan_triton.py),
    read back with the unions' sizes and checked against `tiles`; None: copied there from `tiles`."""
    M = y.numel()
    host_bounds, copied = [m0 for m0, _ in tiles] + [M], bounds is None
    if copied:
        bounds = torch.tensor(host_bounds, dtype=torch.long, device=offsets.device)  # (a copy)
    if backend == "triton" and M:
        from . import tile_union_triton
        uids, starts_dev, local, loc, ly = tile_union_triton.tile_unions(token_ids, offsets, y, bounds, V_r, lo)
    else:
        uids, starts_dev, local, loc, ly = _tile_unions(token_ids, offsets, y, bounds, V_r, lo)
    starts = (starts_dev if copied else torch.cat([starts_dev, bounds])).tolist()  # sync: the unions' sizes
    if not copied:
        starts, device_bounds = starts[:len(tiles) + 1], starts[len(tiles) + 1:]
        if device_bounds != host_bounds:
            raise RuntimeError(f"the device's union tiles start at {device_bounds}, the host's at {host_bounds}")
    plan = torch.cat([bounds, offsets[bounds], starts_dev]) if with_plan else None
    return Unions(uids[:starts[-1]], starts, local, loc, ly, plan)


def _tile_unions(token_ids, offsets, y, bounds, V_r, lo):
    """The definition: (the unions' ids (at least U,), starts (tiles + 1,) on the device, local, local
    offsets, local y)."""
    dev, M, K, n = offsets.device, y.numel(), token_ids.numel(), bounds.numel() - 1
    W = V_r + 1
    tok = torch.arange(M, device=dev)
    tile_tok = torch.searchsorted(bounds[:-1], tok, right=True) - 1
    v = token_ids.long() - lo
    key = tile_tok[segment_of(offsets, K)] * W + torch.where((v >= 0) & (v < V_r), v, V_r)
    skey, order = torch.sort(key)
    inside = skey % W != V_r
    first = torch.nn.functional.pad(skey.diff() != 0, (1, 0), value=True) & inside  # each key's first copy
    col = first.long().cumsum(0) - 1  # its position among the unions' ids
    tile_s = skey // W
    starts = torch.nn.functional.pad(
        torch.zeros(n, dtype=torch.long, device=dev).index_add_(0, tile_s, first.long()).cumsum(0), (1, 0))
    uids = torch.zeros(K + 1, dtype=torch.long, device=dev)
    uids.scatter_(0, torch.where(first, col, K), skey % W)  # (the other copies land in uids[K])
    local = torch.empty_like(key).scatter_(0, order, torch.where(inside, col - starts[tile_s], -1))
    vy = y.long() - lo
    ky = tile_tok * W + torch.where((vy >= 0) & (vy < V_r), vy, V_r)
    if K:
        p = torch.searchsorted(skey, ky).clamp_(max=K - 1)
        local_y = torch.where((skey[p] == ky) & (ky % W != V_r), col[p] - starts[tile_tok], -1)
    else:
        local_y = torch.full_like(ky, -1)
    # tile j's offsets from its first kept id, at m0 + j .. m1 + j (its end one past its last token's)
    base = offsets[bounds]  # the kept ids' index at each tile's start, and K
    loc = torch.empty(M + n, dtype=torch.long, device=dev)
    loc.index_copy_(0, tok + tile_tok, offsets[:-1] - base[tile_tok])
    loc.index_copy_(0, bounds[1:] + torch.arange(n, device=dev), base[1:] - base[:-1])
    return uids, starts, local, loc, local_y
