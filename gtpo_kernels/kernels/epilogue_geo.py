"""The per-completion policy terms in the epilogue kernel's pass 1: geo_mean's (verl's GMPO) sums that make
its log R (objective/verl_modes.geo_mean, surrogate.geo_mean_log_w), and vespo's phi (policy.vespo_phi,
surrogate.rollout_log_w). The token terms are epilogue_terms._policy's (POLICY 8, 9); for geo_mean pass 2
spreads d loss / d log R over the tokens the clip did not stop, as the sequence level spreads d loss / d log r;
vespo's phi is a constant weight (no gradient through it). And the sequence level's bias-corrected KL: its
completion's pivot (_kl_pivot), read by pass 2."""
from __future__ import annotations

import triton
import triton.language as tl

from .epilogue_terms import _counted, _finite_or_nan, _r_expm1, _rollout_w, _token_adv, _token_log_r

LOG_1E8 = tl.constexpr(-18.420680743952367)  # log(1e-8): TRL's floor of vespo's L and of a log rollout weight


@triton.jit
def _geo_sums(o, inb, m, lp, old_ptr, rw_ptr, lo, hi, adv_ptr, malformed, HAS_OLD: tl.constexpr, RW: tl.constexpr,
              TOK_ADV: tl.constexpr):
    """A block's float64 sums over its counted tokens of min(log r, xc) and max(log r, xc), xc = clip(log r,
    -eps_low, eps_high) (y for Ahat > 0 and Ahat < 0), and with per-token rollout weights (RW 1) of
    log(w + 1e-10) (NaN for a weight not finite and >= 0); lp: the tokens' logp (NaN where flagged).
    TOK_ADV: the sign is each token's advantage's (adv_ptr), and both sums are of that y (0 where the
    advantage is 0), as verl_modes.geo_mean on token advantages."""
    _, lr = _token_log_r(o, inb, m, lp, old_ptr, HAS_OLD)
    xc = tl.minimum(tl.maximum(lr, -lo, propagate_nan=tl.PropagateNan.ALL), hi, propagate_nan=tl.PropagateNan.ALL)
    y_lo = tl.where(m, tl.minimum(lr, xc, propagate_nan=tl.PropagateNan.ALL), 0.0)
    y_hi = tl.where(m, tl.maximum(lr, xc, propagate_nan=tl.PropagateNan.ALL), 0.0)
    if TOK_ADV:
        a = _token_adv(adv_ptr, o, inb, m, malformed)
        y_lo = tl.where(a > 0.0, y_lo, tl.where(a < 0.0, y_hi, 0.0))  # (a NaN advantage: its own term is NaN)
        y_hi = y_lo
    if RW == 1:
        w = _rollout_w(tl.load(rw_ptr + o, mask=inb, other=1.0).to(tl.float32))
        lw = tl.where(m, tl.log(w + 1e-10), 0.0)
    else:
        lw = tl.zeros_like(lr)
    return (tl.sum(y_lo.to(tl.float64), axis=0), tl.sum(y_hi.to(tl.float64), axis=0),
            tl.sum(lw.to(tl.float64), axis=0))


@triton.jit
def _geo_log_R(sum_lo, sum_hi, sum_w, a_i, rw_ptr, i, n_safe, RW: tl.constexpr, TOK_ADV: tl.constexpr):
    """Completion i's log R: the mean of y (_geo_sums' sum of min or max of log r and its clip, by the sign of
    its Ahat a_i; TOK_ADV: each token's, summed so), plus the log of its rollout weights' geometric mean."""
    if TOK_ADV:
        y = sum_lo.to(tl.float32)
    else:
        y = tl.where(a_i > 0.0, sum_lo, tl.where(a_i < 0.0, sum_hi, sum_lo * 0.0)).to(tl.float32)
    return y / n_safe + _geo_log_w(sum_w, rw_ptr, i, n_safe, RW)


@triton.jit
def _geo_log_w(lw_sum, rw_ptr, i, n_safe, RW: tl.constexpr):
    """Completion i's log of its geometric-mean rollout weight: the mean of log(w + 1e-10) over its counted
    tokens (RW 1: lw_sum, _geo_sums'), log(w_i + 1e-10) per completion (RW 2), else 0."""
    if RW == 1:
        return lw_sum.to(tl.float32) / n_safe
    elif RW == 2:
        return tl.log(_rollout_w(tl.load(rw_ptr + i).to(tl.float32)) + 1e-10)
    return n_safe * 0.0


