"""verl's loss modes with GTPO on top, registered as `gtpo_<mode>` by the verl plugin (verl.py).

Each computes verl 0.9.1's mode of the same name with this package's objective (spec 9) on the token
advantages verl hands the loss, which the `gtpo` trainer has made GTPO's lambda * Ahat (conflict
weights and entropy control folded in at advantage time), with verl's settings and verl's `agg_loss`
(geo_mean: the mean over the micro-batch's completions, as verl). With plain advantages each equals
verl's own function. With GTPO's advantages the fold is exact where the term is positively homogeneous
in A (vanilla, gpg, dppo_tv, dppo_kl, cispo): then it equals gtpo_loss with the matching preset and
GTPO on top. For dro (its penalty is not scaled by lambda), geo_mean (the sign and the mean of
lambda * A), clip_cov and kl_cov (the covariance of lambda * A) it is verl's mode on GTPO's advantages.
clip_cov's choice draws from the device's default generator (torch.manual_seed reproduces it).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..core.config import GTPOConfig
from ..pipeline.token_terms import token_terms

# verl's mode -> this package's preset
MODES = {"vanilla": "vanilla", "gpg": "gpg", "dppo_tv": "dppo-tv", "dppo_kl": "dppo-kl", "dro": "dro",
         "cispo": "verl-cispo", "geo_mean": "geo-mean", "clip_cov": "clip-cov", "kl_cov": "kl-cov"}


def _or(x, default):
    return default if x is None else x


def mode_config(mode: str, config) -> GTPOConfig:
    """The GTPOConfig of verl's `mode` under verl's actor config (clip_ratio, clip_ratio_low/high,
    clip_ratio_c, policy_loss.*), with the defaults verl's functions fall back to."""
    if config is None:
        raise ValueError(f"the gtpo_{mode} policy loss needs the actor config")
    pl = getattr(config, "policy_loss", None)
    get = (lambda k: None) if pl is None else (lambda k: getattr(pl, k, None))
    over = dict(eps_low=_or(config.clip_ratio_low, config.clip_ratio),
                eps_high=_or(config.clip_ratio_high, config.clip_ratio),
                loss_agg="seq-mean-token-mean" if mode == "geo_mean" else "none")
    if mode == "vanilla":
        over["dual_clip_c"] = config.get("clip_ratio_c", 3.0)
    elif mode in ("dppo_tv", "dppo_kl"):
        over["dual_clip_c"] = config.get("clip_ratio_c", 20.0)
    elif mode == "dro":
        over["dro_beta"] = get("dro_beta")
    elif mode == "clip_cov":
        over.update(clip_cov_ratio=_or(get("clip_cov_ratio"), 2e-4), clip_cov_lb=_or(get("clip_cov_lb"), 1.0),
                    clip_cov_ub=_or(get("clip_cov_ub"), 5.0))
    elif mode == "kl_cov":
        over.update(kl_cov_ratio=_or(get("kl_cov_ratio"), 2e-4), ppo_kl_coef=_or(get("ppo_kl_coef"), 1.0))
    return GTPOConfig.preset(MODES[mode], **over)


def mode_loss(mode, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights,
              agg_loss, backend="auto"):
    """verl's policy-loss signature -> (loss, metrics); see the module docstring. The terms on the token
    advantages are pipeline.token_terms' (on CUDA the epilogue kernel, for every mode)."""
    cfg = mode_config(mode, config)
    w = None if rollout_is_weights is None else rollout_is_weights.to(log_prob.dtype)
    loss, clip_frac = token_terms(cfg, log_prob, old_log_prob, advantages, response_mask, w, backend)
    if cfg.loss_agg == "none":  # token-level terms: verl's aggregation of the per-token terms
        info = dict(getattr(config, "global_batch_info", None) or {})
        loss = agg_loss(loss_mat=loss, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **info)
    # (geo_mean: the mean over the completions, whatever loss_agg_mode says, as verl)
    return loss, mode_metrics(mode, cfg, log_prob, old_log_prob, advantages, response_mask, clip_frac)


