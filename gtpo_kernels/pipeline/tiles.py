"""The fused LM head's tile loops (spec 11) over the plans of tile_plan.py. Each tile is projected by one
GEMM into one buffer reused across tiles (never more than `per_tile` rows: the memory budget), the
vocabulary kernels run on it (on the Triton backend they read each row's token from the tile's row
indices), and with a gradient the kernel writes dL/dz_raw in place of the logits, which the two gradient
GEMMs read:

    fused (forward)        project, statistics, the tile's coefficients c, e, gradient, dL/dh, dL/dW
                           (the gradient only on rows not known to have c = e = 0: prior_live)
    recompute (backward)   head_backward.py: only rows with c != 0 or e != 0

The fused schedule's c, e come from the epilogue kernel run on the tile's completions (or the eager
surrogate on the tile's tokens and completions alone), with the batch-wide counts, so the O(N) work per
tile does not grow with the tiles.
"""
from __future__ import annotations

import types

import torch

from ..core import vocab_block
from ..core.flags import nan_at_flags
from ..core.layout import Batch, float_dtype_for
from ..distributed import vocab_parallel as parallel
from ..kernels import dispatch, loss_ops, vocab_triton
from . import head as hd
from .head import project, project_blocks
from . import loss
from .tile_plan import plan_backward, plan_rows  # noqa: F401  (read as tiles.plan_*: the sync checks wrap them)


def flat_rows(hidden):
    """hidden as (N, D) rows: a view where its strides allow one (any (N, D), a (B, T, D) whose rows
    flatten), else None (then rows_of gathers by (i, t))."""
    if hidden.dim() == 2:
        return hidden
    try:
        return hidden.view(-1, hidden.shape[-1])
    except RuntimeError:
        return None


