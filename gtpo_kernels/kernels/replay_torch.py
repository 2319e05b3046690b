"""Replay over the kept sets in plain PyTorch (the CPU path and the Triton kernel's twin).

Token m (0..M-1, the counted tokens) is predicted by logits row (rows_b[m], rows_t[m]) of `logits3`
(B, T_l, V); its kept set K_m is token_ids[offsets[m]:offsets[m+1]] (spec 13's compressed layout). Only
the K = offsets[-1] kept logits are gathered (memory and bytes proportional to the kept sets, never to V):

    s_v = z'_v / tau_m,  v in K_m        m_K = max_K z'          d_v = (z'_v - m_K) / tau_m <= 0
    R = sum_{v in K_m} e^{d_v} - 1 (one instance of the maximum left out), S = 1 + R, log S = log1p(R)
    logp = d_y - log S,   H = log S - (sum e^{d_v} d_v) / S,   q = 1 - p_y = (sum_{v != y} e^{d_v}) / S

with z' the logit after scale and soft-cap. Backward (the set held fixed), per kept v, with
c = dL/dlogp and e = dL/dH of the token:

    dL/ds_v = c ([v = y] - p_v) - e p_v (log p_v + H)     (at y: c q - e p_y (log p_y + H))
    dL/dz_v = dL/ds_v / tau_m * dz'/dz

written into a zero-initialized gradient at the kept positions only: exactly 0 outside the sets.
"""
from __future__ import annotations

import torch

from ..core.flags import BAD_ID, tau_or_nan
from ..core.layout import float_dtype_for
from ..core.sampling import segment_of
from .vocab_torch import _LOG_ZERO, _transform, _transform_grad, row_flags


def _segsum(x, seg, M):
    """Each set's sum of x, a float summed in float64 and rounded once (index_add_ adds a set's entries one
    by one: in float32 a set of ~150k entries, a top-p set over a large vocabulary, would lose ~1e-5)."""
    wide = torch.float64 if x.dtype.is_floating_point else x.dtype
    return torch.zeros(M, dtype=wide, device=x.device).index_add_(0, seg, x.to(wide)).to(x.dtype)


def _gather(logits3, rows_b, rows_t, token_ids, offsets, acc, scale, softcap):
    """(seg, ok, idc, z') of the K kept entries: the token of each, whether its id lies in [0, V), the
    clamped id and the transformed logit (NaN where the id is out of range)."""
    V = logits3.shape[-1]
    seg = segment_of(offsets, token_ids.numel())
    ok = (token_ids >= 0) & (token_ids < V)
    idc = token_ids.clamp(0, V - 1)
    z = _transform(logits3[rows_b[seg], rows_t[seg], idc].to(acc), scale, softcap)
    return seg, ok, idc, torch.where(ok, z, torch.full_like(z, float("nan")))


def replay_fwd(logits3, rows_b, rows_t, y, tau, token_ids, offsets, scale=1.0, softcap=None):
    """Per token over its kept set: logp (M,), entropy (M,), stats (M, 3) = (m_K, log S, q) for the
    backward, and int8 flags (core/flags: a NaN or +inf kept logit; the target's logit -inf; an id out of
    range or the target not once in the set). tau: a number or an (M,) tensor."""
    M = y.numel()
    acc = float_dtype_for(logits3)
    dev = logits3.device
    tau = tau_or_nan(torch.as_tensor(tau, dtype=acc, device=dev)).expand(M)
    seg, ok, idc, z = _gather(logits3, rows_b, rows_t, token_ids, offsets, acc, scale, softcap)
    inv = (1.0 / tau)[seg]
    bad_e = torch.isnan(z) | (z == float("inf"))
    nonfinite = _segsum(bad_e.to(torch.int32), seg, M) > 0
    bad_id = _segsum((~ok).to(torch.int32), seg, M) > 0
    hit = token_ids == y.long()[seg]
    found = _segsum(hit.to(torch.int32), seg, M)
    z_y = _segsum(torch.where(hit, z, torch.zeros_like(z)), seg, M)
    zf = torch.where(bad_e, torch.full_like(z, float("-inf")), z)
    m = torch.full((M,), float("-inf"), dtype=acc, device=dev).scatter_reduce_(0, seg, zf, "amax")
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    d = ((zf - m_safe[seg]) * inv).clamp_(min=_LOG_ZERO)
    ex = torch.where(zf == float("-inf"), torch.zeros_like(d), torch.exp(d))
    top = (zf == m[seg]) & (zf > float("-inf"))
    r = _segsum(torch.where(top, torch.zeros_like(ex), ex), seg, M) + _segsum(top.to(acc), seg, M) - 1.0
    s_tot = 1.0 + r
    log_s = torch.log1p(r)
    ent = log_s - _segsum(ex * d, seg, M) / s_tot
    logp = (z_y - m_safe) * (1.0 / tau) - log_s
    q = _segsum(torch.where(hit, torch.zeros_like(ex), ex), seg, M) / s_tot
    flags = row_flags(nonfinite | torch.isnan(tau), z_y)  # (a NaN 1 / tau: tau_or_nan)
    flags |= (bad_id | (found != 1)).to(torch.int8) * BAD_ID
    return logp, ent, torch.stack([m_safe, log_s, q], 1), flags


def replay_bwd(logits3, grad3, rows_b, rows_t, y, tau, token_ids, offsets, stats, ent, c, e,
               scale=1.0, softcap=None):
    """Adds dL/dz of the raw logits at the kept positions into grad3 (zero-initialized by the caller,
    the logits' shape); tokens with c = e = 0 write zeros. e may be None (no entropy term)."""
    M = y.numel()
    acc = stats.dtype
    tau = torch.as_tensor(tau, dtype=acc, device=logits3.device).expand(M)
    V = logits3.shape[-1]
    seg = segment_of(offsets, token_ids.numel())
    ok = (token_ids >= 0) & (token_ids < V)
    idc = token_ids.clamp(0, V - 1)
    b, t = rows_b[seg], rows_t[seg]
    zt, dz = _transform_grad(logits3[b, t, idc].to(acc), scale, softcap)  # exact where the cap saturates
    st = stats[seg]
    inv = (1.0 / tau)[seg]
    logq = ((zt - st[:, 0]) * inv - st[:, 1]).clamp_(min=_LOG_ZERO)
    p = torch.exp(logq)
    cc = c.to(acc)[seg]
    hit = token_ids == y.long()[seg]
    if e is not None:
        t_e = e.to(acc)[seg] * (logq + ent.to(acc)[seg])
        g = torch.where(hit, cc * st[:, 2] - p * t_e, -p * (cc + t_e))
        active = (c != 0) | (e != 0)
    else:
        g = torch.where(hit, cc * st[:, 2], -p * cc)
        active = c != 0
    g = g * inv * dz
    g = torch.where(active[seg] & ok, g, torch.zeros_like(g))
    grad3.index_put_((b, t, idc), g.to(grad3.dtype), accumulate=True)
    # a NaN coefficient (an invalid token, unvalidated) makes its row NaN at its sampled id, whatever its set
    # holds (an empty or malformed one adds nothing above); 0 is added elsewhere
    nan = torch.isnan(c) if e is None else torch.isnan(c) | torch.isnan(e)
    yl = y.long()
    nan = nan & (yl >= 0) & (yl < V)
    if V:  # (no column: an LM head's empty union, its tokens' dL/dh made NaN by the head)
        grad3.index_put_((rows_b, rows_t, yl.clamp(0, V - 1)),
                         torch.where(nan, float("nan"), 0.0).to(grad3.dtype), accumulate=True)
    return grad3
