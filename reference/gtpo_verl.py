"""verl 0.9.1's policy losses in the float64 reference (spec 9), each written as verl computes it.

verl source: verl/trainer/ppo/core_algos.py (verl 0.9.1): compute_policy_loss_vanilla (the dual clip),
_gpg, _dppo_tv, _dppo_kl, _dro, _cispo, _geo_mean, _clip_cov, _kl_cov. A is the token's advantage (Ahat of
its completion) as a (B, T) tensor, as verl's token advantages. Each returns the per-token term pg (B, T)
before lambda, masks and rollout weights (geo_mean folds the rollout weights in), and the tokens whose
gradient a clip, trust region or selection removed. Where the spec's table and verl differ, verl is
followed. It stands alone (no import of gtpo_kernels).
"""
from __future__ import annotations

import torch

VERL_POLICIES = ("gpg", "dppo-tv", "dppo-kl", "dro", "verl-cispo", "geo-mean", "clip-cov", "kl-cov")


def check_verl_args(policy_loss, loss_agg, dual_clip_c, dro_beta, clip_cov_ratio, clip_cov_lb, clip_cov_ub,
                    kl_cov_ratio, ppo_kl_coef):
    """The refusals of spec 9 for verl's modes, each a ValueError naming the argument."""
    if dual_clip_c is not None:
        if policy_loss in ("dppo-tv", "dppo-kl"):
            if not dual_clip_c > 0:
                raise ValueError(f"dual_clip_c must be > 0 (or None) with {policy_loss}, got {dual_clip_c!r}")
        elif policy_loss not in ("ppo", "clip-cov"):
            raise ValueError(f"dual_clip_c must be None with policy_loss={policy_loss!r}")
        elif not dual_clip_c > 1:  # verl asserts clip_ratio_c > 1
            raise ValueError(f"dual_clip_c must be > 1 (or None), got {dual_clip_c!r}")
    if policy_loss == "dro" and (dro_beta is None or not dro_beta > 0):
        raise ValueError(f"dro_beta must be > 0 with policy_loss='dro', got {dro_beta!r}")
    if not (clip_cov_ratio > 0 and kl_cov_ratio > 0 and ppo_kl_coef >= 0 and clip_cov_lb < clip_cov_ub):
        raise ValueError("clip_cov_ratio and kl_cov_ratio must be > 0, ppo_kl_coef >= 0, clip_cov_lb < clip_cov_ub")
    if policy_loss == "geo-mean" and loss_agg == "none":
        raise ValueError("loss_agg='none' is refused with policy_loss='geo-mean'")


def dual_clip(pg, A, c):
    """verl's dual clip (compute_policy_loss_vanilla): where A < 0, min(-A c, pg). -> (pg, removed)."""
    if c is None:
        return pg, torch.zeros_like(pg, dtype=torch.bool)
    pg3 = -A * c
    return torch.where(A < 0, torch.min(pg3, pg), pg), (A < 0) & (pg > pg3)


def _masked_mean(x, m):
    return (x * m).sum() / m.sum().clamp(min=1)


def policy_term(policy, logp, old, A, m, rollout_w, *, eps_low, eps_high, clip, delta, dual_clip_c, dro_beta,
                clip_cov_ratio, clip_cov_lb, clip_cov_ub, kl_cov_ratio, ppo_kl_coef, generator):
    """(pg (B, T), removed (B, T) bool) of verl's mode `policy` (see the module docstring)."""
    none = torch.zeros_like(logp, dtype=torch.bool)
    mf = m.double()
    log_ratio = logp - old
    if policy == "gpg":
        return -logp * A, none
    if policy == "dro":
        return -(logp * A - 0.5 * dro_beta * log_ratio.square()), none
    if policy == "verl-cispo":
        ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
        return -torch.clamp(ratio, 1 - eps_low, 1 + eps_high).detach() * A * logp, none
    if policy in ("dppo-tv", "dppo-kl"):
        ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
        truncated = (ratio if dual_clip_c is None else torch.clamp(ratio, max=dual_clip_c)).detach()
        prob, old_prob = torch.exp(logp), torch.exp(old)
        if policy == "dppo-tv":
            pos, neg = (prob - old_prob) <= eps_high, (prob - old_prob) >= -eps_low
        else:
            kl = old_prob * (old - logp) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
            pos, neg = (kl <= eps_high) | (prob <= old_prob), (kl <= eps_low) | (prob >= old_prob)
        valid = torch.where(A > 0, pos, neg).detach()
        return -A * truncated * logp * valid.double(), ~valid & (A != 0)
    if policy == "geo-mean":
        # verl: the sign-aware clip in log space, the ratio exp of the completion's mean, -mean_t(A) * ratio
        # per completion; here -A * ratio per token, which seq-mean-token-mean averages into verl's term
        sgn = torch.sign(A)
        clamped = torch.clamp(log_ratio, -eps_low, eps_high)
        y = sgn * torch.min(sgn * log_ratio, sgn * clamped)
        n = mf.sum(dim=1, keepdim=True).clamp(min=1)
        ratio = torch.exp((y * mf).sum(dim=1, keepdim=True) / n)
        if rollout_w is not None:  # verl: the geometric mean of (w + 1e-10) over the counted tokens
            lw = torch.log(rollout_w + 1e-10)
            ratio = ratio * (torch.exp(lw) if lw.shape[1] == 1 else torch.exp((lw * mf).sum(1, keepdim=True) / n))
        return -A * ratio, (sgn * log_ratio > sgn * clamped)
    ratio = torch.exp(log_ratio)  # clip-cov, kl-cov: no clamp (as verl)
    cov = (A - _masked_mean(A, mf)) * (logp.detach() - _masked_mean(logp.detach(), mf))
    if policy == "clip-cov":
        r1 = ratio if delta is None else torch.clamp(ratio, max=delta)
        pg = -r1 * A if not clip else torch.max(-r1 * A, -A * torch.clamp(ratio, 1 - eps_low, 1 + eps_high))
        clip_by_origin = (-A * torch.clamp(ratio, 1 - eps_low, 1 + eps_high) > -r1 * A) & m if clip else none
        pg, removed = dual_clip(pg, A, dual_clip_c)
        # the spec's draw: a uniform key per position (row-major, the generator's stream), the candidates
        # with the smallest keys chosen: a uniformly random subset of the given size
        candidates = m & ~clip_by_origin & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        keys = generator if isinstance(generator, torch.Tensor) else \
            torch.rand(logp.shape, dtype=torch.float64, device=logp.device, generator=generator)  # (or given)
        clip_num = max(int(clip_cov_ratio * float(mf.sum())), 1)
        idx = torch.nonzero(candidates)
        chosen = idx[torch.argsort(keys[candidates], stable=True)[:clip_num]]
        corr = torch.ones_like(pg)
        corr[chosen[:, 0], chosen[:, 1]] = 0.0
        return pg * corr, removed | (corr == 0)  # verl's pg_clipfrac: every chosen token, A = 0 included
    # kl-cov: -A * ratio, plus ppo_kl_coef * |log ratio| on the top tokens by covariance
    pg = -A * ratio
    if m.any():
        k = max(1, int(float(mf.sum()) * kl_cov_ratio))  # (past the counted tokens: all of them)
        idx = torch.nonzero(m)
        # the k largest covariances, ties by token position (a stable sort of the row-major order), as the spec
        top = idx[torch.argsort(cov[m], descending=True, stable=True)[:k]]
        extra = torch.zeros_like(pg)
        extra[top[:, 0], top[:, 1]] = 1.0
        pg = pg + extra * ppo_kl_coef * log_ratio.abs()
    return pg, none
