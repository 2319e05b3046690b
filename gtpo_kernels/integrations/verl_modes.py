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

import math
from typing import Any, Optional

import torch

from ..core.config import GTPOConfig
from ..core.layout import float_dtype_for
from ..kernels import dispatch
from ..pipeline.token_terms import token_terms
from .token_ppo import peer_names

# verl's mode -> this package's preset
MODES = {"vanilla": "vanilla", "gpg": "gpg", "dppo_tv": "dppo-tv", "dppo_kl": "dppo-kl", "dro": "dro",
         "cispo": "verl-cispo", "geo_mean": "geo-mean", "clip_cov": "clip-cov", "kl_cov": "kl-cov"}
# the modes whose verl function reads clip_ratio (low / high): the others never see it, so it is not checked
READS_CLIP = ("vanilla", "dppo_tv", "dppo_kl", "cispo", "geo_mean", "clip_cov")


def _or(x, default):
    return default if x is None else x


def mode_config(mode: str, config) -> GTPOConfig:
    """The GTPOConfig of verl's `mode` under verl's actor config (clip_ratio, clip_ratio_low/high where the mode
    reads them, clip_ratio_c, policy_loss.*), with the defaults verl's functions fall back to."""
    if config is None:
        raise ValueError(f"the gtpo_{mode} policy loss needs the actor config")
    pl = getattr(config, "policy_loss", None)
    get = (lambda k: None) if pl is None else (lambda k: getattr(pl, k, None))
    over = dict(loss_agg="seq-mean-token-mean" if mode == "geo_mean" else "none")
    if mode in READS_CLIP:
        over.update(eps_low=_or(config.clip_ratio_low, config.clip_ratio),
                    eps_high=_or(config.clip_ratio_high, config.clip_ratio))
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
    names = dict(eps_low="clip_ratio_low (or clip_ratio)", eps_high="clip_ratio_high (or clip_ratio)",
                 dual_clip_c="clip_ratio_c", **{k: f"policy_loss.{k}" for k in over if k.startswith(("clip_cov", "kl_cov"))},
                 dro_beta="policy_loss.dro_beta", ppo_kl_coef="policy_loss.ppo_kl_coef")
    with peer_names(names):
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
    return loss, mode_metrics(mode, cfg, log_prob, old_log_prob, advantages, response_mask, clip_frac, backend)


def _masked_mean(x, mask):
    """verl's masked mean: the sum over the mask (values outside it not read) over its sum + 1e-8."""
    return torch.where(mask != 0, x, torch.zeros_like(x)).mul(mask).sum() / (mask.sum() + 1e-8)


def mode_metrics(mode, cfg, log_prob, old_log_prob, advantages, response_mask, clip_frac, backend="auto"):
    """The metrics verl 0.9.1's `mode` logs, by its definitions, read in one host read: `actor/ppo_kl`
    (the mean of -log r, r clamped to [-20, 20] where the mode clamps it; kl_cov: of |log r|),
    `actor/pg_clipfrac` (the mode's clipped fraction: PPO's clip, dppo's trust region, cispo's clip,
    clip_cov's chosen tokens) and `actor/pg_clipfrac_lower` (vanilla's dual clip, dppo's truncation,
    geo_mean's clip where A < 0; 0 for cispo); gpg logs none, dro and kl_cov only ppo_kl. On Triton one
    launch (kernels/verl_metrics_triton.py); else the torch statement below, its twin."""
    if mode == "gpg":
        return {}
    names = ["actor/ppo_kl"]
    if mode not in ("dro", "kl_cov"):
        names.append("actor/pg_clipfrac")
    if mode not in ("dro", "kl_cov", "clip_cov"):
        names.append("actor/pg_clipfrac_lower")
    c = cfg.dual_clip_c if cfg.dual_clip_c is not None else 0.0
    if dispatch.resolve_backend(backend, log_prob.device, log_prob.dtype) == "triton" and log_prob.dtype != torch.float64:
        from ..kernels.verl_metrics_triton import verl_metrics
        v = verl_metrics(mode, log_prob, old_log_prob, advantages, response_mask, cfg.eps_low, cfg.eps_high, c,
                         clip_frac if mode == "clip_cov" else None).tolist()  # sync: verl logs numbers
        n = 4 * max((len(v) - (mode == "clip_cov")) // 4, 1)
        s = [math.fsum(v[k:n:4]) for k in range(4)]
        got = {"actor/ppo_kl": s[0], "actor/pg_clipfrac": s[1], "actor/pg_clipfrac_lower": s[2]}
        got = {k: x / (s[3] + 1e-8) for k, x in got.items()}
        if mode == "clip_cov":
            got["actor/pg_clipfrac"] = v[-1]
        return {k: got[k] for k in names}
    with torch.no_grad():  # (16-bit log-probs in float32, as the kernel: the backends log the same numbers)
        dt = float_dtype_for(log_prob)
        log_prob, old_log_prob = log_prob.detach().to(dt), old_log_prob.to(dt)
        mask = response_mask.to(dt)
        A, lr = advantages.to(dt), log_prob - old_log_prob
        if mode in ("vanilla", "dppo_tv", "dppo_kl", "cispo"):
            lr = lr.clamp(-20.0, 20.0)
        r = torch.exp(lr)
        lo, hi = cfg.eps_low, cfg.eps_high
        clip = lower = torch.zeros_like(r)
        if mode == "vanilla":
            l1, l2 = -A * r, -A * r.clamp(1 - lo, 1 + hi)
            clip, lower = l2 > l1, (torch.maximum(l1, l2) > -A * c) & (A < 0)
        elif mode in ("dppo_tv", "dppo_kl"):
            p, q = torch.exp(log_prob), torch.exp(old_log_prob)
            if mode == "dppo_tv":
                valid = torch.where(A > 0, p - q <= hi, p - q >= -lo)
            else:
                kl = q * (old_log_prob - log_prob) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
                valid = torch.where(A > 0, (kl <= hi) | (p <= q), (kl <= lo) | (p >= q))
            valid = valid.to(mask.dtype)
            clip, lower = 1 - valid, (r > c).to(mask.dtype) * valid
        elif mode == "cispo":
            clip = r != r.clamp(1 - lo, 1 + hi)
        elif mode == "geo_mean":
            cl = (lr != lr.clamp(-lo, hi)).to(mask.dtype)
            clip, lower = cl * (A > 0), cl * (A < 0)
        got = {"actor/ppo_kl": _masked_mean(lr.abs() if mode == "kl_cov" else -lr, mask),
               "actor/pg_clipfrac": clip_frac if mode == "clip_cov" else _masked_mean(clip.to(mask.dtype), mask),
               "actor/pg_clipfrac_lower": _masked_mean(lower.to(mask.dtype), mask)}
        values = torch.stack([got[k].to(torch.float64) for k in names]).tolist()  # sync: verl logs numbers
    return dict(zip(names, values))


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
