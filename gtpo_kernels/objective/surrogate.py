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
from . import policy


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
    shaped = adv if is_zero(cfg.entropy_penalty) else adv - cfg.entropy_penalty * seq_ent
    a_hat = torch.where(kept, shaped, torch.zeros_like(seq_ent))
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
    entropies (linear interpolation, as torch.quantile), without a host sync."""
    q = 1.0 - rho
    key = torch.where(m, ent, torch.full_like(ent, float("inf")))  # uncounted tokens sort last
    srt = key.sort().values
    pos = (M.clamp(min=1) - 1) * (q if not isinstance(q, torch.Tensor) else q.to(ent.dtype))
    lo = pos.floor().long()
    hi = torch.minimum(lo + 1, (M.clamp(min=1) - 1).long())
    v_lo, v_hi = srt[lo], srt[hi]
    thr = v_lo + (v_hi - v_lo) * (pos - lo.to(pos.dtype))
    thr = torch.where(v_hi == v_lo, v_lo, thr)  # inf - inf
    return m & (ent >= thr) & (M > 0)


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
        return mf / (n_safe * nc)[seg]
    return mf  # "none": per-token loss, the incoming gradient is per token


def surrogate(logp, ent, m, seg, B, adv, cfg, *, old=None, ref=None, lam=None, n_conf=None,
              num_items=None, max_len=None, rollout_w=None, rollout_w_seq=None, rollout_logps=None):
    """logp, ent (N,) float; m (N,) bool; seg (N,) int64; adv (B,) float; lam (N,) or None;
    n_conf (B,) or None; max_len: scalar (python or 0-d tensor) for 'seq-mean-token-sum-norm';
    rollout_w: (N,) rollout importance weights (per-completion ones, rollout_w_seq (B,), repeated on
    their tokens).
    Returns a dict: loss_tok (N,), weight (N,), c (N,), e (N,) or None, kept, seq_entropy, metrics.
    """
    dt = logp.dtype
    zero = torch.zeros((), dtype=dt, device=logp.device)
    mf = m.to(dt)
    logp = torch.where(m, logp, zero)
    ent = torch.where(m, ent, zero)
    n = seg_sum(mf, seg, B)  # counted tokens per completion
    n_safe = n.clamp(min=1)
    M = mf.sum(dtype=torch.float64).to(dt)  # exact counts past 2**24 tokens
    M_safe = M.clamp(min=1)
    adv = adv.to(dt)
    seq_ent, kept, a_hat = entropy_control(ent, seg, B, n_safe, adv, cfg)
    A = a_hat[seg]

    # the policy term (spec 4, 9) and its multipliers: lambda, the masks, the rollout weights
    log_r = log_ratio(logp, old, m, seg, B, n_safe, cfg.importance_sampling_level)
    r = torch.exp(log_r)
    if cfg.policy_loss == "ppo":
        pg, d_logr, d_logp, clipped = policy.ppo(r, A, cfg)
    elif cfg.policy_loss == "cispo":
        pg, d_logr, d_logp, clipped = policy.cispo(r, A, logp, cfg)
    elif cfg.policy_loss == "sapo":
        pg, d_logr, d_logp, clipped = policy.sapo(r, A, cfg)
    else:  # vespo: the rollout weights are folded into phi
        log_w = None  # sum_t log(rollout weight), each log clamped to [log 1e-8, 20] as TRL
        if rollout_w_seq is not None:  # a per-completion weight enters once
            log_w = torch.log(rollout_w_seq.to(dt)).clamp(min=math.log(1e-8), max=20.0)
        elif rollout_w is not None:
            lw = torch.log(rollout_w.to(dt)).clamp(min=math.log(1e-8), max=20.0)
            log_w = seg_sum(torch.where(m, lw, zero), seg, B)
        phi = policy.vespo_phi(log_r, m, lambda x: seg_sum(x, seg, B), adv, log_w, cfg)
        pg, d_logr, d_logp, clipped = policy.vespo(phi[seg], A, logp)
    mult = torch.ones_like(logp) if lam is None else lam.to(dt)
    if cfg.off_policy_mask_threshold is not None:
        sampling = rollout_logps if rollout_logps is not None else old
        mult = mult * off_policy_keep(logp, sampling, m, seg, B, n_safe, adv,
                                      cfg.off_policy_mask_threshold)[seg].to(dt)
    emask = None
    if not is_zero(cfg.top_entropy_quantile - 1.0):
        emask = top_entropy_mask(ent, m, M, cfg.top_entropy_quantile).to(dt)
        mult = mult * emask
    if rollout_w is not None and cfg.policy_loss != "vespo":
        mult = mult * rollout_w.to(dt)
    loss_tok = mult * pg
    d_logr = None if d_logr is None else mult * d_logr
    d_logp = None if d_logp is None else mult * d_logp

    if ref is not None and not is_zero(cfg.beta):  # beta * k3, times r with the bias correction
        d = torch.where(m, ref.to(dt), zero) - logp
        ed = torch.exp(d)
        k3 = ed - d - 1.0
        dk3 = 1.0 - ed  # d k3 / d logp
        if cfg.use_bias_correction_kl:
            loss_tok = loss_tok + cfg.beta * k3 * r
            d_logp = (0.0 if d_logp is None else d_logp) + cfg.beta * dk3 * r
            d_logr = (0.0 if d_logr is None else d_logr) + cfg.beta * k3 * r
        else:
            loss_tok = loss_tok + cfg.beta * k3
            d_logp = (0.0 if d_logp is None else d_logp) + cfg.beta * dk3
    coef = None
    if not is_zero(cfg.entropy_coef):
        coef = -cfg.entropy_coef if emask is None else -cfg.entropy_coef * emask
        loss_tok = loss_tok - cfg.entropy_coef * ent * (1.0 if emask is None else emask)
    loss_tok = torch.where(m, loss_tok, zero)

    w = aggregation_weights(mf, seg, B, n_safe, M_safe, cfg, n_conf, num_items, max_len)
    c = torch.zeros_like(logp) if d_logp is None else w * d_logp
    if d_logr is not None:
        g = w * d_logr  # d loss / d log r, per token
        if cfg.importance_sampling_level == "sequence":
            g = (seg_sum(g, seg, B) / n_safe)[seg] * mf  # through the mean into each counted token
        c = c + g
    c = torch.where(m, c, zero)
    e = None if coef is None else w * coef

    metrics = {
        "clip_frac": (clipped & m).to(dt).sum() / M_safe,
        "filtered_frac": (~kept).to(dt).mean() if B else zero,
        "conflict_frac": zero if lam is None else ((lam != 1) & m).to(dt).sum() / M_safe,
        "mean_entropy": ent.sum(dtype=torch.float64).to(dt) / M_safe,
    }
    return dict(loss_tok=loss_tok, weight=w, c=c, e=e, kept=kept, seq_entropy=seq_ent,
                logp=logp, ent=ent, metrics=metrics)
