"""The LM head over the sampler's kept sets (spec 11 and 13): only the union of a tile's kept sets is
projected.

For a tile of counted tokens m0..m1-1 with kept sets K_m, U = the union of the K_m, sorted:

    z_U = h_tile @ W[U].T (+ b[U])          (rows x |U|: one GEMM, 2 rows |U| D FLOPs)
    logp, H over each K_m                    (the replay kernel, on z_U with the sets as columns of U)

and in the backward the same projection again, the replay's gradient dL/dz_U (exactly 0 outside the
sets, so outside U too), then dL/dh = dL/dz_U @ W[U] and dL/dW[U] += dL/dz_U.T @ h: 4 GEMMs over |U|
columns where the full-vocabulary head runs 3 or 4 over V. Tiles are planned on the host from the
sets' sizes (one read of the offsets): a tile's rows x min(sum of its set sizes, V) entries of logits
and gradient within `memory_budget` (the union is at most that), and at most TILE_ROWS tokens (a token's
GEMM work is its tile's union, which grows with the tile). With the rules (top_k / top_p /
min_p) the sets are rebuilt from the current logits, which needs every logit once: the forward projects
tiles of the whole vocabulary (the full head's budget), rebuilds the sets there and replays on them;
only the backward projects the unions.
"""
from __future__ import annotations

import types

import torch

from ..core.layout import float_dtype_for
from ..core.sampling import flat_offsets
from ..distributed import vocab_replay
from ..kernels import replay as rp
from ..kernels.kept_set import kept_sets
from ..kernels.kept_set_triton import kept_sets_tile
from . import head as hd
from .replay import at, nonfinite_flag
from .tiles import flat_rows, rows_of


TILE_ROWS = 256  # counted tokens a tile at most: the union, so the GEMM work per token, grows with the tile
SET_BYTES = 32  # bytes per logit the kept-set rebuild's block holds (values, their sort and indices, masks)


def plan_union(sizes, V, per_entry, budget, max_rows=TILE_ROWS):
    """Tiles (m0, m1) over the counted tokens (host ints `sizes`, each kept set's size): each tile's rows x
    min(its sets' total size, V) entries of `per_entry` bytes within `budget` bytes, and at most
    `max_rows` rows (each token's GEMM work is the tile's union: smaller tiles, smaller unions)."""
    tiles, m0, K = [], 0, 0
    for m, k in enumerate(sizes):
        if per_entry * min(k, V) > budget:
            raise ValueError(f"memory_budget = {budget} bytes holds no row of kept logits and their gradient: "
                             f"counted token {m}'s kept set of {k} ids takes {per_entry * min(k, V)} bytes; "
                             "raise memory_budget")
        if m > m0 and (m - m0 >= max_rows or per_entry * (m + 1 - m0) * min(K + k, V) > budget):
            tiles.append((m0, m))
            m0, K = m, 0
        K += k
    if m0 < len(sizes):
        tiles.append((m0, len(sizes)))
    return tiles


def _project(h, head, cols):
    """h @ W[cols].T (+ b[cols]): the tile's raw logits on the columns `cols` (None: every column)."""
    w = hd.upcast(head.weight if cols is None else head.weight.index_select(0, cols), head.proj)
    h = hd.upcast(h, head.proj)  # head_dtype=float32: the tile's rows and columns upcast, a float32 GEMM
    if head.bias is None:
        return h @ w.t()
    return torch.addmm(hd.upcast(head.bias if cols is None else head.bias.index_select(0, cols), head.proj), h, w.t())


def _tile_rows(z):
    """A tile z's rows as (rows_b, rows_t) of z.unsqueeze(0): zeros and 0..n-1."""
    rows_t = torch.arange(z.shape[0], device=z.device)
    return torch.zeros_like(rows_t), rows_t


def _replay(z, ids, offsets, y, tau, invalid, p, vp=None):
    """logp, H, flags of a tile's rows over their sets (columns of z), differentiable w.r.t. z. With a
    vocabulary split, z holds this rank's columns (vp.start: the first one's id, or 0 where ids and y
    are already columns, -1 elsewhere) and the statistics are merged over the group."""
    if p.vp is None:
        return rp.replay_logprobs(z.unsqueeze(0), *_tile_rows(z), y, tau, ids, offsets, invalid,
                                  p.head.scale, p.head.cap, p.backend)
    lp, en, fl, lse = vocab_replay.merge(z.unsqueeze(0), *_tile_rows(z), y, tau, ids, offsets,
                                         vp or p.columns, p.head.scale, p.head.cap)
    bad = fl != 0 if invalid is None else (fl != 0) | invalid
    nan = torch.full_like(lp, float("nan"))
    p.lse_kept.append(lse)
    return torch.where(bad, nan, lp), torch.where(bad, nan, en), fl


