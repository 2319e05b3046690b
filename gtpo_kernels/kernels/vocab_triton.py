"""Triton kernels over the vocabulary: the forward statistics pass and the gradient pass.

Layout shared by both kernels. `logits` is viewed as (B, T_l, V) with any row strides and vocabulary
stride 1; token (i, t) of the completions (B, T) is predicted by logits row (i, logits_start + t). The
packed form is the same with B = 1. Per-token tensors (ids, mask, outputs) are contiguous (B*T,).

Forward, per counted token, with s = z / tau over the row (spec section 1):
    lse = log sum_v exp(s_v)        logp = s_y - lse        H = lse - sum_v p_v s_v
in one streaming pass over blocks of the row with no reduction across lanes inside the loop: every lane
(BLOCK_V / 2 of them; lane l takes entries v0 + l and v0 + BLOCK_V / 2 + l of the block at v0, two
coalesced loads) keeps its own running maximum m_l of the raw logits and
its sums over d = (z - m_l) / tau (computed as a difference first, so its accuracy does not depend on the
size of z / tau), with exp(d) = exp2(t), t = (z - m_l) * c2, c2 = log2(e) / tau folded into one scale:
    r_l = (sum e^d) - 1 (one instance of m_l left out, ties inside the lane included),   u_l = sum e^d t <= 0.
One exp2 per element (the pass must stay under the special-function units' rate to stay memory-bound):
x = exp2(-|t|) is e^d when z <= m_l, and the rescale of the lane's sums when z raises m_l (then z itself
contributes 1 and is the instance left out). After the loop, once per row: the row maximum m = max m_l,
the lanes re-based on it with alpha_l = exp2((m_l - m) c2), and
    R = S - 1 = sum alpha_l r_l + sum_{m_l < m} alpha_l + (number of lanes with m_l = m) - 1,
    S = 1 + R,   U = sum alpha_l (u_l + (1 + r_l) (m_l - m) c2) ln 2,
all sums of non-negative (U: non-positive) terms, so nothing cancels and the count of entries tied at the
maximum comes out of the last term instead of being summed every block. Then H = log S - U / S, and
log S = log1p(R): a confident row (p_max ~ 1) keeps its digits, where float32 S - 1 would lose them. For
the target, logp = (z_y - m) / tau - log1p(R), and q = 1 - p_y is R / S when y holds the maximum (the one
case where 1 - p_y cancels), 1 - exp(logp) otherwise (then p_y < 1/2). A lane starts at m_l = -FLT_MAX
(a row whose entries are all -inf has no finite maximum and gives S = 0, as before) and |t| is clamped at
1e30 so that -inf entries give x = 0 and x |t| = 0; the clamp keeps NaN (propagate_nan), so a NaN entry
makes its lane's r_l, hence R and S, NaN; +inf shows as m = +inf. The whole blocks are read without a
mask, the partial last block with one.
Per token, backward gets stats = (m, log S, q): lse = m / tau + log S is never formed, so that
log p_v = (z_v - m) / tau - log S stays exact at any magnitude.

Backward (vector-Jacobian product). With p = softmax(s), log p_v = s_v - lse:
    d logp / dz_v = (1[v=y] - p_v) / tau
    d H / dz_v    = -p_v (log p_v + H) / tau
so for upstream coefficients c = dL/dlogp and e = dL/dH of the token (already multiplied by the
loss's incoming gradient), the kernel writes
    dL/dz_v = ( c (1[v=y] - p_v) - e p_v (log p_v + H) ) / tau
recomputing p from the saved (m, log S) as p_v = exp2((z_v - m) c2 - log2 S). The loop writes every entry
as if off the target, p_v (a + b log2 p_v) with a = -(c + e H) / tau and b = -e ln 2 / tau (b = 0 without
the entropy term), so it has no per-element compare with y; the target entry is written once after the
loop (behind a barrier, so it lands after the loop's store there), from the target logit read before the
loop (with inplace=True the gradient overwrites the logits) and 1 - p_y = q from the forward. Rows with
c = e = 0 (masked out, filtered, lambda = 0, or outside the completion window) are not read, only
written with zeros.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core import flags

# Largest block over the vocabulary, and the warps of a block: the choice of the static model of
# `python -m bench.tune` for all three kernels (bf16, sm_90, V = 151936: memory-bound by the roofline,
# 1.5x the bytes in flight Little's law asks at an H200's bandwidth, then the highest occupancy, then the
# smallest block): 2048 x 4 warps, 16 elements a thread per iteration. Not yet a GPU measurement:
# `bench/gpu_check.sh` times the candidate set on a GPU and records it.
MAX_BLOCK_V = 2048


def block_v_for(V: int) -> int:
    return min(MAX_BLOCK_V, triton.next_power_of_2(max(int(V), 16)))


def num_warps_for(block_v: int) -> int:
    return 4


@triton.jit
def _log1p(x):
    # log(1 + x) accurate for small x (Goldberg's trick: the rounding of 1 + x cancels)
    u = 1.0 + x
    exact = u == 1.0
    return tl.where(exact, x, tl.log(u) * (x / tl.where(exact, 1.0, u - 1.0)))


LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
NEG_SENTINEL = tl.constexpr(-3.4028234663852886e38)  # -FLT_MAX: a lane's maximum before it has seen a finite entry
BIG = tl.constexpr(1.0e30)  # |t| clamp: exp2(-BIG) = 0 and 0 * BIG = 0, where 0 * inf would be NaN
# the per-token flags of core/flags.py, as compile-time constants
BAD_NONFINITE = tl.constexpr(flags.BAD_NONFINITE)
BAD_TARGET_NEG_INF = tl.constexpr(flags.BAD_TARGET_NEG_INF)
BAD_ID = tl.constexpr(flags.BAD_ID)


@triton.jit
def _fwd_update(z, m_l, r_l, u_l, c2):
    """One block of the row into the per-lane state (m_l, r_l, u_l); see _vocab_fwd_kernel."""
    tt = (z - m_l) * c2  # the difference first, then the scale
    # one exp2 per element: e^d below the lane maximum, or the rescale when z raises it; a NaN z stays
    # NaN (and so does the lane's r_l), -inf gives x = 0 and, with the clamp, x * a = 0
    a = tl.minimum(tl.abs(tt), BIG, propagate_nan=tl.PropagateNan.ALL)
    x = tl.exp2(a * -1.0)  # not -a: Triton 3.6 writes that as 0 - a, an instruction (signed zero)
    grew = z > m_l
    k = tl.where(grew, x, 1.0)
    # grew: r = x (r + 1) (the old maximum joins the sum, the new one is left out), u = x (u - (r + 1) a)
    # else: r = r + x, u = u - x a
    r_new = k * r_l + x
    u_l = k * u_l - tl.where(grew, r_new, x) * a
    return tl.maximum(m_l, z), r_new, u_l


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
    temp_ptr,  # the temperature tau: a float32 tensor in device memory, read here, never on the host
    # meta
    BLOCK_V: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)  # int64: B*T*V passes 2**31 at real sizes
    inv_temp = 1.0 / tl.load(temp_ptr)
    counted = tl.load(mask_ptr + tok) != 0
    logp = 0.0
    ent = 0.0
    m = float("-inf")
    log_s = 0.0
    q = 0.0
    bad = 0
    if counted:
        i = tok // T
        t = tok - i * T
        row = logits_ptr + i * stride_lb + (t + logits_start) * stride_lt
        y = tl.load(ids_ptr + tok).to(tl.int64)
        y_ok = (y >= 0) & (y < V)
        c2 = inv_temp * LOG2E  # d / ln 2: exp(d) = exp2((z - m) * c2)
        HALF: tl.constexpr = BLOCK_V // 2
        lanes = tl.arange(0, HALF)
        # per-lane state, no reduction across lanes inside the loop; a lane takes two entries of each block
        # (v0 + l and v0 + HALF + l: two coalesced loads, half the state of one lane per entry): the
        # lane's maximum m_l of the raw logits, r_l = (sum over the lane of e^d) - 1 (one instance of m_l
        # left out), u_l = sum e^d t, with d, t = log2 e * d relative to m_l
        m_l = tl.full([HALF], NEG_SENTINEL, tl.float32)
        r_l = tl.zeros([HALF], tl.float32)
        u_l = tl.zeros([HALF], tl.float32)
        v_full = (V // BLOCK_V) * BLOCK_V
        for v0 in range(0, v_full, BLOCK_V):  # whole blocks: no mask
            z0 = tl.load(row + v0 + lanes).to(tl.float32)
            z1 = tl.load(row + v0 + HALF + lanes).to(tl.float32)
            m_l, r_l, u_l = _fwd_update(z0, m_l, r_l, u_l, c2)
            m_l, r_l, u_l = _fwd_update(z1, m_l, r_l, u_l, c2)
        if v_full < V:  # the partial last block
            offs = v_full + lanes
            z0 = tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            z1 = tl.load(row + offs + HALF, mask=offs + HALF < V, other=float("-inf")).to(tl.float32)
            m_l, r_l, u_l = _fwd_update(z0, m_l, r_l, u_l, c2)
            m_l, r_l, u_l = _fwd_update(z1, m_l, r_l, u_l, c2)
        # once per row: re-base the lanes on the row maximum and reduce
        mx = tl.max(m_l, axis=0)
        empty = mx == NEG_SENTINEL  # no finite entry: every entry -inf (or NaN)
        live = m_l != NEG_SENTINEL
        sh = (m_l - mx) * c2
        alpha = tl.exp2(sh)
        # R = S - 1 without cancellation: the lanes' own sums, the maxima of lanes below the row maximum,
        # and the extra lanes at it (ties across lanes; ties inside a lane are already in r_l)
        r_raw = tl.sum(alpha * r_l, axis=0) + tl.sum(tl.where(live & (m_l < mx), alpha, 0.0), axis=0) \
            + (tl.sum((live & (m_l == mx)).to(tl.float32), axis=0) - 1.0)
        r_tot = tl.where(empty, 0.0 * r_raw, r_raw)  # keeps a NaN
        s_tot = tl.where(empty, 0.0, 1.0 + r_tot)
        u_tot = tl.sum(tl.where(alpha > 0, alpha * (u_l + (1.0 + r_l) * sh), 0.0), axis=0)
        m = tl.where(empty, float("-inf"), mx)
        m_safe = tl.where(empty, 0.0, mx)
        log_s = tl.where(empty, float("-inf"), _log1p(r_tot))  # S = 0: a row (or slice) all at -inf
        ent = log_s - (u_tot * LN2) / s_tot
        z_y = tl.load(row + y, mask=y_ok, other=float("nan")).to(tl.float32)
        logp = (z_y - m_safe) * inv_temp - log_s
        top = z_y == m
        q = tl.where(top, r_tot / s_tot, 1.0 - tl.exp(tl.where(top, 0.0, logp)))
        # flags (core/flags.py): a non-finite row (a NaN entry makes R NaN; +inf is the maximum), the
        # target logit -inf, the id outside [0, V)
        bad = tl.where((r_raw != r_raw) | (m == float("inf")), BAD_NONFINITE, 0)
        bad = tl.where(z_y == float("-inf"), bad | BAD_TARGET_NEG_INF, bad)
        bad = tl.where(y_ok, bad, bad | BAD_ID)
        m = m_safe
    tl.store(logp_ptr + tok, logp)
    tl.store(ent_ptr + tok, ent)
    tl.store(stats_ptr + tok * 3, m)
    tl.store(stats_ptr + tok * 3 + 1, log_s)
    tl.store(stats_ptr + tok * 3 + 2, q)
    tl.store(bad_ptr + tok, bad.to(tl.int8))


@triton.jit
def _bwd_grad(z, m, c2, ls2, a_co, b_co, HAS_E: tl.constexpr):
    """dL/dz_v of one block, every entry as if off the target (the target is rewritten after the loop)."""
    l2 = (z - m) * c2 - ls2  # log2 p_v: the difference first, then the scale
    if HAS_E:
        # clamped: p = 0 either way, and b * l2 stays finite where z = -inf (0 * inf would be NaN)
        l2 = tl.maximum(l2, -16384.0)
        g = tl.exp2(l2) * (a_co + b_co * l2)
    else:
        g = tl.exp2(l2) * a_co
    return g


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
    temp_ptr,  # the temperature tau: a float32 tensor in device memory, read here, never on the host
    # meta
    HAS_E: tl.constexpr,  # entropy term present (entropy_coef != 0)
    BLOCK_V: tl.constexpr,
):
    row_id = tl.program_id(0).to(tl.int64)  # one program per logits row, int64 offsets
    inv_temp = 1.0 / tl.load(temp_ptr)
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
        y_ok = (y >= 0) & (y < V)
        # the target's own logit, read before the loop: with inplace the loop overwrites it
        z_y = tl.load(row + y, mask=y_ok, other=float("-inf")).to(tl.float32)
        c2 = inv_temp * LOG2E
        ls2 = log_s * LOG2E  # log2 p_v = (z_v - m) c2 - ls2
        # dL/dz_v off the target = p_v (a + b log2 p_v): a = -(c + e H) / tau, b = -e ln 2 / tau
        if HAS_E:
            a_co = -(c + e * ent) * inv_temp
            b_co = -(e * LN2) * inv_temp
        else:
            a_co = -c * inv_temp
            b_co = 0.0
        v_full = (V // BLOCK_V) * BLOCK_V
        for v0 in range(0, v_full, BLOCK_V):  # whole blocks: no mask
            z = tl.load(row + v0 + lanes).to(tl.float32)
            g = _bwd_grad(z, m, c2, ls2, a_co, b_co, HAS_E)
            tl.store(grad_row + v0 + lanes, g.to(grad_ptr.dtype.element_ty))
        if v_full < V:  # the partial last block
            offs = v_full + lanes
            in_v = offs < V
            z = tl.load(row + offs, mask=in_v, other=float("-inf")).to(tl.float32)
            g = _bwd_grad(z, m, c2, ls2, a_co, b_co, HAS_E)
            tl.store(grad_row + offs, g.to(grad_ptr.dtype.element_ty), mask=in_v)
        # the target entry, written once: (c (1 - p_y) - e p_y (log p_y + H)) / tau with 1 - p_y = q from
        # the forward. The barrier orders it after every thread's store of its block (which wrote the
        # off-target formula there).
        tl.debug_barrier()
        logq_y = (z_y - m) * inv_temp - log_s
        p_y = tl.exp(logq_y)
        g_y = c * q - e * tl.where(p_y > 0, p_y * (logq_y + ent), 0.0)
        tl.store(grad_row + y, (g_y * inv_temp).to(grad_ptr.dtype.element_ty), mask=y_ok)
    else:
        zero = tl.zeros([BLOCK_V], tl.float32).to(grad_ptr.dtype.element_ty)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + lanes
            tl.store(grad_row + offs, zero, mask=offs < V)


def interpreted() -> bool:
    """True when these kernels were built by Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return type(_vocab_fwd_kernel).__name__ == "InterpretedFunction"


def temperature_tensor(temperature, device):
    """tau as the float32 tensor the kernels read: a float32 tensor already on `device` is passed as it
    is (a trainer's schedule updated in place is seen by a replayed CUDA graph); a number or a tensor
    elsewhere is copied there (a host-to-device copy, never a device-to-host read)."""
    if isinstance(temperature, torch.Tensor):
        if temperature.device == device and temperature.dtype == torch.float32 and temperature.numel() == 1:
            return temperature
        return temperature.detach().to(device=device, dtype=torch.float32).reshape(())
    return torch.full((), float(temperature), dtype=torch.float32, device=device)


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
        T, V, logits_start, temperature_tensor(temperature, dev),
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
        T, T_l, V, logits_start, temperature_tensor(temperature, logits3.device),
        HAS_E=e is not None, BLOCK_V=bv, num_warps=num_warps_for(bv),
    )
    return grad3
