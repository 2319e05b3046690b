"""The fused LM head (spec 11): GTPO from hidden states and the LM head, never the whole logits.

Only counted tokens are projected, a tile of tokens at a time, into a buffer of at most `memory_budget`
bytes (torch matmul: cuBLAS on CUDA); the vocabulary passes (vocab_triton / vocab_torch) run on each
tile. Two schedules:

    fused      the gradient is formed in the forward, tile by tile, when the tile's coefficients c, e
               (surrogate.py) depend on the tile alone: 3 GEMMs per tile (projection, dL/dhidden,
               dL/dweight), nothing tile-sized kept; the backward only scales them by the upstream
               gradient (a scalar loss).
    recompute  the forward keeps O(1) numbers per token; the backward projects each tile again:
               4 GEMMs per tile.

Weight and bias gradients accumulate across tiles in float32 and are cast once.
"""
from __future__ import annotations

import torch

import types

from ..core.checks import raise_on_flags
from ..distributed import vocab_parallel as parallel
from ..kernels import dispatch
from ..objective.surrogate import surrogate

DEFAULT_MEMORY_BUDGET = 1 << 30  # bytes for one tile of logits and its gradient


class Head:
    """The LM head: logits z = softcap((hidden @ weight.T + bias) * logit_scale), and its chain rule."""

    def __init__(self, weight, bias, logit_scale, logit_softcap):
        self.weight, self.bias = weight, bias
        self.scale, self.cap = float(logit_scale), (None if logit_softcap is None else float(logit_softcap))

    def project(self, h):
        z = h @ self.weight.t()
        if self.bias is not None:
            z += self.bias
        if self.scale != 1.0:
            z *= self.scale
        if self.cap is not None:
            z = torch.tanh(z.div_(self.cap)).mul_(self.cap)
        return z

    def chain(self, gz, z):
        """d/d(hidden @ weight.T + bias) from d/dz (gz, in place); z: the tile's logits (overwritten)."""
        if self.cap is not None:  # d (c tanh(u / c)) / du = 1 - (z / c)^2
            gz.mul_(z.div_(self.cap).square_().neg_().add_(1.0))
        if self.scale != 1.0:
            gz.mul_(self.scale)
        return gz


def _acc(x):
    """The accumulation dtype of the weight and bias gradients: float32 (float64 for float64 inputs)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _mm_acc(a, b):
    """a @ b accumulated and returned in _acc's dtype (never rounded to a 16-bit dtype per tile)."""
    if a.dtype in (torch.float32, torch.float64):
        return a @ b
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except (RuntimeError, TypeError, NotImplementedError):  # no mixed-precision GEMM here: upcast
        return a.float() @ b.float()


class Plan:
    """What one call needs across its tiles: the batch, config, head, tiles of counted rows."""

    def __init__(self, b, cfg, head, backend, temperature, tiles, rows, num_items, fused, host, vp=None):
        self.b, self.cfg, self.head, self.backend, self.vp = b, cfg, head, backend, vp
        self.kernel_ids = b.ids if vp is None else vp.ids  # vocabulary-parallel: this slice's ids
        self.temperature, self.tiles, self.rows = temperature, tiles, rows
        self.num_items, self.fused, self.host = num_items, fused, host
        self.res = None

    def rows_of(self, hidden, idx):
        """The hidden states of flat tokens idx: hidden is (N, D), or (B, T, D) (any strides: a view of
        the model's output is read in place, never copied whole)."""
        if hidden.dim() == 2:
            return idx
        T = hidden.shape[1]
        return idx // T, idx % T


