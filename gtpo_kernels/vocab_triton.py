"""Triton kernels over the vocabulary: the forward statistics pass and the gradient pass.

Layout shared by both kernels. `logits` is viewed as (B, T_l, V) with any row strides and vocabulary
stride 1; token (i, t) of the completions (B, T) is predicted by logits row (i, logits_start + t). The
packed form is the same with B = 1. Per-token tensors (ids, mask, outputs) are contiguous (B*T,).

Forward, per counted token, with s = z / tau over the row (spec section 1):
    lse = log sum_v exp(s_v)        logp = s_y - lse        H = lse - sum_v p_v s_v
in one streaming pass over blocks of the row, with a running maximum m of the raw logits (a scalar, one
exp per element: the pass must stay under the special-function units' rate to stay memory-bound) and
per-lane sums over d = (z - m) / tau = s - max s (computed as a difference first, so its accuracy does
not depend on the size of z / tau)
    S = sum e^d,   U = sum e^d d <= 0,   R = S minus one instance of the maximum,
all re-based when m grows. Then H = log S - U / S (no cancellation), and log S = log1p(R): a confident
row (p_max ~ 1) keeps its digits, where float32 S - 1 would lose them. For the target,
logp = (z_y - m) / tau - log1p(R), and q = 1 - p_y is R / S when y holds the maximum (the one case where
1 - p_y cancels), 1 - exp(logp) otherwise (then p_y < 1/2). Non-finite input shows as a NaN S.
Per token, backward gets stats = (m, log S, q): lse = m / tau + log S is never formed, so that
log p_v = (z_v - m) / tau - log S stays exact at any magnitude.

Backward (vector-Jacobian product). With p = softmax(s), log p_v = s_v - lse:
    d logp / dz_v = (1[v=y] - p_v) / tau
    d H / dz_v    = -p_v (log p_v + H) / tau
so for upstream coefficients c = dL/dlogp and e = dL/dH of the token (already multiplied by the
loss's incoming gradient), the kernel writes
    dL/dz_v = ( c (1[v=y] - p_v) - e p_v (log p_v + H) ) / tau
recomputing p from the saved (m, log S) and taking 1 - p_y = q from the forward; rows with c = e = 0
(masked out, filtered, lambda = 0, or outside the completion window) are not read, only written with
zeros.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Largest block over the vocabulary. 4096 fp32 lanes over 8 warps is 16 values a thread per
# accumulator; not yet tuned on a GPU (no device measurement so far, see bench/results/).
MAX_BLOCK_V = 4096


def block_v_for(V: int) -> int:
    return min(MAX_BLOCK_V, triton.next_power_of_2(max(int(V), 16)))


def num_warps_for(block_v: int) -> int:
    return 4 if block_v <= 1024 else 8


@triton.jit
def _log1p(x):
    # log(1 + x) accurate for small x (Goldberg's trick: the rounding of 1 + x cancels)
    u = 1.0 + x
    exact = u == 1.0
    return tl.where(exact, x, tl.log(u) * (x / tl.where(exact, 1.0, u - 1.0)))


@triton.jit(do_not_specialize=["T", "logits_start"])
def _vocab_fwd_kernel(
    # pointers
    logits_ptr, ids_ptr, mask_ptr,  # inputs: (B, T_l, V) strided rows; (B*T,) ids; (B*T,) counted flag
    logp_ptr, ent_ptr, stats_ptr, bad_ptr,  # outputs: (B*T,), (B*T,), (B*T, 3) = (m, log S, q), (B*T,)
    # strides (elements)
    stride_lb, stride_lt,
    # sizes
    T, V, logits_start,
    # scalars
    inv_temp,
    # meta
    BLOCK_V: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)  # int64: B*T*V passes 2**31 at real sizes
    counted = tl.load(mask_ptr + tok) != 0
    logp = 0.0
    ent = 0.0
    m = float("-inf")  # running maximum of the raw logits of the row (scalar)
    log_s = 0.0
    q = 0.0
    bad = 0
    if counted:
        i = tok // T
        t = tok - i * T
        row = logits_ptr + i * stride_lb + (t + logits_start) * stride_lt
        y = tl.load(ids_ptr + tok).to(tl.int64)
        y_ok = (y >= 0) & (y < V)
        lanes = tl.arange(0, BLOCK_V)
        r_x = 0.0  # the part of R that is whole maxima: extra instances of the maximum, re-based
        s_l = tl.zeros([BLOCK_V], tl.float32)  # sum e^d
        u_l = tl.zeros([BLOCK_V], tl.float32)  # sum e^d d
        r_l = tl.zeros([BLOCK_V], tl.float32)  # sum e^d over elements below the maximum
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + lanes
            z = tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            shift = tl.where(m == float("-inf"), 0.0, (m - m_safe) * inv_temp)
            alpha = tl.where(m == float("-inf"), 0.0, tl.exp(shift))
            d = (z - m_safe) * inv_temp  # s - max s: the difference first, then the scale
            e = tl.exp(d)
            u_l = alpha * (u_l + s_l * shift) + e * tl.where(e > 0, d, 0.0)
            s_l = s_l * alpha + e
            r_l = r_l * alpha + tl.where(z < m_new, e, 0.0)
            n_top = tl.sum((z == m_new).to(tl.float32), axis=0)  # entries at the new maximum
            grew = m_new > m
            # a larger maximum: the old one (one instance, weight alpha) joins R; one new instance is
            # left out. Same maximum: every new instance joins R.
            r_x = tl.where(grew, alpha * (r_x + tl.where(m == float("-inf"), 0.0, 1.0)) + n_top - 1.0,
                           r_x + n_top)
            r_x = tl.where(m_new == float("-inf"), 0.0, r_x)
            m = m_new
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        s_tot = tl.sum(s_l, axis=0)
        r_tot = tl.sum(r_l, axis=0) + r_x
        log_s = _log1p(r_tot)
        ent = log_s - tl.sum(u_l, axis=0) / s_tot
        z_y = tl.load(row + y, mask=y_ok, other=float("nan")).to(tl.float32)
        logp = (z_y - m_safe) * inv_temp - log_s
        top = z_y == m
        q = tl.where(top, r_tot / s_tot, 1.0 - tl.exp(tl.where(top, 0.0, logp)))
        # flags, as in checks.BAD_*: 1 non-finite row (a NaN or +inf entry makes S NaN), 2 target
        # logit -inf, 4 id outside [0, V)
        bad = tl.where((s_tot != s_tot) | (m == float("inf")), 1, 0)
        bad = tl.where(z_y == float("-inf"), bad | 2, bad)
        bad = tl.where(y_ok, bad, bad | 4)
        m = m_safe
    tl.store(logp_ptr + tok, logp)
    tl.store(ent_ptr + tok, ent)
    tl.store(stats_ptr + tok * 3, m)
    tl.store(stats_ptr + tok * 3 + 1, log_s)
    tl.store(stats_ptr + tok * 3 + 2, q)
    tl.store(bad_ptr + tok, bad.to(tl.int8))


@triton.jit(do_not_specialize=["T", "T_l", "logits_start"])
def _vocab_bwd_kernel(
    # pointers
    logits_ptr, grad_ptr,  # (B, T_l, V) strided rows; grad may alias logits (inplace)
    ids_ptr, stats_ptr, ent_ptr, c_ptr, e_ptr,  # per token: (B*T,), (B*T, 3) = (m, log S, q), (B*T,) x 3
    # strides (elements)
    stride_lb, stride_lt, stride_gb, stride_gt,
    # sizes
    T, T_l, V, logits_start,
    # scalars
    inv_temp,
    # meta
    HAS_E: tl.constexpr,  # entropy term present (entropy_coef != 0)
    BLOCK_V: tl.constexpr,
):
    row_id = tl.program_id(0).to(tl.int64)  # one program per logits row, int64 offsets
    i = row_id // T_l
    r = row_id - i * T_l
    t = r - logits_start
    in_window = (t >= 0) & (t < T)
    tok = i * T + t
    c = tl.load(c_ptr + tok, mask=in_window, other=0.0)
    if HAS_E:
        e = tl.load(e_ptr + tok, mask=in_window, other=0.0)
    else:
        e = 0.0
    lanes = tl.arange(0, BLOCK_V)
    grad_row = grad_ptr + i * stride_gb + r * stride_gt
    if (c != 0.0) | (e != 0.0):
        row = logits_ptr + i * stride_lb + r * stride_lt
        m = tl.load(stats_ptr + tok * 3)
        log_s = tl.load(stats_ptr + tok * 3 + 1)
        q = tl.load(stats_ptr + tok * 3 + 2)  # 1 - p_y
        ent = tl.load(ent_ptr + tok)
        y = tl.load(ids_ptr + tok).to(tl.int64)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + lanes
            in_v = offs < V
            z = tl.load(row + offs, mask=in_v, other=float("-inf")).to(tl.float32)
            logq = (z - m) * inv_temp - log_s  # log p_v
            p = tl.exp(logq)
            g = tl.where(offs == y, c * q, -c * p)
            if HAS_E:
                g -= e * p * tl.where(p > 0, logq + ent, 0.0)
            tl.store(grad_row + offs, (g * inv_temp).to(grad_ptr.dtype.element_ty), mask=in_v)
    else:
        zero = tl.zeros([BLOCK_V], tl.float32).to(grad_ptr.dtype.element_ty)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + lanes
            tl.store(grad_row + offs, zero, mask=offs < V)


def vocab_fwd(logits3, ids, counted, temperature, logits_start):
    """logits3 (B, T_l, V) with stride(2) == 1; ids (B*T,) int; counted (B*T,) bool.
    Returns float32 logp, entropy (B*T,), stats (B*T, 3) = (row max m, log S, q = 1 - p_y) for the
    backward, and int8 flags (0 = fine)."""
    B, T_l, V = logits3.shape
    n = ids.numel()
    T = n // B if B else 0
    dev = logits3.device
    logp = torch.empty(n, device=dev, dtype=torch.float32)
    ent = torch.empty_like(logp)
    stats = torch.empty((n, 3), device=dev, dtype=torch.float32)
    bad = torch.empty(n, device=dev, dtype=torch.int8)
    if n == 0:
        return logp, ent, stats, bad
    bv = block_v_for(V)
    _vocab_fwd_kernel[(n,)](
        logits3, ids, counted, logp, ent, stats, bad,
        logits3.stride(0), logits3.stride(1),
        T, V, logits_start, 1.0 / temperature,
        BLOCK_V=bv, num_warps=num_warps_for(bv),
    )
    return logp, ent, stats, bad


def vocab_bwd(logits3, grad3, ids, stats, ent, c, e, temperature, logits_start):
    """Writes dL/dlogits into grad3 (B, T_l, V), every row (zeros where no gradient); grad3 may be
    logits3 itself. c, e: float32 (B*T,) coefficients; e may be None (no entropy term)."""
    B, T_l, V = logits3.shape
    n = ids.numel()
    T = n // B if B else 0
    if B * T_l == 0:
        return grad3
    bv = block_v_for(V)
    _vocab_bwd_kernel[(B * T_l,)](
        logits3, grad3, ids, stats, ent, c, c if e is None else e,
        logits3.stride(0), logits3.stride(1), grad3.stride(0), grad3.stride(1),
        T, T_l, V, logits_start, 1.0 / temperature,
        HAS_E=e is not None, BLOCK_V=bv, num_warps=num_warps_for(bv),
    )
    return grad3
