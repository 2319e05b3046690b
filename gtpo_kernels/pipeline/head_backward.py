"""The recompute schedule's backward (spec 11): the rows with a gradient projected again, their dL/dz
written by the gradient kernel, then the gradient GEMMs.

When the rows with a gradient fill more than one tile, the backward runs in vocabulary order: each tile
is a block of `rows` rows x `cols` vocabulary entries (the memory budget's elements), and for one block of
rows the vocabulary blocks follow each other,

    z       = h @ W[v0:v1].T (+ b[v0:v1])                 the block's logits
    dL/dz   the gradient kernel over the block (the row statistics are the whole row's, from the
            forward; the target counts where it lies in [v0, v1))
    dL/dW[v0:v1] += dL/dz.T @ h                            each weight row touched once per block of rows
    dL/dh       += dL/dz @ W[v0:v1]                        into a float32 accumulator of the block's rows

so the float32 weight-gradient accumulator is read and written once per block of rows (once in all when
every row with a gradient fits one block: tall, narrow tiles) instead of once per tile of whole rows, and
the hidden-gradient accumulator, rows x D, is the small one that is revisited. `traffic` gives both
accumulators' bytes for a plan. Under batch_invariant (fixed-shape projections) and across a vocabulary
split the backward keeps tiles of whole rows.
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch

from ..core.layout import float_dtype_for
from ..kernels import dispatch, vocab_triton
from . import head as hd
from . import tiles

# the narrowest vocabulary block (a block of rows is cut before the vocabulary block gets narrower); the
# environment variable GTPO_HEAD_MIN_COLS sets another (the tests' small vocabularies take this path)
MIN_COLS = int(os.environ.get("GTPO_HEAD_MIN_COLS", "") or 2048)


class BackwardPlan(NamedTuple):
    rows: int  # rows of a tile
    cols: int  # vocabulary entries of a tile (V: tiles of whole rows)


def plan(n, V, per_tile, by_vocab=True):
    """The tile of the backward of n rows with a gradient, V entries, a budget of per_tile whole rows:
    whole rows when they fit one tile (or by_vocab is off), else the tallest tile of at least MIN_COLS
    entries (a multiple of 256 from 256 on) within the budget's per_tile * V elements."""
    if not by_vocab or n <= per_tile or V <= MIN_COLS:
        return BackwardPlan(max(1, min(n, per_tile)), V)
    elems = per_tile * V
    cols = elems // n
    cols = max(min(V, MIN_COLS), min(V, cols // 256 * 256 if cols >= 256 else cols))
    return BackwardPlan(max(1, min(n, elems // cols)), cols)


def traffic(n, V, D, p, acc_bytes=4):
    """Bytes the accumulators move in a backward of n rows by plan p: the weight gradient's (V x D, read
    and written once per block of rows) and, by vocabulary blocks, the hidden gradient's (a block of rows x
    D, read and written once per vocabulary block). Tiles of whole rows: the weight gradient's per tile."""
    row_blocks = math.ceil(n / p.rows) if n else 0
    col_blocks = math.ceil(V / p.cols)
    dw = row_blocks * 2 * V * D * acc_bytes
    dh = 0 if p.cols == V else col_blocks * 2 * n * D * acc_bytes
    return dw + dh


def backward_tiles(opts, t, stats, ent, c, e, need, g=None):
    """[dh, dw, db] from the coefficients, multiplied by the upstream gradient g (one element or one per
    token; None: already multiplied), projecting again only the rows where c or e is nonzero."""
    rows = tiles.plan_backward(c, e)
    n = rows.numel()
    grads = tiles.zero_grads(t, need)
    V = t.weight.shape[0]
    p = plan(n, V, opts.per_tile, by_vocab=opts.vp is None and not opts.invariant)
    every = n == c.numel()  # every token has a gradient: a block of rows is consecutive tokens
    if p.cols == V:
        ws = tiles.Workspace(opts, t, min(n, p.rows))
        for s in range(0, n, p.rows):
            idx = rows[s:s + p.rows]
            at = (s, s + idx.numel()) if every else None
            h = ws.rows(idx, at)
            z = ws.project(h)
            ws.gradient(z, h, idx, stats, ent, c, e, grads, at, g)
        return grads
    _by_vocab(opts, t, rows, p, stats, ent, c, e, grads, g, every)
    return grads


def _by_vocab(opts, t, rows, p, stats, ent, c, e, grads, g, every):
    """The backward in vocabulary order (module docstring)."""
    dh, dw, db = grads
    V, D = t.weight.shape
    n = rows.numel()
    buf = torch.empty(p.rows * p.cols, dtype=t.weight.dtype, device=t.weight.device)
    acc = torch.empty((p.rows, D), dtype=float_dtype_for(t.weight), device=t.weight.device) if dh is not None \
        else None
    flat = tiles.flat_rows(t.hidden)
    direct = opts.backend == "triton"
    for s in range(0, n, p.rows):
        idx = rows[s:s + p.rows]
        k = idx.numel()
        at = (s, s + k) if every else None
        h = tiles.rows_of(t.hidden, idx, flat, at).to(t.weight.dtype)  # head_dtype=float32: the rows upcast
        dh_k = None if acc is None else acc[:k].zero_()
        for v0 in range(0, V, p.cols):
            w = min(p.cols, V - v0)
            W = t.weight[v0:v0 + w]
            z = tiles.project(h, W, None if t.bias is None else t.bias[v0:v0 + w], buf[:k * w].view(k, w))
            z3 = z.unsqueeze(0)
            if direct:  # the block's gradient, each row's token read from idx, its target shifted by v0
                vocab_triton.vocab_bwd(z3, z3, t.kernel_ids, stats, ent, c, e, t.temperature, 0, scale=opts.scale,
                                       softcap=opts.softcap, g=g, rows=idx, id_start=v0)
            else:
                dispatch.vocab_bwd(opts.backend, z3, z3, t.kernel_ids[idx] - v0, stats[idx], ent[idx], c[idx],
                                   None if e is None else e[idx], tiles.tau_of(t.temperature, idx), 0,
                                   scale=opts.scale, softcap=opts.softcap,
                                   g=g if g is None or g.numel() == 1 else g[idx])
            if dw is not None:
                hd.accumulate(dw[v0:v0 + w], z.t(), h)
            if dh_k is not None:
                hd.accumulate(dh_k, z, W)
            if db is not None:
                db[v0:v0 + w] += z.sum(0, dtype=db.dtype)
        if dh_k is not None:
            dh2 = dh.view(-1, D)
            if at is not None:
                dh2[at[0]:at[1]].copy_(dh_k)
            else:
                dh2.index_copy_(0, idx, dh_k.to(dh.dtype))