def tile_bounds(b, rows, V, elem, memory_budget, whole_completions):
    """Tiles as (start, end) ranges of `rows` (the counted flat token indices, sorted). With
    whole_completions, tile boundaries fall between completions where the budget allows; returns
    (tiles, whether every tile holds whole completions)."""
    per_tile = max(1, int(memory_budget) // max(1, 2 * V * elem))  # the tile and its gradient
    n = rows.numel()
    if not whole_completions:
        return [(s, min(n, s + per_tile)) for s in range(0, n, per_tile)], False
    counts = torch.bincount(b.seg[rows], minlength=b.B).tolist()  # counted tokens per completion
    tiles, start, size, whole = [], 0, 0, True
    for c in counts:
        if size and size + c > per_tile:
            tiles.append((start, start + size))
            start, size = start + size, 0
        size += c
        whole = whole and size <= per_tile
    if size:
        tiles.append((start, start + size))
    return tiles, whole


def forward_tiles(plan, hidden, with_grad):
    """Statistics of every counted token (logp, H, stats per token), tile by tile; with the fused
    schedule also the gradients. Returns (logp, ent, stats) flat (N,) / (N, 3)."""
    b, head = plan.b, plan.head
    N, dev = b.counted.numel(), hidden.device
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logp = torch.zeros(N, dtype=acc, device=dev)
    ent, stats = torch.zeros_like(logp), torch.zeros((N, 3), dtype=acc, device=dev)
    nan = torch.full((), float("nan"), dtype=acc, device=dev)
    grads = _zero_grads(plan, hidden) if with_grad else None
    for s, e in plan.tiles:
        idx = plan.rows[s:e]
        h = hidden[plan.rows_of(hidden, idx)]
        z = head.project(h)
        ones = torch.ones(idx.numel(), dtype=torch.bool, device=dev)
        if plan.vp is None:
            lp, en, st, bad = dispatch.vocab_fwd(plan.backend, z.unsqueeze(0), b.ids[idx], ones, plan.temperature, 0)
        else:  # the tile's statistics merged over the vocabulary slices
            tile = types.SimpleNamespace(logits3=z.unsqueeze(0), counted=ones, logits_start=0, V=z.shape[-1],
                                         ids=b.ids[idx])
            lp, en, st, bad = parallel.vp_forward(tile, plan.kernel_ids[idx], plan.temperature, plan.backend,
                                                  plan.vp.group, plan.vp.V)
        if plan.host:
            raise_on_flags(_flags_at(bad, idx, N), b.tok_shape)
        invalid = bad != 0
        logp[idx] = torch.where(invalid, nan, lp.to(acc))
        ent[idx] = torch.where(invalid, nan, en.to(acc))
        stats[idx] = st.to(acc)
        if with_grad:  # the fused schedule: this tile's coefficients depend on this tile alone
            res = run_surrogate(plan, logp, ent)
            _tile_grad(plan, grads, h, z, idx, st, ent[idx], res["c"][idx],
                       None if res["e"] is None else res["e"][idx])
    return logp, ent, stats, grads


def _flags_at(bad, idx, N):
    out = torch.zeros(N, dtype=bad.dtype, device=bad.device)
    out[idx] = bad
    return out


def run_surrogate(plan, logp, ent):
    b = plan.b
    return surrogate(logp, ent, b.counted, b.seg, b.B, b.adv, plan.cfg, old=b.old, ref=b.ref, lam=b.lam,
                     n_conf=b.n_conf, num_items=plan.num_items, max_len=b.max_len, rollout_w=b.rollout_w,
                     rollout_w_seq=b.rollout_w_seq, rollout_logps=b.rollout_logps)


def _zero_grads(plan, hidden):
    head = plan.head
    dh = torch.zeros_like(hidden) if plan.need[0] else None
    acc = _acc(hidden)
    dw = torch.zeros(head.weight.shape, dtype=acc, device=hidden.device) if plan.need[1] else None
    db = torch.zeros(head.weight.shape[0], dtype=acc, device=hidden.device) \
        if plan.need[2] and head.bias is not None else None
    return [dh, dw, db]


def _tile_grad(plan, grads, h, z, idx, st, en, c, e):
    """The gradient pass of one tile (its logits z, overwritten) into the accumulators."""
    head = plan.head
    gz = z if head.cap is None else torch.empty_like(z)  # in place unless the softcap needs z after
    dispatch.vocab_bwd(plan.backend, z.unsqueeze(0), gz.unsqueeze(0), plan.kernel_ids[idx], st, en, c, e,
                       plan.temperature, 0)
    gz = head.chain(gz, z)
    dh, dw, db = grads
    if dh is not None:
        dh[plan.rows_of(dh, idx)] = _mm_acc(gz, head.weight).to(dh.dtype)  # one rounding, at the end
    if dw is not None:
        dw += _mm_acc(gz.t(), h)
    if db is not None:
        db += gz.sum(0, dtype=db.dtype)


class LinearLoss(torch.autograd.Function):
    """(hidden (N, D) or (B, T, D), weight (V, D), bias) -> the loss value; the plan holds the rest."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, plan):
        plan.need = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
        logp, ent, stats, grads = forward_tiles(plan, hidden, with_grad=plan.fused)
        res = plan.res = run_surrogate(plan, logp, ent)
        weighted = res["weight"] * res["loss_tok"]
        value = weighted.reshape(plan.b.tok_shape) if plan.cfg.loss_agg == "none" else \
            weighted.sum(dtype=torch.float64).to(weighted.dtype)
        ctx.plan = plan
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        if plan.fused:
            ctx.grads = grads
        else:
            ctx.save_for_backward(hidden, weight, bias, stats, res["ent"], res["c"],
                                  res["e"] if res["e"] is not None else res["c"])
        return value

    @staticmethod
    def backward(ctx, g):
        plan = ctx.plan
        if plan.fused:  # a scalar loss: the gradient formed in the forward, scaled
            dh, dw, db = ctx.grads
            ctx.grads = None
        else:
            hidden, weight, bias, stats, ent, c, e = ctx.saved_tensors
            e = e if plan.res["e"] is not None else None
            gt = g.reshape(-1).to(c.dtype)
            c = torch.where(c == 0, torch.zeros_like(c), c * gt)
            e = None if e is None else torch.where(e == 0, torch.zeros_like(e), e * gt)
            grads = _zero_grads(plan, hidden)
            for s, t in plan.tiles:
                idx = plan.rows[s:t]
                h = hidden[plan.rows_of(hidden, idx)]
                z = plan.head.project(h)
                _tile_grad(plan, grads, h, z, idx, stats[idx], ent[idx], c[idx], None if e is None else e[idx])
            dh, dw, db = grads
            g = None
        if g is not None:
            gs = g.to(_acc(g) if dw is None else dw.dtype)
            dh = None if dh is None else dh * g.to(dh.dtype)
            dw = None if dw is None else dw * gs
            db = None if db is None else db * gs
        dw = None if dw is None else dw.to(ctx.dtypes[0])
        db = None if db is None else db.to(ctx.dtypes[1])
        return dh, dw, db, None
