"""The vocabulary passes in plain PyTorch, a fixed number of rows at a time (the CPU path).

Same contract as `vocab_triton.vocab_fwd` / `vocab_bwd` and the same memory behaviour: only a
chunk of rows is ever upcast to float32, the forward keeps O(1) statistics per token, and the backward
recomputes the softmax from them, writing each chunk of the gradient in place.
"""
from __future__ import annotations

import torch

from ..core.flags import BAD_ID, BAD_NONFINITE, BAD_TARGET_NEG_INF
from ..core.layout import float_dtype_for

# float32 elements upcast at a time (16 MiB): the chunk of rows is CHUNK_ELEMENTS // V rows.
CHUNK_ELEMENTS = 1 << 22


def _rows_per_chunk(V: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(V, 1))


# log p below this is exp-underflow (0) in float32 and float64 alike; clamping -inf there keeps every
# product with p = 0 finite
_LOG_ZERO = -1e4


def _transform(z, scale, softcap):
    """z' of a chunk of raw logits in the accumulation dtype, in place: z * scale, then
    softcap * tanh(z' / softcap) (spec 11; the kernels' vocab_jit does the same in registers)."""
    if scale != 1.0:
        z.mul_(scale)
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    return z


def _transform_grad(z, scale, softcap):
    """(z', dz'/dz) of a chunk of raw logits z (z' in place on z). dz'/dz = scale (1 - tanh^2(x)) with
    x = z * scale / softcap is formed as scale * 4 e / (1 + e)^2, e = exp(-2 |x|), from the raw x: exact
    where the cap saturates (1 - th * th from the rounded th = tanh(x) is 0 there, or a few ulps of 1)."""
    if softcap is None:
        return _transform(z, scale, None), scale
    if scale != 1.0:
        z.mul_(scale)
    x = z.div_(softcap)
    e = torch.exp(x.abs().mul(-2.0))
    dz = e.div(e.add(1.0)).div_(e.add_(1.0)).mul_(4.0 * scale)
    del e
    return x.tanh_().mul_(softcap), dz


def _inv_tau(temperature, idx, dtype):
    """1 / tau as a (rows, 1) column for the token rows `idx`: one value (a number or a one-element
    tensor), or each row's own from a per-token (n,) tensor."""
    if isinstance(temperature, torch.Tensor) and temperature.numel() > 1:
        return (1.0 / temperature[idx].to(dtype))[:, None]
    inv = 1.0 / temperature
    return inv.reshape(1, 1).to(dtype) if isinstance(inv, torch.Tensor) else inv


def vocab_fwd(logits3, ids, counted, temperature, logits_start, scale=1.0, softcap=None):
    """Same contract as vocab_triton.vocab_fwd: logp, entropy, stats (m, log S, q), flags of the
    transformed logits z' (scale, softcap)."""
    B, T_l, V = logits3.shape
    n = ids.numel()
    T = n // B if B else 0
    dev = logits3.device
    acc = float_dtype_for(logits3)  # float32 accumulation, float64 for float64 logits
    logp = torch.zeros(n, device=dev, dtype=acc)
    ent = torch.zeros_like(logp)
    stats = torch.zeros((n, 3), device=dev, dtype=acc)
    bad = torch.zeros(n, device=dev, dtype=torch.int8)
    rows_idx = counted.nonzero().squeeze(1)  # masked-out rows are never read
    if rows_idx.numel() == 0 or V == 0:
        return logp, ent, stats, bad
    bi, ti = rows_idx // T, rows_idx % T + logits_start
    step = _rows_per_chunk(V)
    ninf = float("-inf")
    for k in range(0, rows_idx.numel(), step):
        sl = slice(k, k + step)
        idx = rows_idx[sl]
        inv_t = _inv_tau(temperature, idx, acc)
        # one chunk of rows in the accumulation dtype, and one more for the exponentials; in place after
        z = _transform(logits3[bi[sl], ti[sl]].to(acc), scale, softcap)
        y = ids[idx].long()
        y_ok = (y >= 0) & (y < V)
        yc = y.clamp(0, V - 1)[:, None]
        flag = (torch.isnan(z) | (z == float("inf"))).any(-1).to(torch.int8) * BAD_NONFINITE
        z_y = torch.where(y_ok, z.gather(1, yc).squeeze(1), torch.full_like(y, 0, dtype=acc) + float("nan"))
        flag |= (z_y == ninf).to(torch.int8) * BAD_TARGET_NEG_INF
        flag |= (~y_ok).to(torch.int8) * BAD_ID
        mx, top = z.max(-1, keepdim=True)
        empty = (mx == ninf).squeeze(1)  # every entry -inf: S = 0 (a vocabulary slice may be all banned)
        mx = torch.where(mx == ninf, torch.zeros_like(mx), mx)
        # d = (z - max) / tau: the difference first, so its accuracy does not depend on |z / tau|
        d = z.sub_(mx).mul_(inv_t).clamp_(min=_LOG_ZERO)
        ex = torch.exp(d)
        # R = S without one instance of the maximum: log S = log1p(R) exact for confident rows
        ex.scatter_(1, top, 0.0)
        r = ex.sum(-1)
        ex.scatter_(1, top, 1.0)
        r = torch.where(empty, torch.full_like(r, -1.0), r)
        s_tot = 1.0 + r
        log_s = torch.log1p(r)
        # H = log S - U / S with U = sum e^d d <= 0 (no cancellation)
        c_ent = log_s - d.mul_(ex).sum(-1) / s_tot
        mx1 = mx.squeeze(1)
        c_logp = (z_y - mx1) * (inv_t[:, 0] if isinstance(inv_t, torch.Tensor) else inv_t) - log_s
        # q = 1 - p_y is R / S when y holds the maximum (exact for a confident token), else 1 - p_y
        # with p_y < 1/2
        top_y = z_y == mx1
        c_q = torch.where(top_y, r / s_tot, -torch.expm1(torch.where(top_y, 0.0, c_logp)))
        logp[idx] = c_logp
        ent[idx] = c_ent
        stats[idx] = torch.stack([mx1, log_s, c_q], 1)
        bad[idx] = flag
        del z, d, ex
    return logp, ent, stats, bad


