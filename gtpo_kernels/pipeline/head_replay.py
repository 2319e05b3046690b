"""The LM head over the sampler's kept sets (spec 11 and 13): only the union of a tile's kept sets is
projected.

For a tile of counted tokens m0..m1-1 with kept sets K_m, U = the union of the K_m, sorted:

    z_U = h_tile @ W[U].T (+ b[U])          (rows x |U|: one GEMM, 2 rows |U| D FLOPs)
    logp, H over each K_m                    (the replay kernel, on z_U with the sets as columns of U)

and in the backward the same projection again, the replay's gradient dL/dz_U from the forward's saved
statistics (exactly 0 outside the sets, so outside U too), then dL/dh = dL/dz_U @ W[U] and
dL/dW[U] += dL/dz_U.T @ h: 4 GEMMs over |U| columns where the full-vocabulary head runs 3 or 4 over V.
Tiles are planned on the host from the sets' sizes (one read of the offsets): a tile's rows x min(sum of
its set sizes, V) entries of logits and gradient within `memory_budget` (the union is at most that), and at
most TILE_ROWS tokens (a token's GEMM work is its tile's union, which grows with the tile). Every tile's
union is formed at once, once a call (kernels/tile_union.py: one more host read); the backward takes the
forward's counted rows, tiles and unions (with_saved: one host read, the saved plan's). The counted rows'
hidden states are gathered once a pass, and a tile then takes 10 launches, forward and backward (3 and 7),
with no host read; NaN where invalid is set once over the joined tiles. With the rules (top_k / top_p /
min_p) the sets are rebuilt from the current logits, which needs every logit once: the forward projects
tiles of the whole vocabulary (the full head's budget), rebuilds the sets there and replays on them, then
forms the unions the backward projects.
"""
from __future__ import annotations

import itertools
import operator
import types

import torch

from ..core.layout import float_dtype_for
from ..core.sampling import flat_offsets
from ..distributed import vocab_replay
from ..kernels import replay as rp
from ..kernels.kept_set import kept_sets
from ..kernels.kept_set_triton import kept_sets_tile
from ..kernels.tile_union import Unions, tile_unions
from ..kernels.union_plan_triton import union_bounds
from . import head as hd
from .replay import at, nonfinite_flag
from .tiles import flat_rows, rows_of


TILE_ROWS = 256  # counted tokens a tile at most: the union, so the GEMM work per token, grows with the tile
SET_BYTES = 32  # bytes per logit the kept-set rebuild's block holds (values, their sort and indices, masks)


def plan_union(sizes, V, per_entry, budget, max_rows=TILE_ROWS):
    """Tiles (m0, m1) over the counted tokens (host ints `sizes`, each kept set's size): each tile's rows x
    min(its sets' total size, V) entries of `per_entry` bytes within `budget` bytes, and at most
    `max_rows` rows (each token's GEMM work is the tile's union: smaller tiles, smaller unions). A tile's
    entries grow with its last row, so its end is found by bisection on the sizes' running sums (host work
    O(tiles log max_rows) past one pass over the sizes in C). A negative size (an unvalidated malformed
    offset: its tokens are NaN whatever their tile) counts as 0; kernels/union_plan_triton.py cuts the
    same tiles on the device."""
    if sizes and min(sizes) < 0:
        sizes = [max(k, 0) for k in sizes]
    if sizes and per_entry * min(max(sizes), V) > budget:
        m, k = next((m, k) for m, k in enumerate(sizes) if per_entry * min(k, V) > budget)
        raise ValueError(f"memory_budget = {budget} bytes holds no row of kept logits and their gradient: "
                         f"counted token {m}'s kept set of {k} ids takes {per_entry * min(k, V)} bytes; "
                         "raise memory_budget")
    S = [0, *itertools.accumulate(sizes)]
    tiles, m0, n = [], 0, len(sizes)
    while m0 < n:
        lo, hi = m0 + 1, min(n, m0 + max_rows)  # rows m0..lo-1 fit (one row always does); find the last end
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if per_entry * (mid - m0) * min(S[mid] - S[m0], V) <= budget:
                lo = mid
            else:
                hi = mid - 1
        tiles.append((m0, lo))
        m0 = lo
    return tiles


