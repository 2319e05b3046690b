"""Everything between the two vocabulary passes: O(tokens), no autograd.

From per-token log-probs and entropies it computes the entropy filter and shaped advantage (spec 2),
the ratio, the policy term of any GRPO-family loss (policy.py), the masks, the KL and entropy terms and
the aggregation weights (spec 4, 9), and the two coefficients the backward pass needs per token:

    loss = sum_k w_k * l_k,      c_k = d loss / d logp_k,      e_k = d loss / d H_k

The token-level ratio depends on its own logp only; the sequence-level one (GSPO) on the mean over the
completion, so d loss / d log r[i] is summed over the completion and spread back as m_k / n_i.
Tokens are flat (N,) with `seg[k]` the completion of token k, which serves the padded form
(seg = k // T) and the packed form alike. Completion entropy Hbar is a constant (no gradient).
"""
from __future__ import annotations

import math

import torch

from ..core.config import is_zero
from . import policy, verl_modes


def seg_sum(x, seg, B):
    """Per-completion sums, accumulated in float64 (a completion may hold 100k+ tokens)."""
    return torch.zeros(B, dtype=torch.float64, device=x.device).index_add_(0, seg, x.double()).to(x.dtype)


def entropy_control(ent, seg, B, n_safe, adv, cfg):
    """Spec 2: Hbar (B,), the filter delta = kept (B,) bool, and Ahat (B,)."""
    seq_ent = seg_sum(ent, seg, B) / n_safe
    kept = torch.ones(B, dtype=torch.bool, device=ent.device)
    if cfg.entropy_threshold is not None:
        kept = seq_ent <= cfg.entropy_threshold
        if cfg.initial_entropy is not None:  # the paper's gate (a tensor comparison when either is one)
            kept = kept | (cfg.initial_entropy > cfg.entropy_threshold)
    pen, shaped = cfg.entropy_penalty, adv
    if not is_zero(pen):
        shaped = adv - pen * seq_ent
        if isinstance(pen, torch.Tensor):  # a schedule at 0 shapes nothing either: a NaN Hbar stays its token's own
            shaped = torch.where(pen == 0, adv, shaped)
    a_hat = torch.where(kept, shaped, shaped * 0)  # a dropped completion: 0, NaN for a non-finite advantage
    return seq_ent, kept, a_hat


def log_ratio(logp, old, m, seg, B, n_safe, level):
    """log r per token: logp - old (on-policy: logp - sg(logp) = 0, NaN at an invalid token); at the
    sequence level the completion's mean, repeated on its tokens."""
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    log_r = logp - (torch.where(m, old.to(logp.dtype), zero) if old is not None else logp)
    if level == "sequence":
        log_r = (seg_sum(torch.where(m, log_r, zero), seg, B) / n_safe)[seg]
    return log_r


def off_policy_keep(logp, sampling, m, seg, B, n_safe, adv, threshold):
    """Spec 9 (DeepSeek-V3.2): completion i keeps its policy term if A >= 0 or its mean
    (sampling logp - logp) <= threshold (NaN differences count as 0). Without old or rollout log-probs
    the sampling policy is the current one (difference 0)."""
    if sampling is None:
        diff = torch.zeros_like(logp)
    else:
        diff = torch.nan_to_num(torch.where(m, sampling.to(logp.dtype) - logp, torch.zeros_like(logp)), nan=0.0)
    return (adv >= 0) | (seg_sum(diff, seg, B) / n_safe <= threshold)


def top_entropy_mask(ent, m, M, rho):
    """Spec 9: counted tokens whose entropy is at least the (1 - rho) quantile of the counted tokens'
    entropies (linear interpolation, as torch.quantile), without a host sync. No counted token: none."""
    if ent.numel() == 0:  # an empty batch (a static shape, no sync): nothing to index
        return m
    q = 1.0 - rho
    key = torch.where(m, ent, torch.full_like(ent, float("inf")))  # uncounted tokens sort last
    srt = key.sort().values
    pos = (M.clamp(min=1) - 1) * (q if not isinstance(q, torch.Tensor) else q.to(ent.dtype))
    lo = pos.floor().long()
    hi = torch.minimum(lo + 1, (M.clamp(min=1) - 1).long())
    v_lo, v_hi = srt.gather(0, lo.reshape(1))[0], srt.gather(0, hi.reshape(1))[0]  # static shapes (compile)
    thr = v_lo + (v_hi - v_lo) * (pos - lo.to(pos.dtype))
    thr = torch.where(v_hi == v_lo, v_lo, thr)  # inf - inf
    keep = (m & (ent >= thr) & (M > 0)).to(ent.dtype)
    # a NaN counted entropy (unvalidated; sorted last) makes the quantile, so every counted token's mask, NaN
    return torch.where(m & torch.isnan(srt[-1]), torch.full_like(keep, float("nan")), keep)


