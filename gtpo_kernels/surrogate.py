"""Everything between the two vocabulary passes: O(tokens), no autograd.

From per-token log-probs and entropies it computes the entropy filter, the shaped advantage, the ratio,
the clipped surrogate, the KL and entropy terms, the aggregation weights, and the two coefficients the
backward pass needs per token (spec sections 2-4):

    loss = sum_k w_k * l_k,      c_k = w_k * d l_k / d logp_k,      e_k = w_k * d l_k / d H_k

    d/dlogp of -lam * min(r A, clip(r) A)  = -lam * A * r   where the unclipped branch is the min
                                                           (r A <= clip(r) A), else 0 (clipped)
    d/dlogp of beta * k3                   = beta * (1 - exp(ref - logp))
    d/dH    of -coef * H                   = -coef

Tokens are flat (N,) with `seg[k]` the completion of token k, which serves the padded form
(seg = k // T) and the packed form alike. Completion entropy Hbar is a constant (no gradient).
"""
from __future__ import annotations

import torch

from .config import is_zero


def _operand(x, like):
    """A Python number as it is; a 0-d tensor hyper-parameter moved to `like`'s device and dtype."""
    return x.to(like.device, like.dtype) if isinstance(x, torch.Tensor) else x


def seg_sum(x, seg, B):
    """Per-completion sums, accumulated in float64 (a completion may hold 100k+ tokens)."""
    return torch.zeros(B, dtype=torch.float64, device=x.device).index_add_(0, seg, x.double()).to(x.dtype)


def surrogate(logp, ent, m, seg, B, adv, cfg, *, old=None, ref=None, lam=None, n_conf=None,
              num_items=None, max_len=None):
    """logp, ent (N,) float; m (N,) bool; seg (N,) int64; adv (B,) float; lam (N,) or None;
    n_conf (B,) or None; max_len: scalar (python or 0-d tensor) for 'seq-mean-token-sum-norm'.
    Returns a dict: loss_tok (N,), weight (N,), c (N,), e (N,) or None, kept, seq_entropy, metrics."""
    dt = logp.dtype
    zero = torch.zeros((), dtype=dt, device=logp.device)
    mf = m.to(dt)
    logp = torch.where(m, logp, zero)
    ent = torch.where(m, ent, zero)
    n = seg_sum(mf, seg, B)  # counted tokens per completion
    n_safe = n.clamp(min=1)
    M = mf.sum(dtype=torch.float64).to(dt)  # exact counts past 2**24 tokens
    M_safe = M.clamp(min=1)

    # entropy control (spec 2)
    seq_ent = seg_sum(ent, seg, B) / n_safe
    h_max = cfg.entropy_threshold
    if h_max is None:
        kept = torch.ones(B, dtype=torch.bool, device=logp.device)
    else:
        kept = seq_ent <= h_max
        if cfg.initial_entropy is not None:  # the paper's gate (a tensor comparison when either is one)
            kept = kept | (cfg.initial_entropy > h_max)
    adv = adv.to(dt)
    a_hat = torch.where(kept, adv - cfg.entropy_penalty * seq_ent, zero)
    A = a_hat[seg]

    # ratio and policy-gradient term (spec 4)
    # on-policy: log r = logp - sg(logp) = 0, NaN at an invalid token (so that it shows)
    log_r = logp - (torch.where(m, old.to(dt), zero) if old is not None else logp)
    r = torch.exp(log_r)
    lam = torch.ones_like(logp) if lam is None else lam.to(dt)
    u1 = r * A
    if cfg.clip:
        u2 = torch.clamp(r, _operand(1.0 - cfg.eps_low, r), _operand(1.0 + cfg.eps_high, r)) * A
        clipped = u1 > u2
        pg = -lam * torch.minimum(u1, u2)
        d_logp = torch.where(clipped, zero, -lam * u1)
    else:
        clipped = torch.zeros_like(m)
        pg = -lam * u1
        d_logp = -lam * u1
    loss_tok = pg
    if ref is not None and not is_zero(cfg.beta):
        d = torch.where(m, ref.to(dt), zero) - logp
        ed = torch.exp(d)
        loss_tok = loss_tok + cfg.beta * (ed - d - 1.0)
        d_logp = d_logp + cfg.beta * (1.0 - ed)
    if not is_zero(cfg.entropy_coef):
        loss_tok = loss_tok - cfg.entropy_coef * ent
    loss_tok = torch.where(m, loss_tok, zero)

    # aggregation weights (spec 4); filtered completions still count in the denominators
    agg = cfg.loss_agg
    if agg == "seq-mean-token-mean":
        w = mf / (B * n_safe[seg])
    elif agg == "token-mean":
        w = mf / (M_safe if num_items is None else num_items)
    elif agg == "seq-mean-token-sum":
        w = mf / B
    elif agg == "seq-mean-token-sum-norm":
        w = mf / (B * (cfg.max_completion_length or max_len))
    elif agg == "gtpo-official":
        nc = torch.ones(B, dtype=dt, device=logp.device) if n_conf is None else n_conf.to(dt)
        w = mf / (n_safe * nc)[seg]
    else:  # "none": per-token loss, the incoming gradient is per token
        w = mf
    c = w * d_logp
    e = None if is_zero(cfg.entropy_coef) else w * (-cfg.entropy_coef)

    metrics = {
        "clip_frac": (clipped & m).to(dt).sum() / M_safe,
        "filtered_frac": (~kept).to(dt).mean() if B else zero,
        "conflict_frac": ((lam != 1) & m).to(dt).sum() / M_safe,
        "mean_entropy": ent.sum(dtype=torch.float64).to(dt) / M_safe,
    }
    return dict(loss_tok=loss_tok, weight=w, c=c, e=e, kept=kept, seq_entropy=seq_ent,
                logp=logp, ent=ent, metrics=metrics)