def _columns(head, cols):
    """W[cols] and b[cols] in the projection's dtype."""
    bias = None if head.bias is None else hd.upcast(head.bias.index_select(0, cols), head.proj)
    return hd.upcast(head.weight.index_select(0, cols), head.proj), bias


def _project(h, w, bias):
    """h @ w.T (+ bias): a tile's raw logits on w's columns (h, w already in the projection's dtype)."""
    return h @ w.t() if bias is None else torch.addmm(bias, h, w.t())


def _rows(p, R):
    """(rows_b, rows_t) of a tile of R rows, z.unsqueeze(0): zeros and 0..R-1, made once per pass (views)."""
    if p.rows is None or p.rows[1].numel() < R:
        rows_t = torch.arange(R, device=p.pos.device)
        p.rows = torch.zeros_like(rows_t), rows_t
    return p.rows[0][:R], p.rows[1][:R]


def _replay(z, ids, offsets, y, tau, invalid, p, vp=None):
    """A tile's rows over their sets (columns of z): (logp, H, stats, flags) as the replay kernel gives them,
    nothing NaN'd yet (_finish, once per pass). With a vocabulary split, z holds this rank's columns (vp.start:
    the first one's id, or 0 where ids and y are already columns, -1 elsewhere), the statistics are merged
    over the group, logp, H come NaN'd where flagged or `invalid` and stats is the sets' LSE (M, 1), which
    the backward (with H) differentiates from, communicating nothing."""
    rows = _rows(p, z.shape[0])
    if p.vp is None:
        return rp.replay_values(z.unsqueeze(0), *rows, y, tau, ids, offsets, p.head.scale, p.head.cap, p.backend)
    lp, en, fl, lse = vocab_replay.merge(z.unsqueeze(0), *rows, y, tau, ids, offsets, vp or p.columns,
                                         p.head.scale, p.head.cap)
    bad = fl != 0 if invalid is None else (fl != 0) | invalid
    nan = torch.full_like(lp, float("nan"))
    p.lse_kept.append(lse)
    return torch.where(bad, nan, lp), torch.where(bad, nan, en), lse[:, None], fl


def state(hidden, weight, bias, ids, counted, tau, o, pos=None):
    """The tile loops' state p for one call: the counted rows `pos` (else found: a host read), their
    sampled ids (ids None: not needed) and temperatures, the head and the options `o`
    (head_replay_ops.ReplayOptions)."""
    if pos is None:
        pos = counted.reshape(-1).nonzero().squeeze(1)  # sync: the counted rows
    head = hd.Head(weight, bias, o.scale, o.cap, o.proj)
    return types.SimpleNamespace(head=head, pos=pos, y=None if ids is None else ids.reshape(-1)[pos],
                                 tau=at(o.tau if tau is None else tau, pos), unions=None, with_plan=False,
                                 backend=rp.resolved(o.backend, weight.device, hd.project_dtype(weight, o.proj)),
                                 budget=o.budget, rows=None,
                                 per_entry=hd.row_bytes(1, hd.project_dtype(weight, o.proj), weight.device),
                                 rules=None, invalid=None, metrics=None, vp=o.vp, lse_kept=[],
                                 columns=None if o.vp is None else types.SimpleNamespace(group=o.vp.group, start=0))


def counted_with_offsets(counted, flat):
    """The counted rows (M,) and, on the host, their sets' offsets (M + 1 ints, as with_sets forms them on
    the device), in one host read of the mask and the flat offsets (n + 1,); the rows are then listed in the
    size the host knows (nonzero_static: no read more)."""
    c = counted.reshape(-1)
    n = c.numel()
    host = torch.cat([(c if c.dtype == torch.bool else c != 0).to(flat.dtype), flat]).tolist()  # sync: the rows, tiles
    off = list(itertools.compress(host[n:], host[:n]))  # (C-speed: no Python loop over the tokens)
    return torch.nonzero_static(c, size=len(off)).squeeze(1), off + [host[-1]]