def aggregation_weights(mf, seg, B, n_safe, M_safe, cfg, n_conf, num_items, max_len):
    """Spec 4: w per token (filtered completions still count in the denominators)."""
    agg = cfg.loss_agg
    if agg == "seq-mean-token-mean":
        return mf / (B * n_safe[seg])
    if agg == "token-mean":
        return mf / (M_safe if num_items is None else num_items)
    if agg == "seq-mean-token-sum":
        return mf / B
    if agg == "seq-mean-token-sum-norm":
        return mf / (B * (cfg.max_completion_length or max_len))
    if agg == "gtpo-official":
        nc = torch.ones(B, dtype=mf.dtype, device=mf.device) if n_conf is None else n_conf.to(mf.dtype)
        nc = torch.where(torch.isfinite(nc) & (nc >= 1), nc, float("nan"))  # unvalidated n_conf < 1 or inf: NaN
        return mf / (n_safe * nc)[seg]
    return mf  # "none": per-token loss, the incoming gradient is per token


def finite_or_nan(x):
    """Non-finite values become NaN: unchecked invalid input (validate=False) gives NaN, never a finite
    wrong number (an old log-prob of -inf would otherwise clip to a finite loss)."""
    return torch.where(torch.isfinite(x), x, torch.full((), float("nan"), dtype=x.dtype, device=x.device))


def rollout_log_w(rollout_w, rollout_w_seq, m, seg, B, dt):
    """VESPO's sum_t log(rollout weight) per completion (B,), each log clamped to [log 1e-8, 20] as TRL;
    a per-completion weight enters once."""
    if rollout_w_seq is not None:
        return torch.log(rollout_w_seq.to(dt)).clamp(min=math.log(1e-8), max=20.0)
    if rollout_w is None:
        return None
    lw = torch.log(rollout_w.to(dt)).clamp(min=math.log(1e-8), max=20.0)
    return seg_sum(torch.where(m, lw, torch.zeros_like(lw)), seg, B)


def geo_mean_log_w(rollout_w, rollout_w_seq, m, seg, B, n_safe):
    """GMPO's rollout weight per token: the log of its completion's geometric mean of (w + 1e-10) over the
    counted tokens (as verl), or None."""
    if rollout_w_seq is not None:
        return torch.log(rollout_w_seq + 1e-10)[seg]
    if rollout_w is None:
        return None
    lw = torch.where(m, torch.log(rollout_w + 1e-10), torch.zeros_like(rollout_w))
    return (seg_sum(lw, seg, B) / n_safe)[seg]


