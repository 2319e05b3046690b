"""The forward statistics pass over the vocabulary (Triton); launched by vocab_triton.vocab_fwd.

Layout shared by both kernels (vocab_bwd_triton too). `logits` is viewed as (B, T_l, V) with any row strides and vocabulary
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

z here is the transformed logit z' of vocab_jit (scale, soft-cap, applied on load); m, the flags and the
statistics refer to it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .vocab_jit import (BAD_ID, BAD_NONFINITE, BAD_TARGET_NEG_INF, BIG, LN2, LOG2E, NEG_SENTINEL, _inv_cap,
                        _inv_tau, _log1p, _store_token, _transform)


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


@triton.jit(do_not_specialize=["T", "logits_start", "temp_stride"])
def _vocab_fwd_kernel(
    # pointers
    logits_ptr, ids_ptr, mask_ptr,  # inputs: (B, T_l, V) strided rows; (B*T,) ids; (B*T,) counted flag
    logp_ptr, ent_ptr, stats_ptr, bad_ptr,  # outputs: (B*T,), (B*T,), (B*T, 3) = (m, log S, q), (B*T,)
    # strides (elements)
    stride_lb, stride_lt,
    # sizes
    T, V, logits_start,
    # scalars
    temp_ptr, temp_stride,  # tau of token k at temp_ptr + k * temp_stride (0: one tau for every row), float32
    # in device memory, read here, never on the host
    scale, softcap,  # the tile's transforms (vocab_jit): runtime floats, used only under HAS_*
    # meta
    HAS_SCALE: tl.constexpr,  # scale != 1
    HAS_SOFTCAP: tl.constexpr,  # a soft-cap is given
    BLOCK_V: tl.constexpr,
    HAS_MASK: tl.constexpr = True,  # False: every token counts (mask_ptr is not read)
    TEMP_BY_VALUE: tl.constexpr = False,  # True: temp_ptr is tau itself, a float argument (no memory read)
    NAN_FLAGGED: tl.constexpr = False,  # True: a flagged token's logp and H are stored as NaN (token_logprobs)
):
    tok = tl.program_id(0).to(tl.int64)  # int64: B*T*V passes 2**31 at real sizes
    if TEMP_BY_VALUE:
        inv_temp = 1.0 / temp_ptr
    else:
        inv_temp = _inv_tau(tl.load(temp_ptr + tok * temp_stride))
    inv_cap = _inv_cap(softcap, HAS_SOFTCAP)
    if HAS_MASK:  # the caller's mask as given, any dtype: nonzero counts
        counted = tl.load(mask_ptr + tok) != 0
    else:
        counted = True
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
            z0 = _transform(tl.load(row + v0 + lanes).to(tl.float32), scale, softcap, inv_cap, HAS_SCALE,
                            HAS_SOFTCAP)
            z1 = _transform(tl.load(row + v0 + HALF + lanes).to(tl.float32), scale, softcap, inv_cap, HAS_SCALE,
                            HAS_SOFTCAP)
            m_l, r_l, u_l = _fwd_update(z0, m_l, r_l, u_l, c2)
            m_l, r_l, u_l = _fwd_update(z1, m_l, r_l, u_l, c2)
        if v_full < V:  # the partial last block
            offs = v_full + lanes
            # the entries past V are -inf after the transform too (a soft-cap would make them -cap)
            z0 = tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            z1 = tl.load(row + offs + HALF, mask=offs + HALF < V, other=float("-inf")).to(tl.float32)
            z0 = tl.where(offs < V, _transform(z0, scale, softcap, inv_cap, HAS_SCALE, HAS_SOFTCAP), float("-inf"))
            z1 = tl.where(offs + HALF < V, _transform(z1, scale, softcap, inv_cap, HAS_SCALE, HAS_SOFTCAP),
                          float("-inf"))
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
        z_y = _transform(z_y, scale, softcap, inv_cap, HAS_SCALE, HAS_SOFTCAP)
        logp = (z_y - m_safe) * inv_temp - log_s
        top = z_y == m
        q = tl.where(top, r_tot / s_tot, 1.0 - tl.exp(tl.where(top, 0.0, logp)))
        # flags (core/flags.py): a non-finite row (a NaN entry makes R NaN; +inf is the maximum), the
        # target logit -inf, the id outside [0, V)
        bad = tl.where((r_raw != r_raw) | (m == float("inf")), BAD_NONFINITE, 0)
        bad = tl.where(z_y == float("-inf"), bad | BAD_TARGET_NEG_INF, bad)
        bad = tl.where(y_ok, bad, bad | BAD_ID)
        m = m_safe
    if NAN_FLAGGED:
        logp = tl.where(bad != 0, float("nan"), logp)
        ent = tl.where(bad != 0, float("nan"), ent)
    _store_token(logp_ptr, ent_ptr, stats_ptr, bad_ptr, tok, logp, ent, m, log_s, q, bad)