def with_sets(p, token_ids, flat, invalid, off_host=None):
    """p with the counted tokens' kept sets, given in the flat layout (token_ids, offsets (n + 1,) with an
    uncounted token's set empty, invalid (n,) or None), and the union tiles planned on them (a host read
    of the offsets, unless `off_host` gives them: counted_with_offsets)."""
    p.token_ids = token_ids
    p.offsets = torch.cat([flat[p.pos], flat[-1:]])
    p.invalid = None if invalid is None else invalid[p.pos]
    _plan(p, p.head.weight.shape[0] if p.vp is None else p.vp.V_max, off_host)  # (else a sync: the tiles)
    return p


def _plan(p, V, off_host=None):
    """p's union tiles, planned from its sets' offsets (a host read, unless given), and their bounds in the
    kept ids."""
    p.off_host = p.offsets.tolist() if off_host is None else off_host  # sync: the tiles
    p.V_plan = V
    p.tiles = plan_union(list(map(operator.sub, p.off_host[1:], p.off_host[:-1])), V, p.per_entry, p.budget)
    p.kb = [p.off_host[m0] for m0, _ in p.tiles] + [p.off_host[-1]]


def with_saved(p, saved, invalid):
    """p with the union tiles the forward planned and formed (its Unions.saved(), one host read) and the
    counted tokens' `invalid` flags (flat layout, or None)."""
    p.unions, p.tiles, p.kb = Unions.from_saved(*saved)
    p.invalid = None if invalid is None else invalid[p.pos]
    return p


def saved_plan(p):
    """What a backward rebuilds p's union tiles from (with_saved): [pos, *Unions.saved()]; all empty when
    p formed none (no counted token)."""
    if p.unions is None:
        return [p.pos, *(p.pos.new_empty(0) for _ in range(4)), p.pos.new_zeros(3)]
    return [p.pos, *p.unions.saved()]


def flat_sets(p, counted):
    """The counted tokens' sets in p in the flat layout of the tokens `counted` (n,) marks: (token_ids,
    offsets (n + 1,), invalid (n,))."""
    invalid = torch.zeros(counted.numel(), dtype=torch.bool, device=p.pos.device)
    if p.invalid is not None:
        invalid = invalid.scatter(0, p.pos, p.invalid)
    return p.token_ids, flat_offsets(p.offsets, counted)[0], invalid


def forward(hidden, p):
    """logp, H, stats, flags of the counted tokens (M,) over their kept sets (rebuilt by p.rules, else p's),
    NaN where flagged or invalid (stats: the sets' LSE (M, 1) with a vocabulary split)."""
    if p.rules is not None:
        return _rebuild_forward(hidden, p)
    h, un = _hidden(hidden, p), unions(p)
    out = [_replay(_project(h[m0:m1], *_columns(p.head, u)), ids, off, ly, at(p.tau, slice(m0, m1)),
                   None if p.invalid is None else p.invalid[m0:m1], p)
           for j, (m0, m1) in enumerate(p.tiles) for u, ids, off, ly in [_tile(un, p, j)]]
    return _finish(out, p, p.invalid)


