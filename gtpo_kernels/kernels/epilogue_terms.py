"""The per-token and per-block terms of the epilogue kernel (epilogue_triton.py), as Triton functions:
the span of a completion, the counted mask, a block's loss terms before the aggregation weights
(surrogate.py; its policy term: epilogue_policy._policy), the rollout weights, the off-policy mask's sums,
and validation's input checks."""
from __future__ import annotations

import triton
import triton.language as tl

from .epilogue_policy import _policy


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
def _token_adv(adv_ptr, o, inb, m, malformed):
    """TOK_ADV: each token's own advantage from adv_ptr in place of Ahat, as the eager surrogate's token_adv: 0
    where not counted, NaN where not finite or cu_seqlens is malformed. Callers call it only under TOK_ADV
    (`... if TOK_ADV else a_hat`): each call of a jit helper costs Triton's interpreter, per block of every
    completion, in every test on the CPU."""
    a = _finite_or_nan(tl.load(adv_ptr + o, mask=inb, other=0.0).to(tl.float32))
    return tl.where(m, tl.where(malformed != 0, float("nan"), a), 0.0)


@triton.jit
def _terms(o, inb, m, a_hat, lr_seq, logp_out, ent_out, old_ptr, ref_ptr, lam_ptr, pmult, emult, sel,
           lo, hi, delta, dual_c, beta, ent_coef, sapo_pos, sapo_neg, dro_beta, kl_coef, kl_p, kl_e,
           BLOCK: tl.constexpr,
           HAS_OLD: tl.constexpr, HAS_KL: tl.constexpr, BIAS_KL: tl.constexpr, HAS_LAM: tl.constexpr,
           HAS_E: tl.constexpr, SEQ: tl.constexpr, CLIP: tl.constexpr, HAS_DELTA: tl.constexpr,
           HAS_DUAL: tl.constexpr, POLICY: tl.constexpr):
    """Per token of a block: (loss_tok, d_logp, d_logr, clipped, lam) before the aggregation weights;
    pmult: the policy term's multiplier after lam (_policy_weight: the off-policy mask, the top-entropy mask, the
    rollout weight); emult: the entropy bonus' (the top-entropy mask, 1 without it); sel: clip_cov's and
    kl_cov's chosen tokens (epilogue_cov._cov_sel); kl_p, kl_e: the completion's epilogue_geo._kl_pivot."""
    lp = tl.load(logp_out + o, mask=inb, other=0.0)
    en = tl.load(ent_out + o, mask=inb, other=0.0)
    if SEQ:  # (ppo only: `old` unused)
        log_r = lp * 0.0 + lr_seq
        old = lp
    else:
        old, log_r = _token_log_r(o, inb, m, lp, old_ptr, HAS_OLD)
    r = tl.exp(log_r)
    pg, d_logr, d_logp, clipped = _policy(r, log_r, lp, old, a_hat, lo, hi, delta, dual_c, sapo_pos, sapo_neg,
                                          dro_beta, lr_seq, sel, kl_coef, POLICY, CLIP, HAS_DELTA, HAS_DUAL)
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
        if BIAS_KL:  # k3 r, as surrogate.kl_term: e^(d + log r) - (d + 1) r where k3 overflows
            kr = tl.where(k3 < float("inf"), k3 * r, tl.exp(d + log_r) - (d + 1.0) * r)
            kl = tl.where(beta != 0.0, beta * kr, 0.0)
            loss_tok = loss_tok + kl
            if SEQ and POLICY != 8:  # R's derivative spread here: R (mean e^d - e^d_t - mean d), epilogue_geo._kl_pivot
                a = ref.to(tl.float64) - lp.to(tl.float64) - kl_p
                g_kl = kl_e - _r_expm1(a, kl_p + log_r.to(tl.float64)) - kl_p.to(tl.float32) * r
                d_logp = d_logp + tl.where(beta != 0.0, beta * g_kl, 0.0)
            else:  # the token's own ratio (geo_mean's d_logr is d / d log R): -r d, as surrogate.kl_term
                d_logp = d_logp + tl.where(beta != 0.0, -beta * d * r, 0.0)
        else:
            loss_tok = loss_tok + tl.where(beta != 0.0, beta * k3, 0.0)
            d_logp = d_logp + tl.where(beta != 0.0, beta * dk3, 0.0)
    if HAS_E:
        loss_tok = loss_tok + (-ent_coef * emult) * en
    loss_tok = tl.where(m, loss_tok, 0.0)
    return loss_tok, d_logp, d_logr, clipped, lam


@triton.jit
def _r_expm1(x, lg):
    """R e^P expm1(x) (lg = P + log R, x = d - P, both float64) in float32 with no e^P or e^x alone: the product
    for x <= 80, e^(lg + x) - e^lg past it (surrogate.kl_term's twin), so a completion of tiny R and a token far
    above its mean d overflow nothing the true value does not."""
    e_l = tl.exp(lg.to(tl.float32))
    xf = x.to(tl.float32)
    return tl.where(xf <= 80.0, e_l * _expm1(tl.minimum(xf, 80.0)), tl.exp((lg + x).to(tl.float32)) - e_l)


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