def policy_term(logp, log_r, A, adv, m, seg, B, cfg, rollout_w, rollout_w_seq, old, n_safe, M):
    """Spec 4, 9: (pg, d pg / d log r, d pg / d logp, clipped, spread) per token, before the multipliers;
    spread: geo_mean's tokens through which the completion's log R moves (None otherwise)."""
    pl = cfg.policy_loss
    if pl in ("ppo", "cispo", "sapo", "vespo"):
        return (*trl_term(logp, log_r, A, adv, m, seg, B, cfg, rollout_w, rollout_w_seq), None)
    M_safe = M.clamp(min=1)
    if pl == "geo-mean":
        log_w = geo_mean_log_w(rollout_w, rollout_w_seq, m, seg, B, n_safe)
        pg, spread, clipped = verl_modes.geo_mean(A, log_r, m, lambda x: (seg_sum(x, seg, B) / n_safe)[seg],
                                                  log_w, cfg)
        return pg, pg, None, clipped, spread
    if pl == "clip-cov":
        pg, d_logr, _, _, on_clip, dual = policy.ppo_parts(torch.exp(log_r), A, cfg)
        pg, d_logr, clipped = verl_modes.clip_cov(pg, d_logr, dual, on_clip, A, logp, m, M, M_safe, cfg)
        return pg, d_logr, None, clipped, None
    if pl == "kl-cov":
        return (*verl_modes.kl_cov(A, logp, log_r, m, M, M_safe, cfg), None)
    if pl in ("dppo-tv", "dppo-kl"):
        return (*verl_modes.dppo(A, logp, old, log_r, cfg, pl[-2:]), None)
    if pl == "gpg":
        return (*verl_modes.gpg(A, logp), None)
    if pl == "dro":
        return (*verl_modes.dro(A, logp, log_r, cfg), None)
    return (*verl_modes.verl_cispo(A, logp, log_r, cfg), None)


def trl_term(logp, log_r, A, adv, m, seg, B, cfg, rollout_w, rollout_w_seq):
    """TRL's policy terms: ppo, cispo, sapo, vespo."""
    r = torch.exp(log_r)
    if cfg.policy_loss == "ppo":
        return policy.ppo(r, A, cfg)
    if cfg.policy_loss == "cispo":
        return policy.cispo(r, A, logp, cfg)
    if cfg.policy_loss == "sapo":
        return policy.sapo(r, A, cfg)
    log_w = rollout_log_w(rollout_w, rollout_w_seq, m, seg, B, logp.dtype)  # vespo folds them into phi
    phi = policy.vespo_phi(log_r, m, lambda x: seg_sum(x, seg, B), adv, log_w, cfg)
    return policy.vespo(phi[seg], A, logp)


def multipliers(logp, ent, m, seg, B, n_safe, M, adv, cfg, lam, old, rollout_w, rollout_logps):
    """Spec 9's order: lambda, the off-policy mask, the top-entropy mask, the rollout weights (not for
    vespo and geo_mean, which fold them into their term). -> (mult (N,), emask (N,) or None)."""
    dt = logp.dtype
    mult = torch.ones_like(logp) if lam is None else finite_or_nan(lam.to(dt))
    if cfg.off_policy_mask_threshold is not None:
        sampling = rollout_logps if rollout_logps is not None else old
        mult = mult * off_policy_keep(logp, sampling, m, seg, B, n_safe, adv,
                                      cfg.off_policy_mask_threshold)[seg].to(dt)
    emask = None
    if cfg.top_entropy_on:
        emask = top_entropy_mask(ent, m, M, cfg.top_entropy_quantile).to(dt)
        mult = mult * emask
    if rollout_w is not None and cfg.policy_loss not in ("vespo", "geo-mean"):  # they fold them in
        mult = mult * rollout_w.to(dt)
    return mult, emask