@triton.jit
def _vespo_sums(o, inb, m, lp, old_ptr, rw_ptr, HAS_OLD: tl.constexpr, RW: tl.constexpr):
    """A block's float64 sums over its counted tokens of clamp(log r, -20, 20) and, with per-token rollout
    weights (RW 1), of clamp(log w, log 1e-8, 20) (NaN for a weight not finite and >= 0)."""
    _, lr = _token_log_r(o, inb, m, lp, old_ptr, HAS_OLD)
    lr = tl.minimum(tl.maximum(lr, -20.0, propagate_nan=tl.PropagateNan.ALL), 20.0, propagate_nan=tl.PropagateNan.ALL)
    l_sum = tl.sum(tl.where(m, lr, 0.0).to(tl.float64), axis=0)
    if RW == 1:
        lw = _clamped_log(_rollout_w(tl.load(rw_ptr + o, mask=inb, other=1.0).to(tl.float32)))
        return l_sum, tl.sum(tl.where(m, lw, 0.0).to(tl.float64), axis=0)
    return l_sum, l_sum * 0.0


@triton.jit
def _clamped_log(w):
    """log(w) clamped to [log 1e-8, 20] (NaN stays NaN), as surrogate.rollout_log_w."""
    return tl.minimum(tl.maximum(tl.log(w), LOG_1E8, propagate_nan=tl.PropagateNan.ALL), 20.0,
                      propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _vespo_phi(l_sum, lw_sum, rw_ptr, i, adv, k_pos, lam_pos, k_neg, lam_neg, RW: tl.constexpr):
    """Completion i's phi: L = clamp(sum clamp(log r) + sum log w, log 1e-8, 20), k and lambda by the sign of
    its advantage (>= 0: the positive pair; lambda at least 1e-4), phi = exp(lambda + k L - lambda e^L) with
    non-finite values 0, NaN where L is NaN (NaN input)."""
    L = l_sum.to(tl.float32)
    if RW == 1:
        L = L + lw_sum.to(tl.float32)
    elif RW == 2:
        L = L + _clamped_log(_rollout_w(tl.load(rw_ptr + i).to(tl.float32)))
    invalid = L != L
    L = tl.minimum(tl.maximum(L, LOG_1E8), 20.0)
    pos = adv >= 0.0
    k = tl.where(pos, k_pos, k_neg)
    lam = tl.maximum(tl.where(pos, lam_pos, lam_neg), 1e-4)
    phi = tl.exp(lam + k * L - lam * tl.exp(L))
    phi = tl.where(tl.abs(phi) < float("inf"), phi, 0.0)
    return tl.where(invalid, float("nan"), phi)


@triton.jit
def _kl_pivot(logp_out, ref_ptr, mask_ptr, start, end, n_safe, lr_seq, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr,
              ON: tl.constexpr):
    """ON (the bias-corrected KL at the sequence level): over the completion's counted tokens, P = mean d (float64)
    and the mean of R e^P expm1(d - P), d = ref - logp, R = e^lr_seq (surrogate.kl_term's seq_mean form: no term of
    size R e^d; d - P from float64, whose error e^P would multiply; epilogue_terms._r_expm1); else 0, 0."""
    p = tl.zeros((), tl.float64)
    e = tl.zeros((), tl.float32)
    if ON:
        lanes = tl.arange(0, BLOCK).to(tl.int64)
        acc = tl.zeros([BLOCK], tl.float64)
        for t0 in range(start, end, BLOCK):
            acc += _kl_d(logp_out, ref_ptr, mask_ptr, t0 + lanes, end, HAS_MASK)
        p = tl.sum(acc, axis=0) / n_safe
        acc_e = tl.zeros([BLOCK], tl.float32)
        for t0 in range(start, end, BLOCK):
            o = t0 + lanes
            acc_e += tl.where(_counted(mask_ptr, o, o < end, HAS_MASK),
                              _r_expm1(_kl_d(logp_out, ref_ptr, mask_ptr, o, end, HAS_MASK) - p,
                                       p + lr_seq.to(tl.float64)), 0.0)
        e = tl.sum(acc_e, axis=0) / n_safe
    return p, e


@triton.jit
def _kl_d(logp_out, ref_ptr, mask_ptr, o, end, HAS_MASK: tl.constexpr):
    """d = ref - logp in float64 (exact) at the counted tokens of a block (0 elsewhere; NaN at a ref not finite)."""
    m = _counted(mask_ptr, o, o < end, HAS_MASK)
    ref = _finite_or_nan(tl.where(m, tl.load(ref_ptr + o, mask=m, other=0.0).to(tl.float32), 0.0))
    return tl.where(m, ref.to(tl.float64) - tl.load(logp_out + o, mask=m, other=0.0).to(tl.float64), 0.0)