def _masked_mean(x, mask):
    """verl's masked mean: the sum over the mask (values outside it not read) over its sum + 1e-8."""
    return torch.where(mask != 0, x, torch.zeros_like(x)).mul(mask).sum() / (mask.sum() + 1e-8)


def mode_metrics(mode, cfg, log_prob, old_log_prob, advantages, response_mask, clip_frac):
    """The metrics verl 0.9.1's `mode` logs, by its definitions, read in one host read: `actor/ppo_kl`
    (the mean of -log r, r clamped to [-20, 20] where the mode clamps it; kl_cov: of |log r|),
    `actor/pg_clipfrac` (the mode's clipped fraction: PPO's clip, dppo's trust region, cispo's clip,
    clip_cov's chosen tokens) and `actor/pg_clipfrac_lower` (vanilla's dual clip, dppo's truncation,
    geo_mean's clip where A < 0; 0 for cispo); gpg logs none, dro and kl_cov only ppo_kl."""
    if mode == "gpg":
        return {}
    with torch.no_grad():
        mask = response_mask.to(log_prob.dtype)
        A, lr = advantages.to(log_prob.dtype), (log_prob - old_log_prob).detach()
        if mode in ("vanilla", "dppo_tv", "dppo_kl", "cispo"):
            lr = lr.clamp(-20.0, 20.0)
        r = torch.exp(lr)
        out = {"actor/ppo_kl": _masked_mean(lr.abs() if mode == "kl_cov" else -lr, mask)}
        lo, hi = cfg.eps_low, cfg.eps_high
        if mode == "vanilla":
            l1, l2 = -A * r, -A * r.clamp(1 - lo, 1 + hi)
            out["actor/pg_clipfrac"] = _masked_mean((l2 > l1).to(mask.dtype), mask)
            lower = (torch.maximum(l1, l2) > -A * cfg.dual_clip_c) & (A < 0)
            out["actor/pg_clipfrac_lower"] = _masked_mean(lower.to(mask.dtype), mask)
        elif mode in ("dppo_tv", "dppo_kl"):
            p, q = torch.exp(log_prob.detach()), torch.exp(old_log_prob)
            if mode == "dppo_tv":
                valid = torch.where(A > 0, p - q <= hi, p - q >= -lo)
            else:
                kl = q * (old_log_prob - log_prob.detach()) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
                valid = torch.where(A > 0, (kl <= hi) | (p <= q), (kl <= lo) | (p >= q))
            valid = valid.to(mask.dtype)
            out["actor/pg_clipfrac"] = _masked_mean(1 - valid, mask)
            out["actor/pg_clipfrac_lower"] = _masked_mean((r > cfg.dual_clip_c).to(mask.dtype) * valid, mask)
        elif mode == "cispo":
            out["actor/pg_clipfrac"] = _masked_mean((r != r.clamp(1 - lo, 1 + hi)).to(mask.dtype), mask)
            out["actor/pg_clipfrac_lower"] = torch.zeros((), dtype=mask.dtype, device=mask.device)
        elif mode == "geo_mean":
            clipped = (lr != lr.clamp(-lo, hi)).to(mask.dtype)
            out["actor/pg_clipfrac"] = _masked_mean(clipped * (A > 0), mask)
            out["actor/pg_clipfrac_lower"] = _masked_mean(clipped * (A < 0), mask)
        elif mode == "clip_cov":
            out["actor/pg_clipfrac"] = clip_frac
        values = torch.stack([v.to(torch.float64) for v in out.values()]).tolist()  # sync: verl logs numbers
    return dict(zip(out, values))


def register_modes(register_policy_loss, agg_loss):
    """Registers `gtpo_<mode>` for each of verl's modes in MODES; returns {name: function}."""
    out = {}
    for mode in MODES:
        def fn(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
               response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Optional[Any] = None,
               rollout_is_weights: Optional[torch.Tensor] = None, _mode=mode):
            return mode_loss(_mode, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                             rollout_is_weights, agg_loss)
        fn.__name__ = fn.__qualname__ = f"compute_policy_loss_gtpo_{mode}"
        out[f"gtpo_{mode}"] = register_policy_loss(f"gtpo_{mode}")(fn)
    return out
