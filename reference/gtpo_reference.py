"""Pure-PyTorch float64 reference of the GTPO loss (the test oracle of gtpo_kernels).

Every formula follows docs/GTPO_SPEC.md (the specification); comments cite its sections ("spec 3" = section 3).
Readability comes first: the conflict weights are plain Python loops over groups, completions and
positions, and everything is computed in float64. It stands alone: no dependency on the kernels package.
"""
from __future__ import annotations

import math
import numbers

import torch

from . import gtpo_family as fam
from . import gtpo_verl as gv
from .gtpo_conflict import conflict_weights
from .gtpo_family import POLICY_LOSSES, ROLLOUT_IS_MODES, rollout_is_weights

__all__ = ["LOSS_AGGS", "POLICY_LOSSES", "ROLLOUT_IS_MODES", "token_logprobs", "conflict_weights",
           "gtpo_loss", "rollout_is_weights"]

LOSS_AGGS = (
    "seq-mean-token-mean",
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "gtpo-official",
    "none",
)

_F64 = torch.float64


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------

def _bool_mask(mask, shape, device):
    """Mask as a bool tensor (1 = the token counts); None means every token counts (spec 1)."""
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    mask = torch.as_tensor(mask, device=device)
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"mask must have shape {tuple(shape)}, got {tuple(mask.shape)}")
    return mask != 0


def _log_softmax(s):
    """log p_v = s_v - lse with lse = max + log1p(S), S = sum over every entry but one maximum of
    exp(s_v - max): exact on near-certain rows, where torch.log_softmax rounds log(1 + S) to 0 once
    S < 1e-16 (log p of the top token then reads 0 and its entropy term p log p vanishes)."""
    mx = s.max(dim=-1, keepdim=True)
    e = torch.exp(s - mx.values)
    S = e.scatter(-1, mx.indices, 0.0).sum(dim=-1, keepdim=True)
    return (s - mx.values) - torch.log1p(S)  # s - max first: exact 0 at the maximum


def _entropy_terms(logp_all):
    """p log p per entry, 0 where p = 0 (-inf logits, a banned vocabulary); NaN stays NaN (a row with a NaN
    logit, or a NaN temperature, has a NaN entropy, never 0)."""
    p = logp_all.exp()
    return torch.where(p == 0, torch.zeros_like(p), p * logp_all)


class _LogpEntropy(torch.autograd.Function):
    """(logp, H) of s = logits / tau with the analytic gradients of spec 1, each formed without
    cancellation on near-certain rows (where autograd loses every digit of the target's term):

        d logp / d s_v = [v = y] - p_v,   with 1 - p_y = sum_{v != y} p_v at the target;
        d H / d s_v    = -p_v (log p_v + H), with log p_k + H = (1 - p_k) log p_k - sum_{v != k} p_v log p_v
                         at the row's maximum k (1 - p_k again the sum of the others)."""

    @staticmethod
    def forward(ctx, s, idx):
        logp_all = _log_softmax(s)
        logp = logp_all.gather(-1, idx).squeeze(-1)
        H = -_entropy_terms(logp_all).sum(dim=-1)
        ctx.save_for_backward(logp_all, idx, H)
        return logp, H

    @staticmethod
    def backward(ctx, g_logp, g_H):
        logp_all, idx, H = ctx.saved_tensors
        p = logp_all.exp()
        grad = torch.zeros_like(p)
        if g_logp is not None:
            q = p.scatter(-1, idx, 0.0).sum(-1)                       # 1 - p_y, a sum of positive terms
            grad = -p * g_logp.unsqueeze(-1)
            grad.scatter_(-1, idx, (q * g_logp).unsqueeze(-1))
        if g_H is not None:
            plogp = _entropy_terms(logp_all)
            t = torch.where(p == 0, torch.zeros_like(p), logp_all + H.unsqueeze(-1))  # log p_v + H
            k = logp_all.argmax(dim=-1, keepdim=True)                # the one entry that can be near 1
            q_k = p.scatter(-1, k, 0.0).sum(-1, keepdim=True)
            others = plogp.scatter(-1, k, 0.0).sum(-1, keepdim=True)
            t = t.scatter(-1, k, q_k * logp_all.gather(-1, k) - others)
            grad = grad - p * t * g_H.unsqueeze(-1)
        # a row no gradient reaches (a masked-out token) gets exact zeros, even where its p is NaN (a row all
        # -inf): 0 times the row's derivative, which a NaN there would otherwise turn into NaN (spec 7)
        reached = torch.zeros(grad.shape[:-1], dtype=torch.bool, device=grad.device)
        for g in (g_logp, g_H):
            if g is not None:
                reached = reached | (g != 0)  # (a NaN upstream gradient reaches)
        return torch.where(reached.unsqueeze(-1), grad, torch.zeros_like(grad)), None