def kl_term(logp, ref, log_r, cfg, seq_mean=None):
    """beta * k3(ref, logp) (times r with the bias correction, spec 9) -> (value, d/dlogp), every derivative
    in d/dlogp. seq_mean None: r is the token's own ratio (token level, or geo_mean's term, whose d/dlog r is
    the completion's), d(r k3)/dlogp = r (1 - e^d) + r k3 = -r d, formed as such (the sum of the two cancels
    terms of size r e^d: a relative error of 1e-3 at d = 14 in float32). seq_mean (x -> its mean over each
    token's completion, counted tokens): r is the completion's R (its aggregation weight the same on all its
    tokens), and d/dlogp_t of the completion's sum is R (mean e^d - e^d_t - mean d) / n per weight, formed as
    R (e^P (mean expm1(d - P) - expm1(d_t - P)) - P) with P = mean d: no term of size R e^d is formed, and
    d - P is formed in float64."""
    d = ref - logp
    # expm1, not exp(d) - 1: near ref = logp the derivative 1 - exp(d) ~ -d would lose its digits to the
    # rounding of exp(d) near 1 (up to half an ulp of 1, 6e-8 in float32: a relative error up to 6e-8 / |d|;
    # 9.5e-6 of the whole gradient at d = 4e-3 where the KL term is a token's only gradient)
    em = torch.expm1(d)
    k3 = em - d  # exp(d) - d - 1
    if not cfg.use_bias_correction_kl:
        return _times_beta(cfg.beta, k3), _times_beta(cfg.beta, -em)  # d k3 / d logp = 1 - exp(d)
    r = torch.exp(log_r)
    # k3 r; where k3 overflows (d > 88 in float32) e^(d + log r) - (d + 1) r, the same number, finite where it is
    # (a small r times an infinite k3 was inf, or NaN once r underflowed to 0)
    kr = torch.where(k3 < math.inf, k3 * r, torch.exp(d + log_r) - (d + 1) * r)
    if seq_mean is None:
        return _times_beta(cfg.beta, kr), _times_beta(cfg.beta, -d, r)
    d64 = ref.double() - logp.double()  # (d - P from float64: d's own rounding, times e^P, would be the error)
    P = seq_mean(d64)
    # R (e^P (mean e - e) - P), e = expm1(d - P), with R e^P e as e^(lg + x) - e^lg past x = 80 (lg = P + log R):
    # neither e^P nor e^x alone overflows where their product with R does not (kernels' _r_expm1)
    x, lg = d64 - P, P + log_r.double()
    e_l, xf = torch.exp(lg.to(d.dtype)), x.to(d.dtype)
    re = torch.where(xf <= 80, e_l * torch.expm1(xf.clamp(max=80)), torch.exp((lg + x).to(d.dtype)) - e_l)
    g = seq_mean(re) - re - P.to(d.dtype) * r
    return _times_beta(cfg.beta, kr), _times_beta(cfg.beta, g)


def _times_beta(beta, x, r=None):
    """beta * x (* r); a tensor beta of 0 (a schedule there) gives 0, as the number 0 turns the term off,
    where x overflowed float32 too."""
    y = beta * x if r is None else beta * x * r
    if not isinstance(beta, torch.Tensor):
        return y
    return torch.where(beta != 0, y, torch.zeros((), dtype=x.dtype, device=x.device))


def coefficients(w, d_logp, d_logr, m, mf, seg, B, n_safe, spread):
    """c = d loss / d logp per token: direct, plus through log r (for a sequence term, through the
    completion's mean into each token of `spread`: the counted ones, or geo_mean's unclipped ones;
    spread None: a token-level ratio)."""
    zero = torch.zeros((), dtype=w.dtype, device=w.device)
    c = torch.zeros_like(w) if d_logp is None else w * d_logp
    if d_logr is not None:
        g = w * d_logr  # d loss / d log r, per token
        if spread is not None:
            g = (seg_sum(torch.where(m, g, zero), seg, B) / n_safe)[seg] * spread
        c = c + g
    return torch.where(m, c, zero)


def batch_metrics(clipped, kept, lam, ent, m, B, M_safe):
    dt = ent.dtype
    zero = torch.zeros((), dtype=dt, device=ent.device)
    return {
        "clip_frac": (clipped & m).to(dt).sum() / M_safe,
        "filtered_frac": (~kept).to(dt).mean() if B else zero,
        "conflict_frac": zero if lam is None else  # NaN with an unvalidated NaN lam (spec 6)
        ((lam != 1) & m).to(dt).sum() / M_safe + torch.where(m, lam * 0, zero).sum(),
        "mean_entropy": ent.sum(dtype=torch.float64).to(dt) / M_safe,
    }


def _add(x, y):
    return y if x is None else (x if y is None else x + y)


