"""What the two vocabulary kernels share: constants, log1p, and the tile's transforms (spec 11).

The kernels read the raw tile z (the GEMM's output, bias already added) and apply, in registers,

    z' = z * scale                         (HAS_SCALE: scale != 1; skipped otherwise, no instruction)
    z' = cap * tanh(z' / cap)              (HAS_SOFTCAP: Gemma's logit soft-capping, cap > 0)

before everything else (s = z' / tau, spec 1): every statistic refers to z'. The backward recomputes z'
from z and multiplies dL/dz' by dz'/dz = scale * (1 - tanh^2) in registers, so it writes the gradient
of the raw z. tanh from one exp2 (no libdevice: the interpreter, Triton 3.6 / 3.8, NVIDIA and AMD
targets all compile it): with x = |z'| / cap and e = exp(-2 x),

    tanh x = (1 - e) / (1 + e),            1 - tanh^2 x = 4 e / (1 + e)^2

exact for large |x| (e -> 0: tanh = 1, the derivative 4 e, no cancellation; -inf gives -cap and a zero
derivative, +inf gives cap, NaN stays NaN), and below x = 1/4, where 1 - e loses digits, tanh is its
odd Taylor polynomial to x^9 (relative error < 1e-8 there).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..core import flags

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
NEG_SENTINEL = tl.constexpr(-3.4028234663852886e38)  # -FLT_MAX: a lane's maximum before it has seen a finite entry
BIG = tl.constexpr(1.0e30)  # |t| clamp: exp2(-BIG) = 0 and 0 * BIG = 0, where 0 * inf would be NaN
# the per-token flags of core/flags.py, as compile-time constants
BAD_NONFINITE = tl.constexpr(flags.BAD_NONFINITE)
BAD_TARGET_NEG_INF = tl.constexpr(flags.BAD_TARGET_NEG_INF)
BAD_ID = tl.constexpr(flags.BAD_ID)
BAD_RULE = tl.constexpr(flags.BAD_RULE)
TANH_SMALL = tl.constexpr(0.25)  # below: the Taylor polynomial; above: (1 - e) / (1 + e)
# tl.sum's, tl.max's and tl.min's own reductions, called directly on operands of 32 or 64 bits (which those
# would not promote: the same code compiled); Triton's interpreter then runs them without a jit wrapper's call,
# which it pays for on every block of every row
_SUM, _MAX, _MIN = tl.standard._sum_combine, tl.standard._elementwise_max, tl.standard._elementwise_min


@triton.jit
def _log1p(x):
    # log(1 + x) accurate for small x (Goldberg's trick: the rounding of 1 + x cancels)
    u = 1.0 + x
    exact = u == 1.0
    return tl.where(exact, x, tl.log(u) * (x / tl.where(exact, 1.0, u - 1.0)))


@triton.jit
def _softcap(z, cap, inv_cap):
    """(cap * tanh(z / cap), 1 - tanh^2(z / cap)) in float32; see the module docstring."""
    x = z * inv_cap
    ax = tl.abs(x)
    e = tl.exp2(ax * (-2.0 * LOG2E))  # e^{-2|x|}: 0 at |x| = inf, NaN for NaN
    r = 1.0 / (1.0 + e)
    x2 = ax * ax
    poly = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * 0.021869488536155203))))
    th = tl.where(ax < TANH_SMALL, poly, (1.0 - e) * r)
    th = tl.where(x < 0.0, -th, th)
    return cap * th, 4.0 * e * (r * r)


@triton.jit
def _transform(z, scale, cap, inv_cap, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """z' of the raw float32 tile z (the forward: the derivative is not needed)."""
    if HAS_SCALE:
        z = z * scale
    if HAS_SOFTCAP:
        z, _d = _softcap(z, cap, inv_cap)
    return z


@triton.jit
def _transform_grad(z, scale, cap, inv_cap, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """(z', dz'/dz) of the raw float32 tile z; dz'/dz is 1.0 (a constant) without transforms."""
    d = 1.0
    if HAS_SCALE:
        z = z * scale
        d = scale
    if HAS_SOFTCAP:
        z, dc = _softcap(z, cap, inv_cap)
        if HAS_SCALE:
            d = dc * scale
        else:
            d = dc
    return z, d


@triton.jit
def _kept(z, v, inv_temp, t_s, t_id, y):
    """The transformed logits z of entries v with those outside the token's kept set (kept_rule_triton: s_v >
    t_s, or s_v == t_s and v >= t_id, or v == y, with s_v = z_v * (1 / tau)) made -inf; NaN and +inf stay
    (their row is flagged as without a kept set: a +inf that min-p's exp(s - inf) would drop included)."""
    s = z * inv_temp
    inside = (s > t_s) | ((s == t_s) & (v >= t_id)) | (v == y) | ~(tl.abs(z) < float("inf"))
    return tl.where(inside, z, float("-inf"))


@triton.jit
def _inv_tau(tau):
    """1 / tau of a temperature read from memory, NaN where tau is not finite and > 0 or 1 / tau overflows
    (an unvalidated per-token temperature, or a schedule set in place: that token's outputs and gradient
    NaN, never a finite number nor an infinite log-prob)."""
    inv = 1.0 / tl.where((tau > 0) & (tau < float("inf")), tau, float("nan"))
    return tl.where(inv < float("inf"), inv, float("nan"))


@triton.jit
def _inv_cap(softcap, HAS_SOFTCAP: tl.constexpr):
    """1 / cap, once per program (0 when there is no cap: never used then)."""
    if HAS_SOFTCAP:
        inv = 1.0 / softcap
    else:
        inv = 0.0
    return inv


@triton.jit
def _store_token(logp_ptr, ent_ptr, stats_ptr, bad_ptr, tok, logp, ent, m, log_s, q, bad):
    """A forward pass's outputs for token `tok`: logp, H, the statistics (m, log S, q) and the int8 flags."""
    tl.store(logp_ptr + tok, logp)
    tl.store(ent_ptr + tok, ent)
    tl.store(stats_ptr + tok * 3, m)
    tl.store(stats_ptr + tok * 3 + 1, log_s)
    tl.store(stats_ptr + tok * 3 + 2, q)
    tl.store(bad_ptr + tok, bad.to(tl.int8))