def vocab_bwd(logits3, grad3, ids, stats, ent, c, e, temperature, logits_start, scale=1.0, softcap=None):
    """Same contract as vocab_triton.vocab_bwd: dL/dz of the raw logits, through the transforms."""
    B, T_l, V = logits3.shape
    n = ids.numel()
    T = n // B if B else 0
    # rows outside the completion window, and rows with no gradient, are zeros
    active = c != 0
    if e is not None:
        active = active | (e != 0)
    if grad3.data_ptr() != logits3.data_ptr():
        grad3.zero_()
        zero_rows = None
    else:  # in place: zero what is outside the window and the inactive rows (after reading)
        grad3[:, :logits_start].zero_()
        grad3[:, logits_start + T:].zero_()
        zero_rows = (~active).nonzero().squeeze(1)
    rows_idx = active.nonzero().squeeze(1)
    step = _rows_per_chunk(V)
    for k in range(0, rows_idx.numel(), step):
        idx = rows_idx[k:k + step]
        inv_t = _inv_tau(temperature, idx, stats.dtype)
        bi, ti = idx // T, idx % T + logits_start
        yc = ids[idx].long().clamp(0, V - 1)[:, None]  # an invalid id has c = NaN: a NaN row
        cc = c[idx, None]
        st = stats[idx]
        # log p = (z - m) / tau - log S (clamped where p = 0), p = exp(log p): two chunks, in place
        logq, dz = _transform_grad(logits3[bi, ti].to(stats.dtype), scale, softcap)
        logq.sub_(st[:, 0:1]).mul_(inv_t).sub_(st[:, 1:2]).clamp_(min=_LOG_ZERO)
        p = torch.exp(logq)
        q = st[:, 2:3]
        # g_v = -p_v (c + e (log p_v + H)) for v != y;  g_y = c q - e p_y (log p_y + H)
        if e is not None:
            ee = e[idx, None]
            t = logq.add_(ent[idx, None]).mul_(ee)
            g_y = cc * q - p.gather(1, yc) * t.gather(1, yc)
            g = p.mul_(t.add_(cc)).neg_()
        else:
            g_y = cc * q
            g = p.mul_(-cc)
        # the target entry, where the id lies in this vocabulary (a slice of it under process_group)
        y_ok = (ids[idx] >= 0) & (ids[idx] < V)
        g.scatter_(1, yc, torch.where(y_ok[:, None], g_y, g.gather(1, yc)))
        g.mul_(inv_t)
        if softcap is not None or scale != 1.0:  # the chain rule through the transforms
            g.mul_(dz)
        grad3[bi, ti] = g.to(grad3.dtype)
        del logq, p, g, dz
    if zero_rows is not None and zero_rows.numel():
        grad3[zero_rows // T, zero_rows % T + logits_start] = 0
    return grad3