def surrogate(logp, ent, m, seg, B, adv, cfg, *, old=None, ref=None, lam=None, n_conf=None,
              num_items=None, max_len=None, rollout_w=None, rollout_w_seq=None, rollout_logps=None,
              totals=None, token_adv=None):
    """totals: (counted tokens per completion (B,), M, the batch's B) when the tokens are a slice of a
    batch's whole completions (the fused LM head's tile); the aggregation then uses the batch's counts.
    logp, ent (N,) float; m (N,) bool; seg (N,) int64; adv (B,) float; lam (N,) or None;
    n_conf (B,) or None; max_len: scalar (python or 0-d tensor) for 'seq-mean-token-sum-norm';
    rollout_w: (N,) rollout importance weights (per-completion ones, rollout_w_seq (B,), repeated on
    their tokens). token_adv: (N,) per-token advantages that replace Ahat (verl's, with GTPO's conflict
    weights and entropy control folded in at advantage time). Non-finite advantages, old/ref log-probs or rollout weights at counted tokens give NaN.
    Returns a dict: loss_tok (N,), weight (N,), c (N,), e (N,) or None, kept, seq_entropy, metrics.
    """
    dt = logp.dtype
    zero = torch.zeros((), dtype=dt, device=logp.device)
    mf = m.to(dt)
    logp, ent = torch.where(m, logp, zero), torch.where(m, ent, zero)
    old = None if old is None else finite_or_nan(torch.where(m, old.to(dt), zero))
    ref = None if ref is None else finite_or_nan(torch.where(m, ref.to(dt), zero))
    if rollout_w is not None:  # >= 0 and finite where counted; ignored elsewhere
        rw = rollout_w.to(dt)
        rollout_w = torch.where(m, torch.where(rw >= 0, finite_or_nan(rw), float("nan")), 1.0)
    if rollout_w_seq is not None:
        rw = rollout_w_seq.to(dt)
        rollout_w_seq = torch.where(rw >= 0, finite_or_nan(rw), float("nan"))
    n_safe = (seg_sum(mf, seg, B) if totals is None else totals[0]).clamp(min=1)  # counted tokens per completion
    M = mf.sum(dtype=torch.float64).to(dt) if totals is None else totals[1]  # exact counts past 2**24 tokens
    M_safe = M.clamp(min=1)
    adv = finite_or_nan(adv.to(dt))
    seq_ent, kept, a_hat = entropy_control(ent, seg, B, n_safe, adv, cfg)
    A = a_hat[seg] if token_adv is None else torch.where(m, finite_or_nan(token_adv.to(dt)), zero)

    log_r = log_ratio(logp, old, m, seg, B, n_safe, cfg.importance_sampling_level)
    pg, d_logr, d_logp, clipped, spread = policy_term(logp, log_r, A, adv, m, seg, B, cfg, rollout_w, rollout_w_seq,
                                                      logp if old is None else old, n_safe, M)
    mult, emask = multipliers(logp, ent, m, seg, B, n_safe, M, adv, cfg, lam, old, rollout_w, rollout_logps)
    loss_tok = mult * pg
    d_logr = None if d_logr is None else mult * d_logr
    d_logp = None if d_logp is None else mult * d_logp
    if ref is not None and not is_zero(cfg.beta):
        # the KL's ratio is the token's own at token level, and in geo_mean (whose d_logr is d / d log R)
        own = cfg.policy_loss == "geo-mean" or (spread is None and cfg.importance_sampling_level == "token")
        kl, kl_logp = kl_term(logp, ref, log_r, cfg, None if own else lambda x: (
            seg_sum(torch.where(m, x, zero), seg, B) / n_safe)[seg])
        loss_tok, d_logp = loss_tok + kl, _add(d_logp, kl_logp)
    e = None
    if not is_zero(cfg.entropy_coef):  # the bonus, masked by the top-entropy mask too
        coef = -cfg.entropy_coef if emask is None else -cfg.entropy_coef * emask
        loss_tok = loss_tok + coef * ent
    loss_tok = torch.where(m, loss_tok, zero)

    w = aggregation_weights(mf, seg, B if totals is None else totals[2], n_safe, M_safe, cfg, n_conf, num_items, max_len)
    if spread is None and cfg.importance_sampling_level == "sequence":
        spread = mf
    c = coefficients(w, d_logp, d_logr, m, mf, seg, B, n_safe, None if spread is None else spread.to(dt) * mf)
    if not is_zero(cfg.entropy_coef):  # NaN with the completion's advantage (unvalidated invalid input)
        e = torch.where(m, w * coef + A * 0, zero)
    return dict(loss_tok=loss_tok, weight=w, c=c, e=e, kept=kept, seq_entropy=seq_ent, logp=logp, ent=ent,
                metrics=batch_metrics(clipped, kept, lam, ent, m, B, M_safe))