def backward(hidden, weight, bias, p, g_logp, g_ent, need, stats=None, ent=None):
    """dL/dh, dL/dW, dL/db (None where not `need`ed) from the upstream gradients (M,) of logp and H: per
    union tile the projection again, the replay's gradient (from the forward's stats and entropies (M, 3),
    (M,); with a vocabulary split, stats (M, 1) the sets' merged LSE: no collective) and the two gradient
    GEMMs on the union: about 7 launches a tile, the rest once per call."""
    acc = float_dtype_for(weight)
    dh = torch.zeros_like(hidden, memory_format=torch.contiguous_format) if need[0] else None  # any strides
    dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need[1] else None
    db = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need[2] and bias is not None else None
    h, un = _hidden(hidden, p), unions(p)
    dhc = torch.empty(h.shape, dtype=hd.project_dtype(weight, p.head.proj), device=h.device) if need[0] else None
    for j, (m0, m1) in enumerate(p.tiles):
        u, ids, off, ly = _tile(un, p, j)
        w_u, b_u = _columns(p.head, u)
        tau = at(p.tau, slice(m0, m1))
        if p.vp is None:
            gz = rp.replay_grad(_project(h[m0:m1], w_u, b_u).unsqueeze(0), *_rows(p, m1 - m0), ly, tau, ids, off,
                                stats[m0:m1], ent[m0:m1], g_logp[m0:m1], g_ent[m0:m1], p.head.scale, p.head.cap,
                                p.backend)[0]
        else:  # (the forward's invalid tokens: H NaN there, no gradient)
            gz = vocab_replay.merge_grad(_project(h[m0:m1], w_u, b_u).unsqueeze(0), *_rows(p, m1 - m0), ly, tau, ids,
                                         off, p.columns, stats[m0:m1, 0], ent[m0:m1], g_logp[m0:m1], g_ent[m0:m1],
                                         p.head.scale, p.head.cap)[0]
        if dhc is not None:
            torch.mm(gz, w_u, out=dhc[m0:m1])
        if dw is not None:
            dw.index_add_(0, u, hd.product(gz.t(), h[m0:m1], acc))
        if db is not None:
            db.index_add_(0, u, gz.sum(0, dtype=acc))
    nan_rows = torch.isnan(g_logp + g_ent)  # a NaN coefficient (an invalid token, unvalidated, malformed sets)
    if dh is not None:  # its row NaN, even where its set is empty
        dhc.masked_fill_(nan_rows[:, None], float("nan"))
        dh.view(-1, dh.shape[-1]).index_copy_(0, p.pos, dhc.to(dh.dtype))
    if dw is not None or db is not None:  # then every entry NaN, as the whole vocabulary's gradient would be
        poisoned = nan_rows.any()
        for g in (x for x in (dw, db) if x is not None):
            g.masked_fill_(poisoned, float("nan"))
    return dh, dw, db


def _hidden(hidden, p):
    """The counted tokens' hidden states (M, D), gathered once per pass, in the projection's dtype."""
    return hd.upcast(rows_of(hidden, p.pos, flat_rows(hidden)), p.head.proj)


def _finish(out, p, invalid):
    """The tiles' (logp, H, stats, flags) joined, NaN where flagged or `invalid` (M,) (the vocabulary
    split's merge did that per tile)."""
    lp, en, fl = (_cat([o[i] for o in out], p, dt) for i, dt in ((0, None), (1, None), (3, torch.int8)))
    if p.vp is not None:
        return lp, en, _cat([o[2] for o in out], p) if out else lp.new_zeros(0, 1), fl
    st = _cat([o[2] for o in out], p) if out else lp.new_zeros(0, 3)
    return rp.finish(lp, en, st, fl, invalid)


def _cat(xs, p, dtype=None):
    if len(xs) == 1:  # one tile: its tensor itself (no copy)
        return xs[0]
    if xs:
        return torch.cat(xs)
    return torch.zeros(0, dtype=dtype or float_dtype_for(p.head.weight), device=p.head.weight.device)


def unions(p):
    """Every tile's union of kept sets (kernels.tile_union.tile_unions), formed once per call (p.with_plan:
    with their plan, for the backward); with a vocabulary split, of the ids in this rank's slice (rows of
    its weight)."""
    if p.unions is None and p.tiles:
        lo = 0 if p.vp is None else p.vp.start  # (malformed sets, unvalidated: all empty, none of the ids read)
        bounds = None  # the torch backend: the host's tiles copied to the device
        if p.backend == "triton":  # the same tiles cut on the device: nothing copied to it
            bounds = union_bounds(p.offsets, len(p.tiles), p.V_plan, p.per_entry, p.budget, TILE_ROWS)
        p.unions = tile_unions(p.token_ids[:p.off_host[-1]], p.offsets, p.y, p.tiles, p.head.weight.shape[0], lo,
                               p.backend, p.with_plan, bounds)
    return p.unions