def state(hidden, weight, bias, ids, counted, tau, o):
    """The tile loops' state p for one call: the counted rows (a host read), their sampled ids and
    temperatures, the head and the options `o` (head_replay_ops.ReplayOptions)."""
    pos = counted.reshape(-1).nonzero().squeeze(1)  # sync: the counted rows
    head = hd.Head(weight, bias, o.scale, o.cap, o.proj)
    return types.SimpleNamespace(head=head, pos=pos, y=ids.reshape(-1)[pos], tau=at(o.tau if tau is None else tau, pos),
                                 backend=o.backend, budget=o.budget,
                                 per_entry=hd.row_bytes(1, hd.project_dtype(weight, o.proj), weight.device),
                                 rules=None, invalid=None, invalid_parts=[], metrics=None, vp=o.vp, lse_kept=[],
                                 columns=None if o.vp is None else types.SimpleNamespace(group=o.vp.group, start=0))


def with_sets(p, token_ids, flat, invalid):
    """p with the counted tokens' kept sets, given in the flat layout (token_ids, offsets (n + 1,) with an
    uncounted token's set empty, invalid (n,) or None), and the union tiles planned on them (a host read
    of the offsets)."""
    p.token_ids = token_ids
    p.offsets = torch.cat([flat[p.pos], flat[-1:]])
    p.invalid = None if invalid is None else invalid[p.pos]
    p.off_host = p.offsets.tolist()  # sync: the tiles
    p.tiles = plan_union([e - s for s, e in zip(p.off_host[:-1], p.off_host[1:])],
                         p.head.weight.shape[0] if p.vp is None else p.vp.V_max, p.per_entry, p.budget)
    return p


def flat_sets(p, counted):
    """The counted tokens' sets in p in the flat layout of the tokens `counted` (n,) marks: (token_ids,
    offsets (n + 1,), invalid (n,))."""
    invalid = torch.zeros(counted.numel(), dtype=torch.bool, device=p.pos.device)
    if p.invalid is not None:
        invalid = invalid.scatter(0, p.pos, p.invalid)
    return p.token_ids, flat_offsets(p.offsets, counted)[0], invalid


def forward(hidden, p):
    """logp, H, flags (M,) of the counted tokens over their kept sets: rebuilt by p.rules, else p's sets."""
    if p.rules is not None:
        return _rebuild_forward(hidden, p)
    out = [_replay(_project(rows_of(hidden, p.pos[m0:m1], flat_rows(hidden)), p.head, u), ids, off, ly, at(p.tau, slice(m0, m1)),
                   None if p.invalid is None else p.invalid[m0:m1], p)
           for (m0, m1), (u, ids, off, ly) in zip(p.tiles, _unions(p))]
    return tuple(_cat([o[i] for o in out], p, dt) for i, dt in ((0, None), (1, None), (2, torch.int8)))


def backward(hidden, weight, bias, p, g_logp, g_ent, need):
    """dL/dh, dL/dW, dL/db (None where not `need`ed) from the upstream gradients (M,) of logp and H: per
    union tile the projection again, the replay's gradient and the two gradient GEMMs on the union."""
    acc = float_dtype_for(weight)
    dh = torch.zeros_like(hidden, memory_format=torch.contiguous_format) if need[0] else None  # any strides
    dw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need[1] else None
    db = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need[2] and bias is not None else None
    for (m0, m1), (u, ids, off, ly) in zip(p.tiles, _unions(p)):
        idx = p.pos[m0:m1]
        h = rows_of(hidden, idx, flat_rows(hidden))
        with torch.enable_grad():
            z = _project(h, p.head, u).detach().requires_grad_()
            lp, en, _ = _replay(z, ids, off, ly, at(p.tau, slice(m0, m1)),
                                None if p.invalid is None else p.invalid[m0:m1], p)
            gz, = torch.autograd.grad([lp, en], [z], [g_logp[m0:m1], g_ent[m0:m1]])
        if dh is not None:
            dh.view(-1, dh.shape[-1]).index_copy_(0, idx, (gz @ hd.upcast(weight.index_select(0, u), p.head.proj))
                                                  .to(dh.dtype))
        if dw is not None:
            dw.index_add_(0, u, hd.accumulate(torch.zeros(u.numel(), h.shape[-1], dtype=acc, device=h.device),
                                              gz.t(), h))
        if db is not None:
            db.index_add_(0, u, gz.sum(0, dtype=acc))
    p.lse_kept.clear()
    return dh, dw, db


