"""The per-token and per-block terms of the epilogue kernel (epilogue_triton.py), as Triton functions:
the span of a completion, the counted mask, the PPO-clip term (policy.ppo_parts), the other token-level
policy terms (POLICY, epilogue_triton.POLICIES: policy.py's cispo and sapo, verl_modes' gpg, verl_cispo, dro,
dppo tv / kl), a block's loss terms before the aggregation weights (surrogate.py), and validation's input
checks."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _finite_or_nan(x):
    return tl.where(tl.abs(x) < float("inf"), x, float("nan"))


@triton.jit
def _token_log_r(o, inb, m, lp, old_ptr, HAS_OLD: tl.constexpr):
    """(old, log r) of a block's tokens at the token level: the old log-prob where counted (NaN where not
    finite) and logp - old; on-policy old is logp itself (log r 0, NaN at a NaN logp)."""
    if HAS_OLD:
        old = _finite_or_nan(tl.where(m, tl.load(old_ptr + o, mask=inb, other=0.0).to(tl.float32), 0.0))
    else:
        old = lp  # on-policy: the sampling policy is the current one
    return old, lp - old


@triton.jit
def _span(cu_ptr, i, T, PACKED: tl.constexpr):
    """Tokens [start, end) of completion i."""
    if PACKED:
        start = tl.load(cu_ptr + i).to(tl.int64)
        end = tl.load(cu_ptr + i + 1).to(tl.int64)
    else:
        start = (tl.zeros((), tl.int64) + i) * T
        end = start + T
    return start, end


@triton.jit
def _fix_cu(cu_ptr, cu_fix, B, N):
    """The packed form's cu_seqlens as given -> cu_fix, the stand-in the eager code uses (clamped into [0, N],
    non-decreasing, from 0 to N); returns 1 when it was malformed (not from 0 to N, or decreasing), else 0."""
    prev_raw = tl.load(cu_ptr).to(tl.int64)
    malformed = ((prev_raw != 0) | (tl.load(cu_ptr + B).to(tl.int64) != N)).to(tl.int32)
    run = tl.minimum(tl.maximum(prev_raw, 0), N)
    start = tl.zeros((), tl.int64)
    for i in range(B):
        raw = tl.load(cu_ptr + i + 1).to(tl.int64)
        malformed = malformed | (raw < prev_raw).to(tl.int32)
        prev_raw = raw
        run = tl.maximum(run, tl.minimum(tl.maximum(raw, 0), N))
        tl.store(cu_fix + i, start)
        start = tl.where(i + 1 == B, N * 1, run)
    tl.store(cu_fix + B, start * 0 + N)
    return malformed


@triton.jit
def _counted(mask_ptr, o, inb, HAS_MASK: tl.constexpr):
    if HAS_MASK:
        return (tl.load(mask_ptr + o, mask=inb, other=0) != 0) & inb
    return inb


@triton.jit
def _ppo(r, A, lo, hi, delta, dual_c, CLIP: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_DUAL: tl.constexpr):
    """(pg, d pg / d log r, clipped) of policy.ppo_parts."""
    if HAS_DELTA:
        r1 = tl.minimum(r, delta, propagate_nan=tl.PropagateNan.ALL)
        capped = (r > delta).to(tl.int32)
        dr1 = tl.where(r > delta, 0.0, r)
    else:
        r1 = r
        dr1 = r
        capped = (r != r).to(tl.int32) * 0
    u1 = r1 * A
    if CLIP:
        u2 = tl.minimum(tl.maximum(r, lo, propagate_nan=tl.PropagateNan.ALL), hi,
                        propagate_nan=tl.PropagateNan.ALL) * A
        on_clip = u1 > u2
        outside = (r < lo) | (r > hi)
        d_logr = tl.where(on_clip, tl.where(outside, 0.0, -r * A), -dr1 * A)
        clipped = tl.where(on_clip, outside.to(tl.int32), capped) * (A != 0.0).to(tl.int32)
        pg = -tl.minimum(u1, u2, propagate_nan=tl.PropagateNan.ALL)
    else:
        pg = -u1
        d_logr = -dr1 * A
        clipped = capped * (A != 0.0).to(tl.int32)
    if HAS_DUAL:
        cap = -A * dual_c
        dual = ((pg > cap).to(tl.int32) * (A < 0.0).to(tl.int32)) != 0
        pg = tl.where(dual, cap, pg)
        d_logr = tl.where(dual, 0.0, d_logr)
        clipped = tl.maximum(clipped, dual.to(tl.int32))
    return pg, d_logr, clipped  # clipped: int32 0 / 1


@triton.jit
def _policy(r, log_r, lp, old, A, lo, hi, delta, dual_c, sapo_pos, sapo_neg, dro_beta, lr_seq, POLICY: tl.constexpr,
            CLIP: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_DUAL: tl.constexpr):
    """(pg, d pg / d log r, d pg / d logp directly, clipped) of the token-level policy term POLICY
    (epilogue_triton.POLICIES), as policy.py / verl_modes.py compute it; r = exp(log_r), lp the token's
    logp, old its old log-prob (logp on-policy). lo, hi: ppo and verl_cispo 1 - eps_low, 1 + eps_high;
    cispo hi = eps_high (the ratio's absolute bound); dppo and geo_mean eps_low, eps_high; lr_seq: geo_mean's
    log R, vespo's phi, the completion's (epilogue_geo)."""
    zero = tl.zeros_like(lp)
    if POLICY == 0:  # ppo (policy.ppo_parts)
        pg, d_logr, clipped = _ppo(r, A, lo, hi, delta, dual_c, CLIP, HAS_DELTA, HAS_DUAL)
        d_logp = tl.zeros_like(lp)
    elif POLICY == 1:  # cispo: -sg(min(r, eps_high)) A logp
        coef = tl.minimum(r, hi, propagate_nan=tl.PropagateNan.ALL)
        pg = -coef * A * lp
        d_logr = tl.zeros_like(lp)
        d_logp = -coef * A
        clipped = (r != r).to(tl.int32) * 0
    elif POLICY == 2:  # sapo: -(4 / tau) sigmoid(tau (r - 1)) A, tau by the sign of A
        tau = tl.where(A > 0.0, sapo_pos + zero, sapo_neg + zero)
        sig = tl.sigmoid(tau * (r - 1.0))
        pg = -(4.0 / tau) * sig * A
        d_logr = -4.0 * sig * (1.0 - sig) * r * A
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
        clipped = (spread.to(tl.int32) == 0).to(tl.int32) * (A != 0.0).to(tl.int32)
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
        pg = -A * coef * lp
        d_logr = tl.zeros_like(lp)
        d_logp = -A * coef
        clipped = (valid.to(tl.int32) == 0).to(tl.int32) * (A != 0.0).to(tl.int32)
    return pg, d_logr, d_logp, clipped  # clipped: int32 0 / 1


@triton.jit
def _terms(o, inb, m, a_hat, lr_seq, logp_out, ent_out, old_ptr, ref_ptr, lam_ptr, pmult, emult,
           lo, hi, delta, dual_c, beta, ent_coef, sapo_pos, sapo_neg, dro_beta, BLOCK: tl.constexpr,
           HAS_OLD: tl.constexpr, HAS_KL: tl.constexpr, BIAS_KL: tl.constexpr, HAS_LAM: tl.constexpr,
           HAS_E: tl.constexpr, SEQ: tl.constexpr, CLIP: tl.constexpr, HAS_DELTA: tl.constexpr,
           HAS_DUAL: tl.constexpr, POLICY: tl.constexpr):
    """Per token of a block: (loss_tok, d_logp, d_logr, clipped, lam) before the aggregation weights;
    pmult: the policy term's multiplier after lam (_policy_weight: the off-policy mask, the top-entropy mask, the
    rollout weight); emult: the entropy bonus' (the top-entropy mask, 1 without it)."""
    lp = tl.load(logp_out + o, mask=inb, other=0.0)
    en = tl.load(ent_out + o, mask=inb, other=0.0)
    if SEQ:  # (ppo only: `old` unused)
        log_r = lp * 0.0 + lr_seq
        old = lp
    else:
        old, log_r = _token_log_r(o, inb, m, lp, old_ptr, HAS_OLD)
    r = tl.exp(log_r)
    pg, d_logr, d_logp, clipped = _policy(r, log_r, lp, old, a_hat, lo, hi, delta, dual_c, sapo_pos, sapo_neg,
                                          dro_beta, lr_seq, POLICY, CLIP, HAS_DELTA, HAS_DUAL)
    if HAS_LAM:
        lam = tl.where(m, tl.load(lam_ptr + o, mask=inb, other=1.0).to(tl.float32), 1.0)
        mult = _finite_or_nan(lam)
    else:
        lam = tl.full([BLOCK], 1.0, tl.float32)
        mult = tl.full([BLOCK], 1.0, tl.float32)
    mult = mult * pmult  # spec 9's order: lam, the off-policy mask, the rollout weight
    loss_tok = mult * pg
    d_logr = mult * d_logr
    d_logp = mult * d_logp
    if HAS_KL:
        ref = _finite_or_nan(tl.where(m, tl.load(ref_ptr + o, mask=inb, other=0.0).to(tl.float32), 0.0))
        d = ref - lp
        em = _expm1(d)  # surrogate.kl_term: 1 - exp(d) keeps its digits near d = 0
        k3 = em - d
        dk3 = -em
        # (a beta of 0, a schedule's tensor there: no KL term, as the number 0, where k3 overflowed too)
        if BIAS_KL:  # (geo_mean: its d_logr is d / d log R; the KL's ratio is the token's, into d_logp)
            kl = tl.where(beta != 0.0, beta * k3 * r, 0.0)
            loss_tok = loss_tok + kl
            d_logp = d_logp + tl.where(beta != 0.0, beta * dk3 * r, 0.0)
            if POLICY == 8:
                d_logp = d_logp + kl
            else:
                d_logr = d_logr + kl
        else:
            loss_tok = loss_tok + tl.where(beta != 0.0, beta * k3, 0.0)
            d_logp = d_logp + tl.where(beta != 0.0, beta * dk3, 0.0)
    if HAS_E:
        loss_tok = loss_tok + (-ent_coef * emult) * en
    loss_tok = tl.where(m, loss_tok, 0.0)
    return loss_tok, d_logp, d_logr, clipped, lam