@triton.jit
def _denom(nconf_ptr, i, n_safe, Bf, M_safe, ni, max_len, AGG: tl.constexpr, NITEMS: tl.constexpr,
           HAS_NCONF: tl.constexpr):
    """Completion i's aggregation denominator (surrogate.aggregation_weights, epilogue_triton.AGGS): B n_i,
    the counted tokens M or num_items_in_batch, B, B max_len, n_i n_conf_i (NaN unless finite and >= 1), 1."""
    if AGG == 0:
        denom = Bf * n_safe
    elif AGG == 1:
        if NITEMS == 0:
            denom = M_safe
        else:
            denom = ni * 1.0
    elif AGG == 2:
        denom = Bf
    elif AGG == 3:
        denom = Bf * max_len
    elif AGG == 4:
        if HAS_NCONF:
            nc = tl.load(nconf_ptr + i).to(tl.float32)
            nc = tl.where((tl.abs(nc) < float("inf")) & (nc >= 1.0), nc, float("nan"))
        else:
            nc = 1.0
        denom = n_safe * nc
    else:
        denom = 1.0
    return denom


@triton.jit
def _roll_add(lp, roll_ptr, o, inb, m, sums, abs_d, max_d, outside, nans, oks):
    """Spec 14's per-lane sums over a block (objective/mismatch.py): d = logp - rollout logp at the counted
    tokens; k3(d) and |d| summed and |d|'s max where d is not NaN, r = e^d outside [0.9, 1.1], NaN and
    not-NaN counts."""
    d = (lp.to(tl.float64) - tl.load(roll_ptr + o, mask=inb, other=0.0).to(tl.float64)).to(tl.float32)
    isnan = m & (d != d)
    ok = m & (d == d)
    d = tl.where(ok, d, 0.0)
    r = tl.exp(d)
    return (sums + tl.where(ok, _k3(d), 0.0), abs_d + tl.abs(d), tl.maximum(max_d, tl.abs(d)),
            outside + (ok & ((r < 0.9) | (r > 1.1))).to(tl.int32), nans + isnan.to(tl.int32), oks + ok.to(tl.int32))


@triton.jit
def _metrics_store(met_ptr, clip_n, n_kept, conf_n, lam_nan, h_tot, B, Bf, M_safe, HAS_LAM: tl.constexpr, malformed,
                   kept_sums, KEPT: tl.constexpr):
    """metrics[0:4]: clip_frac, filtered_frac, conflict_frac (NaN where a counted lam is), mean_entropy; KEPT,
    [9:12]: mean_kept_size, replay_restored_frac, kept_mass (kept_sums / M); every one NaN where `malformed`
    (an unvalidated malformed cu_seqlens: no completion is known)."""
    poison = tl.where(malformed != 0, float("nan"), 0.0)
    tl.store(met_ptr, clip_n.to(tl.float32) / M_safe + poison)
    tl.store(met_ptr + 1, tl.where(B > 0, (B - n_kept).to(tl.float32) / tl.maximum(Bf, 1.0), 0.0) + poison)
    if HAS_LAM:
        tl.store(met_ptr + 2, conf_n.to(tl.float32) / M_safe + lam_nan + poison)
    else:
        tl.store(met_ptr + 2, poison)
    tl.store(met_ptr + 3, h_tot / M_safe + poison)
    if KEPT:
        tl.store(met_ptr + 9 + tl.arange(0, 4), (kept_sums / M_safe).to(tl.float32) + poison, mask=tl.arange(0, 4) < 3)


@triton.jit
def _roll_store(met_ptr, sums, abs_d, max_d, outside, nans, oks, M_safe):
    """metrics[4:9]: rollout_k3, rollout_abs_diff, rollout_max_abs_diff (over the tokens whose d is not NaN),
    rollout_outside_frac, rollout_nan_frac (over the counted tokens)."""
    n_ok = tl.maximum(tl.sum(oks, axis=0), 1).to(tl.float32)
    tl.store(met_ptr + 4, tl.sum(sums, axis=0) / n_ok)
    tl.store(met_ptr + 5, tl.sum(abs_d, axis=0) / n_ok)
    tl.store(met_ptr + 6, tl.max(max_d, axis=0))
    tl.store(met_ptr + 7, tl.sum(outside, axis=0).to(tl.float32) / n_ok)
    tl.store(met_ptr + 8, tl.sum(nans, axis=0).to(tl.float32) / M_safe)


@triton.jit
def _kept_add(kst_ptr, o, inb, m, bad):
    """A block's sums of the counted tokens' (size, restored, mass) of their kept sets (kst (N, 3)), float64,
    as a (4,) vector (the last 0); NaN where a counted token is flagged (its set means nothing)."""
    col = tl.arange(0, 4)
    x = tl.load(kst_ptr + o[:, None] * 3 + col[None, :], mask=(inb & m)[:, None] & (col < 3)[None, :], other=0.0)
    x = tl.where((inb & m & bad)[:, None] & (col < 3)[None, :], float("nan"), x)
    return tl.sum(x.to(tl.float64), axis=0)