def _cat(xs, p, dtype=None):
    if len(xs) == 1:  # one tile: its tensor itself (no copy)
        return xs[0]
    if xs:
        return torch.cat(xs)
    return torch.zeros(0, dtype=dtype or float_dtype_for(p.head.weight), device=p.head.weight.device)


def _unions(p):
    """Each tile's (union, local ids, local offsets, local sampled ids), one tile at a time; with a
    vocabulary split the union of the ids in this rank's slice (rows of its weight), the others -1."""
    for m0, m1 in p.tiles:
        k0, k1 = p.off_host[m0], p.off_host[m1]
        if p.vp is None:
            yield rp.tile_union(p.token_ids, p.offsets, p.y, m0, m1, k0, k1)
            continue
        V_r = p.head.weight.shape[0]
        ids = p.token_ids[k0:k1] - p.vp.start
        u = torch.unique(ids[(ids >= 0) & (ids < V_r)], sorted=True)  # (sync: this slice's union)
        yield u, _columns(u, ids), p.offsets[m0:m1 + 1] - k0, _columns(u, p.y[m0:m1].long() - p.vp.start)


def _columns(u, ids):
    """ids as columns of the sorted union u, -1 where not in it."""
    if u.numel() == 0:
        return torch.full_like(ids, -1)
    col = torch.searchsorted(u, ids).clamp_(max=u.numel() - 1)
    return torch.where(u[col] == ids, col, torch.full_like(col, -1))


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
    lps, ents, flags, ids, sizes, restored, mass = [], [], [], [], [], [], []
    # head_dtype=float32: the whole weight upcast once for every tile here (_project then upcasts only the rows)
    full = p.head._replace(weight=hd.upcast(p.head.weight, p.head.proj), bias=hd.upcast(p.head.bias, p.head.proj))
    for m0 in range(0, M, step):
        sl = slice(m0, min(M, m0 + step))
        z = _project(rows_of(hidden, p.pos[sl], flat_rows(hidden)), full, None)
        tau = at(p.tau, sl)
        rules = (at(top_k, sl), at(top_p, sl), at(min_p, sl))
        if p.vp is None and p.backend == "triton" and z.dtype != torch.float64:  # thresholds, then the lists
            tid, off, rest, nonfinite, ms = kept_sets_tile(z, p.y[sl], tau, *rules, p.head.scale, p.head.cap)
        elif p.vp is None:
            tid, off, rest, nonfinite, ms = kept_sets(z.unsqueeze(0), *_tile_rows(z), p.y[sl], tau, *rules,
                                                      p.head.scale, p.head.cap, block_rows=block)
        else:  # each rank's top_k candidates gathered; the full normalizer's log for kept_mass
            tid, off, rest, nonfinite, lse_full = vocab_replay.rebuilt_sets(
                z.unsqueeze(0), *_tile_rows(z), p.y[sl], tau, *rules, p.vp, p.head.scale, p.head.cap,
                block_rows=block)
        bad = nonfinite if p.invalid is None else nonfinite | p.invalid[sl]
        lp, en, fl = _replay(z, tid, off, p.y[sl], tau, bad, p, p.vp)
        if p.vp is None:  # (with a split, refuse_unbuilt names such a row with the ties it cannot rebuild)
            fl = fl | nonfinite_flag(nonfinite)
        if p.vp is not None:
            ms = torch.exp(p.lse_kept.pop() - lse_full)
        lps.append(lp), ents.append(en), flags.append(fl), ids.append(tid), sizes.append(off.diff())
        restored.append(rest), mass.append(ms)
        p.invalid_parts.append(bad)
        del z
    p.token_ids = _cat(ids, p, torch.long)
    counts = _cat(sizes, p, torch.long)
    p.offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    p.off_host = p.offsets.tolist()  # sync: the backward's union tiles
    p.tiles = plan_union(counts.tolist(), V if p.vp is None else p.vp.V_max, p.per_entry, p.budget)
    p.invalid = _cat(p.invalid_parts, p, torch.bool)
    p.metrics = rp.replay_metrics(p.offsets, _cat(restored, p, torch.bool), _cat(mass, p))
    return _cat(lps, p), _cat(ents, p), _cat(flags, p, torch.int8)