def rows_of(hidden, idx, flat=None, span=None):
    """The hidden states of flat tokens idx: (N, D), or (B, T, D) with any strides (read in place). flat:
    flat_rows(hidden) (one gather, or none with span: the tokens span[0] .. span[1] - 1 in order)."""
    flat = hidden if flat is None and hidden.dim() == 2 else flat
    if flat is not None:
        return flat[span[0]:span[1]] if span is not None else flat.index_select(0, idx)
    T = hidden.shape[1]
    return hidden[idx // T, idx % T]


class Workspace:
    """One call's tile buffers, reused across its tiles, and the per-tile GEMMs and kernel calls. On the
    Triton backend the kernels read and write the per-token tensors at the tile's tokens themselves (no
    gather or scatter around them): direct, one process; rows_vp, a vocabulary slice merged by the
    all-reduces (its forward kernel, the merge's sums and finish); the gradient kernel either way."""

    def __init__(self, opts, t, rows, ones=False):
        self.o, self.t = opts, t
        V = t.weight.shape[0]
        dt, dev = t.weight.dtype, t.weight.device
        self.buf = torch.empty(rows * V, dtype=dt, device=dev)
        self.direct = opts.backend == "triton" and opts.vp is None
        self.rows_vp = opts.backend == "triton" and opts.vp is not None and not (
            opts.vp[2] is not None and vocab_block.aligned(opts.vp[2]))  # (aligned slices: the block merge)
        self.ones = torch.ones(rows, dtype=torch.bool, device=dev) if ones or not (self.direct or self.rows_vp) \
            else None
        self.flat = flat_rows(t.hidden)

    def rows(self, idx, span=None):
        """The tile's hidden rows (span: the tokens are span[0] .. span[1] - 1, a view)."""
        return rows_of(self.t.hidden, idx, self.flat, span)

    def project(self, h):
        """The tile's raw logits h @ W.T + bias, by one GEMM into the reused buffer."""
        V = self.t.weight.shape[0]
        z = self.buf[:h.shape[0] * V].view(h.shape[0], V)  # V = 0: a rank's empty vocabulary slice
        h = h.to(z.dtype)  # head_dtype=float32: the rows upcast
        if not self.o.invariant:
            return project(h, self.t.weight, self.t.bias, z)
        return project_blocks(h, self.t.weight, self.t.bias, z)

    def statistics(self, z, idx, outs, span=None, nan_flagged=False):
        """(logp, H, stats, flags) of the tile's rows into `outs` (per flat token); scale and softcap applied
        inside the kernels. span: the tile's tokens are span[0] .. span[1] - 1 (split vocabulary: the merge
        writes them in place, the tile's ids read as views: no gather or scatter). nan_flagged (direct or
        rows_vp): the kernels write logp and H NaN at a flagged token."""
        o, t = self.o, self.t
        if self.direct:  # one launch: the kernel reads each row's token from idx
            vocab_triton.vocab_fwd(z.unsqueeze(0), t.kernel_ids, None, t.temperature, 0, scale=o.scale,
                                   softcap=o.softcap, outs=outs, rows=idx, nan_flagged=nan_flagged)
            return
        if self.rows_vp:  # the forward kernel, the merge's sums and its finish read and write at idx
            tile = types.SimpleNamespace(logits3=z.unsqueeze(0), mask=None, logits_start=0, V=z.shape[-1], ids=t.ids)
            parallel.vp_forward(tile, t.kernel_ids, t.temperature, o.backend, o.vp[0], o.vp[1], scale=o.scale,
                                softcap=o.softcap, sizes=o.vp[2], nan_flagged=nan_flagged, outs=outs, rows=idx)
            return
        at = idx if span is None or o.vp is None else slice(*span)
        views = None if at is idx else [out[at] for out in outs]
        res = self._statistics(z, at, views)
        if views is None:
            for out, x in zip(outs, res):
                out[idx] = x

    def _statistics(self, z, idx, outs=None):
        o, t, ones = self.o, self.t, self.ones[:z.shape[0]]
        tau = tau_of(t.temperature, idx)
        if o.vp is None:
            return dispatch.vocab_fwd(o.backend, z.unsqueeze(0), t.kernel_ids[idx], ones, tau, 0,
                                      scale=o.scale, softcap=o.softcap)
        tile = types.SimpleNamespace(logits3=z.unsqueeze(0), counted=ones, mask=None, logits_start=0, V=z.shape[-1],
                                     ids=t.ids[idx])  # the statistics merged over the vocabulary slices (every row counts)
        return parallel.vp_forward(tile, t.kernel_ids[idx], tau, o.backend, o.vp[0], o.vp[1],
                                   scale=o.scale, softcap=o.softcap, sizes=o.vp[2], outs=outs)

    def gradient(self, z, h, idx, st, en, c, e, grads, at=None, g=None, local=False):
        """dL/dz_raw of the tile written over z (the kernel's chain rule), then dL/dh, dL/dW, dL/db. st, en,
        c, e: per flat token (read at idx; local: c and e are the tile's rows already, the torch path); g: the
        upstream gradient (one element, or per flat token) that c and e are multiplied by, or None."""
        o, t = self.o, self.t
        z3 = z.unsqueeze(0)
        if o.backend == "triton" and not local:  # one launch: the kernel reads each row's token from idx
            vocab_triton.vocab_bwd(z3, z3, t.kernel_ids, st, en, c, e, t.temperature, 0, scale=o.scale,
                                   softcap=o.softcap, g=g, rows=idx)
        else:
            g = g if g is None or g.numel() == 1 else g[idx]
            c, e = (c, e) if local else (c[idx], None if e is None else e[idx])
            dispatch.vocab_bwd(o.backend, z3, z3, t.kernel_ids[idx], st[idx], en[idx], c, e,
                               tau_of(t.temperature, idx), 0, scale=o.scale, softcap=o.softcap, g=g)
        grad_gemms(z, h, idx, t.weight, grads, at)


def tau_of(temperature, idx):
    """The temperature of a tile's rows: one value as it is, a per-token (N,) tensor at the flat tokens idx."""
    if isinstance(temperature, torch.Tensor) and temperature.dim() == 1 and temperature.numel() > 1:
        return temperature[idx]
    return temperature


def grad_gemms(gz, h, idx, weight, grads, at=None):
    """The tile's two gradient GEMMs: dL/dh rows = gz @ W, dL/dW += gz.T @ h (float32); dL/db. at: the
    flat rows (start, end) the tile's tokens occupy when they are consecutive (known on the host from
    the plan): dL/dh is then written there by the GEMM, no temporary and no copy."""
    dh, dw, db = grads
    if dh is not None:
        dh2 = dh.view(-1, dh.shape[-1])
        if at is not None and dh.dtype == weight.dtype:
            torch.mm(gz, weight, out=dh2[at[0]:at[1]])
        elif at is not None:  # head_dtype=float32 on 16-bit inputs: a float32 product, rounded once into dh
            dh2[at[0]:at[1]].copy_(torch.mm(gz, weight))
        else:
            dh2.index_copy_(0, idx, torch.mm(gz, weight).to(dh.dtype))
    if dw is not None:
        hd.accumulate(dw, gz.t(), h)
    if db is not None:
        db += gz.sum(0, dtype=db.dtype)


def zero_grads(t, need):
    """The gradients' accumulators: dL/dh in hidden's dtype, dL/dW and dL/db in float32 (float64)."""
    acc = float_dtype_for(t.weight)
    dev = t.weight.device
    dh = torch.zeros(t.hidden.shape, dtype=t.hidden.dtype, device=dev) if need[0] else None
    dw = torch.zeros(t.weight.shape, dtype=acc, device=dev) if need[1] else None
    db = torch.zeros(t.weight.shape[0], dtype=acc, device=dev) if need[2] and t.bias is not None else None
    return [dh, dw, db]


def forward_tiles(opts, t, need, epi_args=None):
    """Per token (logp, H, stats, flags), flat (N,); with the fused schedule also [dh, dw, db] (None
    where not needed); with epi_args, the epilogue kernel's (floats, flags) for the call (the loss math once
    per call, and on each fused tile for its own completions), its outputs (loss_ops.epilogue_outputs: the loss, c, e,
    the outputs and metrics, its logp and H the ones returned), else None. Flagged counted tokens get NaN
    logp and H."""
    # the rows' order depends on the options and the tokens only (never on which inputs require grad):
    # vocabulary-parallel ranks merge their tiles' statistics row by row
    rows, counts_dev, tiles, live = plan_rows(opts, t, opts.fused)
    N, dev = t.counted.numel(), t.hidden.device
    acc = torch.float64 if t.hidden.dtype == torch.float64 and opts.backend == "torch" else torch.float32
    logp, ent = torch.zeros(N, dtype=acc, device=dev), torch.zeros(N, dtype=acc, device=dev)
    stats, bad = torch.zeros((N, 3), dtype=acc, device=dev), torch.zeros(N, dtype=torch.int8, device=dev)
    ws = Workspace(opts, t, max((k.e - k.s for k in tiles), default=0), ones=opts.fused and epi_args is None)
    grads = zero_grads(t, need) if opts.fused else [None, None, None]
    epi = None
    if epi_args is not None:  # the epilogue's outputs, its logp and H written over the forward's
        epi = loss_ops.epilogue_outputs(logp, N, opts.B, epi_args[1])
        epi[1], epi[2] = logp, ent
    elif opts.fused:
        dt = float_dtype_for(t.hidden)
        totals = (counts_dev.to(dt), torch.full((), rows.numel(), dtype=dt, device=dev))
        nan = torch.full((), float("nan"), dtype=acc, device=dev)
        if ws.direct:
            c_all, e_all = torch.zeros(N, dtype=acc, device=dev), torch.zeros(N, dtype=acc, device=dev)
    # every token counted and none put last: tile k holds the flat tokens k.s .. k.e - 1
    consecutive = rows.numel() == N and (live is None or all(n == k.e - k.s for n, k in zip(live, tiles)))
    nan_in_kernels = epi is None and (ws.direct or ws.rows_vp)  # NaN at flagged tokens written by the kernels
    in_order = rows.numel() == N and live is None  # tile k's rows are the flat tokens k.s .. k.e - 1
    for i, k in enumerate(tiles):
        idx = rows[k.s:k.e]
        span = (k.s, k.e) if in_order else None
        h = ws.rows(idx, span)
        z = ws.project(h)
        ws.statistics(z, idx, (logp, ent, stats, bad), span, nan_in_kernels)
        if opts.fused:  # this tile's coefficients from its own tokens and completions
            if epi is not None:  # the epilogue on the tile's completions (the batch's totals from the mask)
                run_epilogue(opts, t, epi_args, logp, ent, bad, epi, k.g0, k.g1 + 1)
                c, e = epi[4], epi[5] if epi_args[1][loss_ops.FLAGS.index("HAS_E")] else None
            else:
                lp, en = logp[idx], ent[idx]
                invalid = bad[idx] != 0
                c_t, e_t = tile_coefficients(opts, t, k, idx, torch.where(invalid, nan, lp),
                                             torch.where(invalid, nan, en), totals, ws.ones)
                if ws.direct:  # the kernel reads them by token
                    c = c_all.index_copy_(0, idx, c_t.to(acc))
                    e = None if e_t is None else e_all.index_copy_(0, idx, e_t.to(acc))
            n = k.e - k.s if live is None else live[i]  # the gradient on the rows that may have one
            if n and (epi is not None or ws.direct):
                ws.gradient(z[:n], h[:n], idx[:n], stats, ent, c, e, grads, (k.s, k.s + n) if consecutive else None)
            elif n:
                ws.gradient(z[:n], h[:n], idx[:n], stats, ent, c_t[:n].to(acc), None if e_t is None else
                            e_t[:n].to(acc), grads, (k.s, k.s + n) if consecutive else None, local=True)
    if epi is not None:
        run_epilogue(opts, t, epi_args, logp, ent, bad, epi)
        return logp, ent, stats, bad, grads, epi
    return (*((logp, ent) if nan_in_kernels else nan_at_flags(logp, ent, bad)), stats, bad, grads, None)


def run_epilogue(opts, t, epi_args, logp, ent, bad, outs, g_lo=0, g_hi=None):
    """The epilogue kernel on the forward's per-token logp, H and flags (pass 2 over completions [g_lo,
    g_hi): a fused tile's own; default the call's), writing `outs`; the rollout weights as the kernel reads
    them (per completion (B,), else per token (N,), or None: flags' RW)."""
    x = t.extras
    floats, flags = epi_args
    rw = x.rollout_w_seq if x.rollout_w_seq is not None else x.rollout_w
    loss_ops.epilogue(logp, ent, bad, x.mask, x.cu, x.adv_given, x.old, x.ref, x.lam, x.n_conf, x.num_items,
                      list(floats), list(flags), opts.B, x.rollout_logps, outs, g_lo, g_hi, rw=rw, hp=x.hp,
                      draws=x.draws)


def tile_coefficients(opts, t, k, idx, logp, ent, totals, ones):
    """c, e of the tile's tokens: the surrogate on the tile alone (its completions g0..g1, whole or with
    token-local coefficients), normalized by the batch-wide counts."""
    g = slice(k.g0, k.g1 + 1)
    x = t.extras
    sl = lambda v, i: None if v is None else v[i]  # noqa: E731
    n = idx.numel()
    sub = Batch(logits3=None, ids_=t.ids[idx], counted_=ones[:n],
                seg_=t.seg[idx] - k.g0, B=k.g1 + 1 - k.g0, logits_start=0, tok_shape=(n,), adv_=sl(x.adv, g),
                old=sl(x.old, idx), ref=sl(x.ref, idx), lam=sl(x.lam, idx), n_conf=sl(x.n_conf, g),
                rollout_w_=sl(x.rollout_w, idx), rollout_w_seq=sl(x.rollout_w_seq, g),
                rollout_logps=sl(x.rollout_logps, idx), max_len_=x.max_len)
    counts, M = totals
    if sub.n_conf is None and opts.cfg.loss_agg == "gtpo-official":  # n_conf = 1 for the tile's completions
        sub.n_conf = torch.ones_like(counts[g])
    res = loss.run_surrogate(sub, opts.cfg, logp, ent, x.num_items, counts.dtype, totals=(counts[g], M, opts.B))
    return res["c"], res["e"]