@triton.jit
def _expm1(d):
    """exp(d) - 1 without cancellation near d = 0: its Taylor series to d^9 for |d| < 0.5 (truncation below
    1e-9 relative), exp(d) - 1 elsewhere (torch.expm1 in float32 within a few ulps)."""
    s = d * (1.0 / 9.0) + 1.0
    s = s * d * (1.0 / 8.0) + 1.0
    s = s * d * (1.0 / 7.0) + 1.0
    s = s * d * (1.0 / 6.0) + 1.0
    s = s * d * (1.0 / 5.0) + 1.0
    s = s * d * (1.0 / 4.0) + 1.0
    s = s * d * (1.0 / 3.0) + 1.0
    s = s * d * 0.5 + 1.0
    series = s * d
    return tl.where(tl.abs(d) < 0.5, series, tl.exp(d) - 1.0)


@triton.jit
def _invalid_inputs(o, inb, m, mask_ptr, old_ptr, ref_ptr, lam, rw_ptr, MASK_VALUES: tl.constexpr,
                    HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, HAS_LAM: tl.constexpr, RW: tl.constexpr):
    """1 when a token of the block fails an input check of validation: a mask value other than 0 and 1,
    or a non-finite old / ref log-prob or lam, or a per-token rollout weight not finite and >= 0 (RW 1), at a
    counted token."""
    bad = (o < 0).to(tl.int32)  # zeros, of the block's shape
    if MASK_VALUES:
        v = tl.load(mask_ptr + o, mask=inb, other=0)  # in its own dtype: float64's 1 + 1e-12 is not 1
        bad = bad | (inb & (v != 0) & (v != 1)).to(tl.int32)
    if HAS_OLD:
        x = tl.load(old_ptr + o, mask=inb, other=0.0).to(tl.float32)
        bad = bad | (m & ((tl.abs(x) < float("inf")) == 0)).to(tl.int32)
    if HAS_REF:
        x = tl.load(ref_ptr + o, mask=inb, other=0.0).to(tl.float32)
        bad = bad | (m & ((tl.abs(x) < float("inf")) == 0)).to(tl.int32)
    if HAS_LAM:
        bad = bad | (m & ((tl.abs(lam) < float("inf")) == 0)).to(tl.int32)
    if RW == 1:
        bad = bad | (m & (_rollout_ok(tl.load(rw_ptr + o, mask=inb, other=1.0).to(tl.float32)) == 0)).to(tl.int32)
    return tl.max(bad, axis=0)


