"""The fused LM head's tile plans (spec 11): tiles over the counted rows, the rows' order, the rows known
to have no gradient before any logit is read, and the recompute backward's rows.

Planning reads the number of counted rows per completion on the host (1 sync a pass; the fused
schedule's count of rows known to have no gradient comes with it, its plan formed by a kernel on the Triton
backend: kernels/tile_plan_triton.py; and on one process, validating, the
arguments' value checks: core.host_read.read_planned; the recompute backward reads the rows with a
nonzero coefficient, 1 sync); nothing inside the tile loops reads the device.
"""
from __future__ import annotations

import bisect
from typing import NamedTuple

import torch

from ..core.host_read import read_planned


class Tile(NamedTuple):
    s: int  # first and one-past-last position in the sorted counted rows
    e: int
    g0: int  # first and last completion with a row in the tile
    g1: int


def plan(counts, per_tile, whole):
    """Tiles over the counted rows (host ints): `counts` rows per completion, at most `per_tile` rows a
    tile. whole: boundaries between completions, a completion longer than a tile split across tiles
    (the caller's schedule is then 'recompute'); else fixed-size tiles."""
    n = sum(counts)
    if whole:
        bounds, start, size = [], 0, 0
        for c in counts:
            if size and size + c > per_tile:
                bounds.append((start, start + size))
                start, size = start + size, 0
            size += c
            while size > per_tile:  # a completion longer than a tile
                bounds.append((start, start + per_tile))
                start, size = start + per_tile, size - per_tile
        if size:
            bounds.append((start, start + size))
    else:
        bounds = [(s, min(n, s + per_tile)) for s in range(0, n, per_tile)]
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    at = lambda r: bisect.bisect_right(starts, r) - 1  # noqa: E731  (the completion of row r)
    return [Tile(s, e, at(s), at(e - 1)) for s, e in bounds]


def plan_rows(opts, t, skip):
    """(rows, counted rows per completion (device), tiles, live rows per tile or None). skip: the fused
    schedule's gradient (whole completions a tile), whose rows known to have c = e = 0 (prior_live) are
    put last in their tile. On the Triton backend one kernel forms that plan on the device and their number
    per tile is read with the counts (_planned_on_device: 1 sync, nothing copied back); on the torch backend
    their number per completion is (1 sync in all, one more only when a completion spans tiles: token-local
    coefficients and a completion over a tile). The counted rows are then listed in a size the host knows
    (nonzero_static: no sync)."""
    dev, B, counted = t.counted.device, opts.B, t.counted
    live_all = prior_live(opts, t, None, t.seg) if skip else None  # (at every token: read at the rows below)
    if live_all is not None and opts.backend == "triton":  # the plan formed on the device: nothing copied back
        return _planned_on_device(opts, t, live_all)
    counts_dev = torch.zeros(B, dtype=torch.long, device=dev).index_add_(0, t.seg, counted.long())
    if live_all is None:
        counts = read_planned(counts_dev)  # sync: the tiles (and, validating, the arguments' checks)
    else:
        per_c = torch.zeros(B, dtype=torch.long, device=dev).index_add_(0, t.seg, (live_all & counted).long())
        both = read_planned(torch.cat([counts_dev, per_c]))  # sync: the tiles (and the arguments' checks)
        counts, per_c = both[:B], both[B:]
    n = sum(counts)
    rows = torch.nonzero_static(counted, size=n).squeeze(1)  # the rows projected, in order
    if live_all is None:
        return rows, counts_dev, plan(counts, opts.per_tile, opts.fused), None
    live = live_all[rows]
    tiles = plan(counts, opts.per_tile, True)
    sizes = torch.tensor([k.e - k.s for k in tiles], dtype=torch.long, device=dev)
    tile = torch.repeat_interleave(torch.arange(len(tiles), device=dev), sizes, output_size=n)
    if max(counts, default=0) <= opts.per_tile:  # plan() cut only between completions
        per_tile = [sum(per_c[k.g0:k.g1 + 1]) for k in tiles]
    else:
        per_tile = torch.zeros(len(tiles), dtype=torch.long, device=dev).index_add_(0, tile, live.long()).tolist()
    return _live_first(rows, tile, live), counts_dev, tiles, per_tile