def _full_logp_entropy(logits, ids, temperature):
    """Per-position logp and entropy of the temperature-scaled softmax (spec 1), for every row,
    masked or not. Returns (logp (B,T) float64, H (B,T) float64), both differentiable (analytic
    gradients: _LogpEntropy)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    s = logits.double() / temperature                       # s = z / tau
    V = s.shape[-1]
    # ids at masked-out positions may be anything (e.g. -100): clamp so the gather is legal.
    idx = ids.long().clamp(0, V - 1).unsqueeze(-1)
    # H = -sum_v p_v log p_v with p log p = 0 where p = 0 (-inf logits, banned vocabulary)
    return _LogpEntropy.apply(s, idx)


def _zero_where_masked(x, m):
    """x where the token counts, exactly 0 elsewhere (with exactly zero gradient there)."""
    return torch.where(m, x, torch.zeros_like(x))


# --------------------------------------------------------------------------------------------------
# spec 1: per-token log-probabilities and entropy
# --------------------------------------------------------------------------------------------------

def token_logprobs(logits, ids, temperature=1.0, mask=None):
    """logits (B,T,V) float any dtype, ids (B,T) int -> (logp, entropy) both (B,T) float64.

    logp = log_softmax(logits/temperature)[ids]; entropy H = -sum p log p of the temperature-scaled
    softmax (spec 1), with p*log p = 0 where p = 0 (-inf logits allowed). Positions where mask==0
    (mask optional, default all counted) give 0 and their ids may be anything (e.g. -100).
    Differentiable w.r.t. logits.
    """
    if logits.dim() != 3 or ids.shape != logits.shape[:2]:
        raise ValueError(f"expected logits (B,T,V) and ids (B,T), got {tuple(logits.shape)} "
                         f"and {tuple(ids.shape)}")
    m = _bool_mask(mask, ids.shape, logits.device)
    logp, H = _full_logp_entropy(logits, ids, temperature)
    return _zero_where_masked(logp, m), _zero_where_masked(H, m)


# --------------------------------------------------------------------------------------------------
# spec 2, 4: the loss
# --------------------------------------------------------------------------------------------------

def gtpo_loss(logits, completion_ids, advantages, completion_mask=None, *, group_size=None,
              old_logps=None, ref_logps=None, lam=None, n_conf=None, num_items_in_batch=None,
              logits_start=0,
              temperature=1.0, eps_low=0.2, eps_high=0.2, clip=True, use_conflict_mask=True,
              conflict_pos_weight=2.0, conflict_neg_weight=0.0, entropy_threshold=math.log(2),
              entropy_penalty=0.1, initial_entropy=None, entropy_coef=0.0, beta=0.0,
              loss_agg="seq-mean-token-mean", max_completion_length=None, local_count=False,
              policy_loss="ppo", importance_sampling_level="token", delta=None,
              sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
              vespo_k_neg=3.0, vespo_lambda_neg=2.0, use_bias_correction_kl=False,
              off_policy_mask_threshold=None, top_entropy_quantile=1.0, rollout_is_weights=None,
              rollout_logps=None, dual_clip_c=None, dro_beta=None, clip_cov_ratio=2e-4, clip_cov_lb=1.0,
              clip_cov_ub=5.0, kl_cov_ratio=2e-4, ppo_kl_coef=0.1, generator=None):
    """GTPO loss, float64 reference of spec sections 1-4, 6 and 9 (padded form only).

    Spec 9 (the GRPO family, pieces in gtpo_family.py): policy_loss, importance_sampling_level, delta,
    the sapo/vespo parameters, use_bias_correction_kl, off_policy_mask_threshold (uses rollout_logps
    (B,T) when given, else old_logps), top_entropy_quantile and rollout_is_weights ((B,T) per token, or
    (B,)/(B,1) per completion); verl's modes and their options (gtpo_verl.py: dual_clip_c ... generator,
    which may also be clip_cov's keys themselves, (B, T) float64: a packed batch's draws laid out padded);
    local_count (bnpo): token-mean over the counted tokens always, num_items_in_batch refused. The
    defaults give the GTPO loss of spec 4.

    Returns a dict with keys: loss (0-d, or (B,T) for loss_agg='none', differentiable w.r.t.
    logits), per_token_loss (B,T) detached (0 where masked), logps (B,T), entropy (B,T) (both
    detached, 0 where masked), lam (B,T), n_conf (B,), kept (B,) bool, seq_entropy (B,), metrics:
    dict with 0-d tensors clip_frac, filtered_frac, conflict_frac, mean_entropy (and, with rollout_logps,
    spec 14's rollout_k3, rollout_abs_diff, rollout_max_abs_diff, rollout_outside_frac, rollout_nan_frac).
    All floats float64.
    logits is (B, T_l, V) with T_l >= logits_start + T: row logits_start+t predicts
    completion_ids[:, t].
    """
    # ---- inputs ------------------------------------------------------------------------------
    agg = str(loss_agg).strip().lower().replace("_", "-")
    if agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
    if completion_ids.dim() != 2:
        raise ValueError(f"completion_ids must be (B, T), got {tuple(completion_ids.shape)}")
    B, T = completion_ids.shape
    if logits.dim() != 3 or logits.shape[0] != B or logits.shape[1] < logits_start + T:
        raise ValueError(f"logits must be (B={B}, T_l >= logits_start + T = {logits_start + T}, V), "
                         f"got {tuple(logits.shape)}")
    device = logits.device
    m = _bool_mask(completion_mask, (B, T), device)
    mf = m.double()
    A = torch.as_tensor(advantages, device=device).double().reshape(-1)
    if A.numel() != B:
        raise ValueError(f"advantages must have B={B} entries, got shape {tuple(A.shape)}")
    if beta != 0 and ref_logps is None:
        raise ValueError("ref_logps is required when beta != 0")
    fam.check_family_args(policy_loss, importance_sampling_level, delta, top_entropy_quantile,
                          sapo_temperature_pos, sapo_temperature_neg)
    gv.check_verl_args(policy_loss, agg, dual_clip_c, dro_beta, clip_cov_ratio, clip_cov_lb, clip_cov_ub,
                       kl_cov_ratio, ppo_kl_coef)
    rollout_w = fam.rollout_weights_arg(rollout_is_weights, m)
    rollout_logps = fam.rollout_logps_arg(rollout_logps, m)

    # ---- spec 1: logp and entropy (rows outside [logits_start, logits_start+T) get no gradient)
    z = logits[:, logits_start:logits_start + T]
    logp_full, H_full = _full_logp_entropy(z, completion_ids, temperature)
    logp = _zero_where_masked(logp_full, m)
    H = _zero_where_masked(H_full, m)

    n = mf.sum(dim=1)                                        # n[i] = sum_t m[i,t]
    M = mf.sum()                                             # counted tokens in the batch

    # ---- spec 3: conflict weights --------------------------------------------------------------
    if lam is None or n_conf is None:
        if not use_conflict_mask:
            lam_c = torch.ones(B, T, dtype=_F64, device=device)
            n_conf_c = torch.ones(B, dtype=_F64, device=device)
        elif group_size is not None:
            lam_c, n_conf_c = conflict_weights(completion_ids, m, A, group_size,
                                               conflict_pos_weight, conflict_neg_weight)
        elif lam is not None and agg != "gtpo-official":
            # only lam given; n_conf is used by the gtpo-official aggregation alone
            lam_c, n_conf_c = None, torch.ones(B, dtype=_F64, device=device)
        else:
            raise ValueError("group_size is required to compute the conflict weights "
                             "(or pass lam and n_conf)")
        lam = lam_c if lam is None else lam
        n_conf = n_conf_c if n_conf is None else n_conf
    lam = torch.as_tensor(lam, device=device).double().reshape(B, T)
    lam = torch.where(m, lam, torch.ones_like(lam))          # spec 3: lambda = 1 off the mask
    n_conf = torch.as_tensor(n_conf, device=device).double().reshape(B)

    # ---- spec 2: entropy filter (kept = the spec's delta[i]) and shaped advantage (no gradient)
    Hbar = (H.detach() * mf).sum(dim=1) / n.clamp(min=1)
    if entropy_threshold is None:
        kept = torch.ones(B, dtype=torch.bool, device=device)
    elif initial_entropy is not None and initial_entropy > entropy_threshold:
        kept = torch.ones(B, dtype=torch.bool, device=device)    # the paper's gate
    else:
        kept = Hbar <= entropy_threshold
    # (no shaping: A itself, so that an unvalidated NaN entropy reaches no other token through 0 * NaN)
    shaped = A if isinstance(entropy_penalty, numbers.Real) and entropy_penalty == 0 else A - entropy_penalty * Hbar
    Ahat = (kept.double() * shaped).unsqueeze(1)   # (B, 1)

    # ---- spec 4, 9: ratio and per-token policy term ------------------------------------------
    if old_logps is not None:
        old = _zero_where_masked(torch.as_tensor(old_logps, device=device).double().reshape(B, T), m)
    else:
        old = logp.detach()                                  # on-policy: r has value 1, gradient of logp
    r = fam.importance_ratio(logp, old, m, importance_sampling_level)   # (B, T), or (B, 1) per sequence
    phi = None
    if policy_loss == "vespo":
        phi = fam.vespo_phi(logp, old, m, A, rollout_w, vespo_k_pos, vespo_lambda_pos, vespo_k_neg,
                            vespo_lambda_neg)
    if policy_loss in gv.VERL_POLICIES:
        pg, clip_removed = gv.policy_term(
            policy_loss, logp, old, Ahat.expand(B, T), m, rollout_w, eps_low=eps_low, eps_high=eps_high, clip=clip,
            delta=delta, dual_clip_c=dual_clip_c, dro_beta=dro_beta, clip_cov_ratio=clip_cov_ratio,
            clip_cov_lb=clip_cov_lb, clip_cov_ub=clip_cov_ub, kl_cov_ratio=kl_cov_ratio, ppo_kl_coef=ppo_kl_coef,
            generator=generator)
    else:
        pg, clip_removed = fam.policy_term(policy_loss, r, Ahat, logp, clip=clip, eps_low=eps_low,
                                           eps_high=eps_high, delta=delta, phi=phi,
                                           sapo_temperature_pos=sapo_temperature_pos,
                                           sapo_temperature_neg=sapo_temperature_neg)
        if policy_loss == "ppo":                             # verl's dual clip (spec 9)
            pg, dual = gv.dual_clip(pg, Ahat, dual_clip_c)
            clip_removed = clip_removed | dual
    clip_removed = clip_removed & m

    # ---- spec 9: order per token: policy term * lambda * masks * rollout weights + KL - entropy ----
    tok = lam * pg                                           # lambda multiplies every policy term
    if off_policy_mask_threshold is not None:
        sampling_logp = rollout_logps if rollout_logps is not None else old
        tok = tok * fam.off_policy_mask(A, logp, sampling_logp, m, off_policy_mask_threshold)
    entropy_mask = fam.top_entropy_mask(H, m, top_entropy_quantile) if top_entropy_quantile < 1 else None
    if entropy_mask is not None:
        # a NaN counted entropy (unvalidated) makes the quantile, so every counted token's mask, NaN (spec 6)
        unknown = torch.isnan(H.detach()[m]).any()
        entropy_mask = torch.where(m & unknown, torch.full_like(H, float("nan")), entropy_mask.double()).detach()
        tok = tok * entropy_mask
    if rollout_w is not None and policy_loss not in ("vespo", "geo-mean"):  # they fold them in (spec 9)
        tok = tok * rollout_w
    if beta != 0:
        ref = _zero_where_masked(torch.as_tensor(ref_logps, device=device).double().reshape(B, T), m)
        tok = tok + beta * fam.k3(ref, logp, r if use_bias_correction_kl else None,
                                  old if importance_sampling_level == "token" else None)
    if entropy_coef != 0:
        # differentiable entropy bonus; the top-entropy mask masks it too (spec 9). TRL differs: its bonus
        # is entropy_coef * the token mean of H over the (entropy-)masked tokens, whatever the loss_agg.
        tok = tok - entropy_coef * (H if entropy_mask is None else H * entropy_mask)
    tok = _zero_where_masked(tok, m)                         # masked-out tokens: exactly 0

    # ---- spec 4: aggregation (filtered completions still count in the denominators) -----------
    if agg == "seq-mean-token-mean":
        loss = (tok.sum(dim=1) / n.clamp(min=1)).sum() / max(B, 1)
    elif agg == "token-mean":
        if num_items_in_batch is not None and local_count:  # bnpo (spec 9): always the local count
            raise ValueError("num_items_in_batch with local_count=True: bnpo divides by the local count")
        if num_items_in_batch is not None:
            denom = torch.as_tensor(num_items_in_batch, device=device).double()   # > 0, never clamped
        else:
            denom = M.clamp(min=1)
        loss = tok.sum() / denom
    elif agg == "seq-mean-token-sum":
        loss = tok.sum() / max(B, 1)
    elif agg == "seq-mean-token-sum-norm":
        L = max_completion_length if max_completion_length is not None else T
        loss = tok.sum() / max(B * L, 1)
    elif agg == "gtpo-official":
        loss = (tok.sum(dim=1) / n.clamp(min=1) / n_conf).sum()
    else:  # "none"
        loss = tok

    # ---- spec 6: metrics ----------------------------------------------------------------------
    Mc = M.clamp(min=1)
    metrics = {
        "clip_frac": clip_removed.double().sum() / Mc,
        "filtered_frac": (~kept).double().sum() / max(B, 1),
        # (a NaN lambda at a counted token, unvalidated input: whether it differs from 1 is unknown, so is the fraction)
        "conflict_frac": torch.where(m, torch.where(torch.isnan(lam), math.nan, (lam != 1).double()), 0.0).sum() / Mc,
        "mean_entropy": H.detach().sum() / Mc,
    }
    if rollout_logps is not None:  # spec 14: the rollout/training mismatch of the (replayed) logp
        metrics.update(fam.rollout_mismatch(logp, rollout_logps, m))
    return {
        "loss": loss,
        "per_token_loss": tok.detach(),
        "logps": logp.detach(),
        "entropy": H.detach(),
        "lam": lam.detach(),
        "n_conf": n_conf.detach(),
        "kept": kept,
        "seq_entropy": Hbar,
        "metrics": metrics,
    }
