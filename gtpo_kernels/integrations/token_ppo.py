"""The PPO clip on per-token advantages, for trainers whose policy loss receives (B, T) log-probs,
old log-probs and token advantages but neither token ids, entropies nor groups (SkyRL, OpenRLHF).

GTPO reaches such a loss through its advantages: `gtpo_token_advantages` folds the conflict weights
and the entropy filter and shaping into `lambda[i, t] * Ahat[i]` at advantage time (exact for
lambda >= 0). The policy loss is then the package's PPO term on those token advantages, computed by
`pipeline.token_terms` (each token's advantage in place of Ahat: the epilogue kernel on CUDA), GTPO's own
options off, and no aggregation: the trainer aggregates.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..pipeline.token_terms import token_terms
from ..core.config import GTPOConfig

_HAS_DUAL_CLIP = "dual_clip_c" in {f.name for f in dataclasses.fields(GTPOConfig)}


@contextlib.contextmanager
def peer_names(names):
    """A config the block builds from a trainer's settings refuses a value naming the trainer's setting
    too: names maps a GTPOConfig field to it ("GTPOConfig.eps_low" -> "eps_clip_low (GTPOConfig.eps_low)")."""
    try:
        yield
    except ValueError as e:
        said = str(e)
        for field, name in names.items():
            said = said.replace(f"GTPOConfig.{field} ", f"{name} (GTPOConfig.{field}) ")
        if said == str(e):
            raise
        raise ValueError(said) from None


def token_config(eps_low, eps_high, dual_clip_c=None, names=None) -> GTPOConfig:
    """The per-token PPO clip with the trainer's clip range (and dual clip, where the package has it);
    names: the trainer's names of eps_low, eps_high, dual_clip_c for its errors (peer_names)."""
    extra = {}
    if dual_clip_c is not None:
        if not _HAS_DUAL_CLIP:
            raise NotImplementedError("dual clip (a trainer's clip_ratio_c / dual_clip) is not available in this "
                                      "version of gtpo-kernels; turn it off in the trainer's config")
        extra["dual_clip_c"] = float(dual_clip_c)
    with peer_names(dict(zip(("eps_low", "eps_high", "dual_clip_c"), names or ()))):
        return GTPOConfig.preset("grpo", eps_low=float(eps_low), eps_high=float(eps_high), loss_agg="none", **extra)


def token_ppo_losses(logps, old_logps, token_advantages, mask, config: GTPOConfig, log_ratio_clip=None):
    """Per-token `-min(r a, clip(r) a)` (B, T) with `r = exp(logps - old_logps)`, 0 where `mask` is 0.

    logps (B, T) differentiable; old_logps, token_advantages (B, T); mask (B, T) of any dtype (nonzero =
    the token counts); config from `token_config`. Float32 (float64 for float64 logps). The arguments'
    shapes are checked, by name, in pipeline.token_terms. log_ratio_clip: c > 0 makes
    `r = exp(clamp(logps - old_logps, -c, c))`, the log-ratio's gradient 0 where it is clamped, as
    SkyRL's and OpenRLHF's PPO losses guard exp (c = 20 there); None: no clamp. A log-prob that is not finite
    is left as it is (the clamp would make +-inf a finite ratio): refused at a counted token, as any other.
    """
    if log_ratio_clip is not None:
        old = old_logps.detach().to(logps.dtype)
        logps = torch.where(torch.isfinite(logps), torch.clamp(logps, old - log_ratio_clip, old + log_ratio_clip),
                            logps)
    loss, _ = token_terms(config, logps, old_logps, token_advantages, mask, validate=True)
    return loss