def _live_first(rows, tile, live):
    """The counted rows tile by tile, within each tile those that may have a gradient first (both plans'
    order: ranks and backends order their rows alike)."""
    return rows[torch.sort(2 * tile + (~live).long(), stable=True).indices]


def _planned_on_device(opts, t, live_all):
    """plan_rows' fused schedule, its plan formed by one kernel before the read (kernels/tile_plan_triton):
    the counts, the live rows per tile and the tiles' number read at once (1 sync, whether or not a completion
    spans tiles), each counted row's tile already on the device (no copy of the tiles' sizes to it)."""
    from ..kernels.tile_plan_triton import tile_plan
    B, counted = opts.B, t.counted
    planned, tile_of = tile_plan(counted, t.seg, live_all, B, opts.per_tile)
    host = read_planned(planned)  # sync: the tiles (and, validating, the arguments' checks)
    counts, per_tile = host[:B], host[B:-1]
    tiles = plan(counts, opts.per_tile, True)
    if len(tiles) != host[-1]:
        raise RuntimeError(f"the device's tile plan has {host[-1]} tiles, the host's {len(tiles)}")
    n = sum(counts)
    rows = torch.nonzero_static(counted, size=n).squeeze(1)  # the rows projected, in order
    return _live_first(rows, tile_of[rows], live_all[rows]), planned[:B], tiles, per_tile[:len(tiles)]


# policy terms with a gradient where A = 0: dro's -(dro_beta / 2) (logp - old)^2, kl_cov's penalty on its
# chosen tokens (both still multiplied by lambda)
NOT_PROPORTIONAL_TO_A = ("dro", "kl-cov")


def prior_live(opts, t, rows, seg):
    """The rows (of completions `seg`; rows None: every token) whose c, e may be nonzero, as far as is known before any logit is
    read (None: all). c is the policy term's unless a KL term or an entropy bonus adds to it, and every
    policy multiplies it by lambda_j and, but dro and kl_cov (NOT_PROPORTIONAL_TO_A), by Ahat_i: Ahat_i = 0
    when A_i = 0 without shaping (gamma = 0);
    lambda_j = 0 on a conflict token of a negative completion with w_neg = 0, for a token-level term (a
    sequence-level ratio, or geo_mean's log R, spreads over the completion's tokens). Options are taken by
    value (a 0-d tensor 0 is 0: the mask is then formed on the device, the same rows as with the number 0), so ranks with
    equal options order their rows alike. Rows whose gradient depends on the logits (the entropy filter,
    clipping, masks) still go through the fused schedule's GEMMs: it cannot read them before its tile's
    GEMMs without a sync per tile (the recompute schedule skips them)."""
    cfg, x = opts.cfg, t.extras
    if cfg is None or _nonzero(cfg.entropy_coef) or (x.ref is not None and _nonzero(cfg.beta)):
        return None
    live = None
    if not _nonzero(cfg.entropy_penalty) and cfg.policy_loss not in NOT_PROPORTIONAL_TO_A:
        live = _or(x.adv[seg] != 0, cfg.entropy_penalty)  # NaN counts as live
    if x.lam is not None and not cfg.sequence_term:  # (GSPO's ratio, geo_mean's mean: over the completion)
        on = (x.lam if rows is None else x.lam[rows]) != 0
        live = on if live is None else live & on
    if live is None:
        return None
    live = _or(live, cfg.entropy_coef)
    return live if x.ref is None else _or(live, cfg.beta)


def _nonzero(v):
    """A Python number that is not 0 (a tensor is read on the device, never here)."""
    return not isinstance(v, torch.Tensor) and v != 0


def _or(live, v):
    """live, or every row where the 0-d tensor v is nonzero (a number here is 0: _nonzero decided)."""
    return live | (v != 0) if isinstance(v, torch.Tensor) else live  # a 0-d host tensor: a scalar operand


def plan_backward(c, e):
    """The recompute backward's plan: the rows with c != 0 or e != 0 (1 sync)."""
    live = c != 0 if e is None else (c != 0) | (e != 0)
    return live.nonzero().squeeze(1)  # sync: the rows with a gradient