def _tile(un, p, j):
    """Tile j's (union, local ids, local offsets, local sampled ids)."""
    m0, m1 = p.tiles[j]
    return un.tile(j, m0, m1, p.kb[j], p.kb[j + 1])


def _rebuild_forward(hidden, p):
    """The rules' forward: tiles of every logit (the full head's budget), the sets rebuilt there and the
    replay on them; the sets, their metrics and the backward's union tiles are kept in p."""
    top_k, top_p, min_p = p.rules
    M = p.pos.numel()
    V = p.head.weight.shape[0]
    V_tiles = V if p.vp is None else p.vp.V_max  # a vocabulary split: the same tiles on every rank
    step = max(1, hd.rows_per_tile(V_tiles, hd.project_dtype(p.head.weight, p.head.proj), p.head.weight.device,
                                   p.budget))
    block = max(1, p.budget // (2 * SET_BYTES * max(V_tiles, 1)))  # the rebuild's blocks: within the budget too
    out, ids, sizes, restored, mass, nonfinite = [], [], [], [], [], []
    # head_dtype=float32: the whole weight upcast once for every tile here
    w, bias = hd.upcast(p.head.weight, p.head.proj), hd.upcast(p.head.bias, p.head.proj)
    h = _hidden(hidden, p)
    for m0 in range(0, M, step):
        sl = slice(m0, min(M, m0 + step))
        z = _project(h[sl], w, bias)
        tau = at(p.tau, sl)
        rules = (at(top_k, sl), at(top_p, sl), at(min_p, sl))
        if p.vp is None and p.backend == "triton" and z.dtype != torch.float64:  # thresholds, then the lists
            tid, off, rest, nf, ms = kept_sets_tile(z, p.y[sl], tau, *rules, p.head.scale, p.head.cap)
        elif p.vp is None:
            tid, off, rest, nf, ms = kept_sets(z.unsqueeze(0), *_rows(p, z.shape[0]), p.y[sl], tau, *rules,
                                               p.head.scale, p.head.cap, block_rows=block)
        else:  # each rank's top_k candidates gathered; the full normalizer's log for kept_mass
            tid, off, rest, nf, lse_full = vocab_replay.rebuilt_sets(
                z.unsqueeze(0), *_rows(p, z.shape[0]), p.y[sl], tau, *rules, p.vp, p.head.scale, p.head.cap,
                block_rows=block)
        if p.vp is None:  # NaN where the rows hold NaN / +inf or a rule's value is invalid: once, in _finish
            out.append(_replay(z, tid, off, p.y[sl], tau, None, p))
        else:
            out.append(_replay(z, tid, off, p.y[sl], tau, nf if p.invalid is None else nf | p.invalid[sl], p, p.vp))
            ms = torch.exp(p.lse_kept.pop() - lse_full)
        ids.append(tid), sizes.append(off.diff()), restored.append(rest), mass.append(ms), nonfinite.append(nf)
        del z
    p.token_ids = _cat(ids, p, torch.long)
    counts = _cat(sizes, p, torch.long)
    p.offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    _plan(p, V if p.vp is None else p.vp.V_max)  # sync: the backward's union tiles
    nf = _cat(nonfinite, p, torch.bool)
    p.invalid = nf if p.invalid is None else nf | p.invalid
    p.metrics = rp.replay_metrics(p.offsets, _cat(restored, p, torch.bool), _cat(mass, p))
    lp, en, st, fl = _finish(out, p, p.invalid)
    if p.vp is None:  # (with a split, refuse_unbuilt names such a row with the ties it cannot rebuild)
        fl = fl | nonfinite_flag(nf)
    return lp, en, st, fl
