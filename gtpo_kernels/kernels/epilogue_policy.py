"""The policy terms of the epilogue kernel (epilogue_triton.py) per token, as Triton functions: the PPO-clip
term (policy.ppo_parts) and the token-level terms of POLICY (epilogue_triton.POLICIES: policy.py's cispo and
sapo, verl_modes' gpg, verl_cispo, dro, dppo tv / kl, geo_mean's and vespo's token terms, clip_cov and
kl_cov on the selection epilogue_cov makes)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _times_adv(x, A):
    """x A, exactly 0 where A = 0 and x = inf (policy.times_adv: a ratio overflowing to inf times a zero advantage;
    a NaN x stays NaN)."""
    return tl.where(x == float("inf"), tl.where(A == 0.0, 0.0, x * A), x * A)


@triton.jit
def _ppo_parts(r, A, lo, hi, delta, dual_c, CLIP: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_DUAL: tl.constexpr):
    """(pg, d pg / d log r, clipped, on_clip, dual) of policy.ppo_parts: on_clip where the minimum takes the
    clipped branch (verl's clip_by_origin, which clip_cov reads), dual where the dual clip capped (int32 0 / 1)."""
    if HAS_DELTA:
        r1 = tl.minimum(r, delta, propagate_nan=tl.PropagateNan.ALL)
        capped = (r > delta).to(tl.int32)
        dr1 = tl.where(r > delta, 0.0, r)
    else:
        r1 = r
        dr1 = r
        capped = (r != r).to(tl.int32) * 0
    u1 = _times_adv(r1, A)
    on_clip = capped * 0
    if CLIP:
        u2 = tl.minimum(tl.maximum(r, lo, propagate_nan=tl.PropagateNan.ALL), hi,
                        propagate_nan=tl.PropagateNan.ALL) * A
        on_clip = (u1 > u2).to(tl.int32)
        outside = (r < lo) | (r > hi)
        d_logr = tl.where(on_clip != 0, tl.where(outside, 0.0, -_times_adv(r, A)), -_times_adv(dr1, A))
        clipped = tl.where(on_clip != 0, outside.to(tl.int32), capped) * (A != 0.0).to(tl.int32)
        pg = -tl.minimum(u1, u2, propagate_nan=tl.PropagateNan.ALL)
    else:
        pg = -u1
        d_logr = -_times_adv(dr1, A)
        clipped = capped * (A != 0.0).to(tl.int32)
    dual = capped * 0
    if HAS_DUAL:
        cap = -A * dual_c
        dual = (pg > cap).to(tl.int32) * (A < 0.0).to(tl.int32)
        pg = tl.where(dual != 0, cap, pg)
        d_logr = tl.where(dual != 0, 0.0, d_logr)
        clipped = tl.maximum(clipped, dual)
    return pg, d_logr, clipped, on_clip, dual  # clipped, on_clip, dual: int32 0 / 1


@triton.jit
def _policy(r, log_r, lp, old, A, lo, hi, delta, dual_c, sapo_pos, sapo_neg, dro_beta, lr_seq, sel, kl_coef,
            POLICY: tl.constexpr, CLIP: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_DUAL: tl.constexpr):
    """(pg, d pg / d log r, d pg / d logp directly, clipped) of the token-level policy term POLICY
    (epilogue_triton.POLICIES), as policy.py / verl_modes.py compute it; r = exp(log_r), lp the token's
    logp, old its old log-prob (logp on-policy). lo, hi: ppo and verl_cispo 1 - eps_low, 1 + eps_high;
    cispo hi = eps_high (the ratio's absolute bound); dppo and geo_mean eps_low, eps_high; lr_seq: geo_mean's
    log R, vespo's phi, the completion's (epilogue_geo); sel: the tokens clip_cov / kl_cov chose (epilogue_cov),
    kl_coef: kl_cov's ppo_kl_coef."""
    zero = tl.zeros_like(lp)
    if POLICY == 0:  # ppo (policy.ppo_parts)
        pg, d_logr, clipped, _, _ = _ppo_parts(r, A, lo, hi, delta, dual_c, CLIP, HAS_DELTA, HAS_DUAL)
        d_logp = tl.zeros_like(lp)
    elif POLICY == 10:  # clip_cov (verl_modes.clip_cov): the PPO term times 0 (value and gradient; NaN stays
        # NaN, as verl's pg * corr) where chosen; clipped: every chosen token (verl's corr == 0) and the dual clip's
        pg, d_logr, _, _, dual = _ppo_parts(r, A, lo, hi, delta, dual_c, CLIP, HAS_DELTA, HAS_DUAL)
        keep = tl.where(sel, 0.0, 1.0)
        pg = pg * keep
        d_logr = d_logr * keep
        d_logp = tl.zeros_like(lp)
        clipped = tl.maximum(sel.to(tl.int32), dual)
    elif POLICY == 11:  # kl_cov (verl_modes.kl_cov): -A r, + ppo_kl_coef |log r| where chosen
        coef = tl.where(sel, kl_coef, 0.0)
        sgn = tl.where(log_r > 0.0, 1.0, tl.where(log_r < 0.0, -1.0, 0.0))
        pg = -_times_adv(r, A) + coef * tl.abs(log_r)
        d_logr = -_times_adv(r, A) + coef * sgn
        d_logp = tl.zeros_like(lp)
        clipped = (r != r).to(tl.int32) * 0
    elif POLICY == 1:  # cispo: -sg(min(r, eps_high)) A logp
        coef = tl.minimum(r, hi, propagate_nan=tl.PropagateNan.ALL)
        pg = -coef * A * lp
        d_logr = tl.zeros_like(lp)
        d_logp = -coef * A
        clipped = (r != r).to(tl.int32) * 0
    elif POLICY == 2:  # sapo: -(4 / tau) sigmoid(tau (r - 1)) A, tau by the sign of A
        tau = tl.where(A > 0.0, sapo_pos + zero, sapo_neg + zero)
        x = tau * (r - 1.0)
        sig = tl.sigmoid(x)
        pg = -(4.0 / tau) * sig * A
        d_logr = -4.0 * tl.where(r == float("inf"), 0.0, sig * tl.sigmoid(-x) * r) * A  # (policy.sapo's slope)
        d_logp = tl.zeros_like(lp)
        clipped = (r != r).to(tl.int32) * 0
    elif POLICY == 3:  # gpg: -A logp
        pg = -A * lp
        d_logr = tl.zeros_like(lp)
        d_logp = -A + zero
        clipped = (r != r).to(tl.int32) * 0
    elif POLICY == 4:  # verl_cispo: -sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp, log r clamped to [-20, 20]
        rc = tl.exp(tl.minimum(tl.maximum(log_r, -20.0, propagate_nan=tl.PropagateNan.ALL), 20.0,
                               propagate_nan=tl.PropagateNan.ALL))
        coef = tl.minimum(tl.maximum(rc, lo, propagate_nan=tl.PropagateNan.ALL), hi, propagate_nan=tl.PropagateNan.ALL)
        pg = -coef * A * lp
        d_logr = tl.zeros_like(lp)
        d_logp = -coef * A
        clipped = (r != r).to(tl.int32) * 0
    elif POLICY == 5:  # dro: -(logp A - dro_beta / 2 (logp - old)^2)
        pg = -(lp * A - 0.5 * dro_beta * log_r * log_r)
        d_logr = dro_beta * log_r
        d_logp = -A + zero
        clipped = (r != r).to(tl.int32) * 0
    elif POLICY == 8:  # geo_mean (verl_modes.geo_mean): -A R, d / d log R; log R moves with the tokens whose
        # y = sgn(A) min(sgn(A) log r, sgn(A) clip(log r, -eps_low, eps_high)) is log r, where A != 0
        sgn = tl.where(A > 0.0, 1.0, tl.where(A < 0.0, -1.0, 0.0)) + zero
        xc = tl.minimum(tl.maximum(log_r, -lo, propagate_nan=tl.PropagateNan.ALL), hi,
                        propagate_nan=tl.PropagateNan.ALL)
        spread = (sgn * log_r <= sgn * xc) & (sgn != 0.0)
        pg = -A * tl.exp(lr_seq) + zero
        d_logr = pg
        d_logp = tl.zeros_like(lp)
        clipped = ((sgn * log_r > sgn * xc) & (sgn != 0.0)).to(tl.int32)  # (NaN: not clipped, as the oracle)
    elif POLICY == 9:  # vespo (policy.vespo): -sg(phi) A logp, phi = lr_seq the completion's (epilogue_geo)
        pg = -lr_seq * A * lp
        d_logr = tl.zeros_like(lp)
        d_logp = -lr_seq * A + zero
        clipped = (r != r).to(tl.int32) * 0
    else:  # dppo tv (6) / kl (7): -A sg(min(r, c)) logp on the tokens inside the binary trust region
        rc = tl.exp(tl.minimum(tl.maximum(log_r, -20.0, propagate_nan=tl.PropagateNan.ALL), 20.0,
                               propagate_nan=tl.PropagateNan.ALL))
        if HAS_DUAL:
            rc = tl.minimum(rc, dual_c, propagate_nan=tl.PropagateNan.ALL)
        p = tl.exp(lp)
        p_old = tl.exp(old)
        if POLICY == 6:
            up_ok = (p - p_old) <= hi
            down_ok = (p - p_old) >= -lo
        else:  # the binary KL between Bernoulli(p_old) and Bernoulli(p), with verl's 1e-8
            kl = p_old * (old - lp) + (1.0 - p_old) * tl.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
            up_ok = (kl <= hi) | (p <= p_old)
            down_ok = (kl <= lo) | (p >= p_old)
        valid = tl.where(A > 0.0, up_ok, down_ok)
        coef = tl.where(valid, rc, 0.0)
        finite = (tl.abs(lp) < float("inf")) & (tl.abs(old) < float("inf"))  # else NaN (verl_modes.dppo)
        coef = tl.where(finite, coef, float("nan"))
        pg = -A * coef * lp
        d_logr = tl.zeros_like(lp)
        d_logp = -A * coef
        clipped = (valid.to(tl.int32) == 0).to(tl.int32) * (A != 0.0).to(tl.int32)
    return pg, d_logr, d_logp, clipped  # clipped: int32 0 / 1