@triton.jit
def _rollout_ok(w):
    """A rollout weight validation takes: finite and >= 0 (core/batch.py add_extras)."""
    return (w >= 0.0) & (w < float("inf"))


@triton.jit
def _rollout_w(w):
    """A counted rollout weight as the eager path multiplies it (surrogate.surrogate): NaN unless finite and
    >= 0."""
    return tl.where(_rollout_ok(w), w, float("nan"))


@triton.jit
def _off_policy_sum(o, inb, m, lp, old_ptr, roll_ptr, HAS_OLD: tl.constexpr, HAS_ROLL: tl.constexpr):
    """Spec 9's off-policy mask (surrogate.off_policy_keep): the block's sum over counted tokens of
    (sampling logp - logp), in float64, the sampling policy's log-probs rollout_logps when given, else the
    old ones; a NaN difference counts as 0, an infinite one as +-float32 max (torch.nan_to_num). Without
    either the sampling policy is the current one: 0."""
    if HAS_ROLL:
        d = tl.load(roll_ptr + o, mask=inb, other=0.0).to(tl.float32) - lp
    elif HAS_OLD:
        d = _finite_or_nan(tl.load(old_ptr + o, mask=inb, other=0.0).to(tl.float32)) - lp
    else:
        d = lp * 0.0
    big = 3.4028234663852886e38
    d = tl.where(m & (d == d), tl.minimum(tl.maximum(d, -big), big), 0.0)
    return tl.sum(d.to(tl.float64), axis=0)


@triton.jit
def _policy_weight(rw_ptr, o, inb, m, keep_w, BLOCK: tl.constexpr, RW: tl.constexpr):
    """The policy term's multiplier after lam per token of a block: keep_w (the completion's off-policy mask
    0 / 1, times its rollout weight with RW 2), times the token's rollout weight with RW 1."""
    if RW == 1:
        w = tl.where(m, _rollout_w(tl.load(rw_ptr + o, mask=inb, other=1.0).to(tl.float32)), 1.0)
        return keep_w * w
    return tl.full([BLOCK], 1.0, tl.float32) * keep_w


@triton.jit
def _k3(d):
    """exp(d) - 1 - d (spec 14's k3) without cancellation: its Taylor series to d^8 for |d| < 0.5 (relative
    error below 1e-7), exp(d) - 1 - d elsewhere, +inf at d = +inf."""
    s = d * (1.0 / 40320.0) + 1.0 / 5040.0
    s = s * d + 1.0 / 720.0
    s = s * d + 1.0 / 120.0
    s = s * d + 1.0 / 24.0
    s = s * d + 1.0 / 6.0
    s = s * d + 0.5
    series = s * d * d
    direct = tl.where(d == float("inf"), float("inf"), tl.exp(d) - 1.0 - d)
    return tl.where(tl.abs(d) < 0.5, series, direct)
