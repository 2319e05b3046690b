"""GTPO inside SkyRL (the `skyrl` package, 0.3): a registered policy loss and the advantage-time step.

Importing this module registers, through SkyRL's own extension points (SkyRL is not patched):

1. The policy loss `gtpo` in SkyRL's `PolicyLossRegistry` (the worker calls it as every loss:
   `loss_fn(log_probs, old_log_probs, advantages, config=..., loss_mask=..., rollout_logprobs=...)`):
   the PPO clip `-min(r a, clip(r, 1 - eps_clip_low, 1 + eps_clip_high) a)` per token on SkyRL's token
   advantages (the package's PPO term, `integrations.token_ppo`; the log-ratio clamped to [-20, 20]
   before exp, as SkyRL's `safe_exp_delta`), then SkyRL's off-policy correction
   (`algorithm.off_policy_correction`) and SkyRL's sum over `loss_mask` (SkyRL folds its loss
   reduction into the advantages beforehand, as for its own losses). With plain GRPO advantages it is
   SkyRL's `regular` loss. The loss `gtpo_dual_clip` adds SkyRL's dual clip (`clip_ratio_c`: the loss
   of a token with a negative advantage is at most `-A clip_ratio_c`): SkyRL's `dual_clip` loss.
2. The advantage-time step, `GTPOTrainer`: SkyRL's `RayPPOTrainer` whose
   `compute_advantages_and_returns` runs SkyRL's own estimator (`algorithm.advantage_estimator`, e.g.
   grpo) and then rewrites `data["advantages"]` with `gtpo_token_advantages` from the batch SkyRL
   carries: the response ids (the last `response_length` columns of `sequences`, SkyRL's right-aligned
   layout, left-aligned for the conflict weights), `loss_mask`, and the group `metadata["uids"]`.
   SkyRL's advantage-estimator registry is called without token ids, so the conflict weights cannot
   live there: the subclass overrides the trainer method that calls it, `compute_advantages_and_returns`.

What is exact: the conflict weights (spec 3) fold into the advantages exactly (lambda >= 0). What
SkyRL does not carry: per-token entropies. The entropy filter and shaping (spec 2) run only when the
batch holds the old policy's `entropy` (B, response_length), and the default configuration turns them
off (`DEFAULT_CONFIG`); with entropies supplied they are the old policy's, as in verl's adapter.

Use it (a SkyRL entry point; the trainer class replaces RayPPOTrainer where your script builds it):

    import gtpo_kernels.integrations.skyrl as gtpo_skyrl     # registers the loss `gtpo`
    # trainer.algorithm.policy_loss_type=gtpo  trainer.algorithm.advantage_estimator=grpo
    trainer = gtpo_skyrl.GTPOTrainer(cfg, ..., gtpo_config=gtpo_skyrl.DEFAULT_CONFIG)
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..api.advantages import batch_entropy, gtpo_token_advantages
from ..core.config import GTPOConfig, as_config
from .rows import first_counted, shift_left, shift_right
from .token_ppo import token_config, token_ppo_losses

from skyrl.backends.skyrl_train.utils import ppo_utils  # noqa: E402  (SkyRL is required by this module)
from skyrl.backends.skyrl_train.utils.off_policy_correction_utils import apply_off_policy_correction  # noqa: E402
from skyrl.backends.skyrl_train.utils.torch_utils import masked_mean  # noqa: E402

LOSS_NAME = "gtpo"
LOSS_NAME_DUAL_CLIP = "gtpo_dual_clip"
LOG_RATIO_CLIP = 20.0  # SkyRL's safe_exp_delta: r = exp(clamp(log r, -20, 20))
# GTPO's conflict weights; the entropy filter and shaping need entropies SkyRL's batch does not carry
DEFAULT_CONFIG = GTPOConfig.preset("gtpo", entropy_threshold=None, entropy_penalty=0.0)


def gtpo_policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, config,
                     loss_mask: Optional[torch.Tensor] = None, rollout_logprobs: Optional[torch.Tensor] = None,
                     dual_clip: bool = False):
    """SkyRL policy loss `gtpo` (module docstring): -> (loss, metrics) as SkyRL's losses return;
    dual_clip: with SkyRL's dual clip at config.clip_ratio_c (the loss `gtpo_dual_clip`)."""
    mask = loss_mask if loss_mask is not None else torch.ones_like(log_probs)
    cfg = token_config(config.eps_clip_low, config.eps_clip_high, config.clip_ratio_c if dual_clip else None,
                       ("eps_clip_low", "eps_clip_high", "clip_ratio_c"))
    loss = token_ppo_losses(log_probs, old_log_probs, advantages, mask, cfg, LOG_RATIO_CLIP).to(log_probs.dtype)
    with torch.no_grad():
        r = torch.exp((log_probs - old_log_probs).clamp(-LOG_RATIO_CLIP, LOG_RATIO_CLIP))
        clipped = (r * advantages > r.clamp(1 - config.eps_clip_low, 1 + config.eps_clip_high) * advantages)
        metrics = {"clip_ratio": masked_mean(clipped.float(), loss_mask).mean().item()}
    loss, loss_mask, off_policy = apply_off_policy_correction(loss, old_log_probs, rollout_logprobs, loss_mask,
                                                              config.off_policy_correction)
    metrics.update(off_policy)
    return ppo_utils.reduce_loss(loss, loss_mask), metrics


def rewrite_advantages(data, config=DEFAULT_CONFIG) -> dict:
    """The advantage-time step on SkyRL's TrainingInputBatch (after its estimator): replaces
    data["advantages"] (B, R) by GTPO's token advantages. Returns metrics.

    SkyRL right-aligns its response tensors (a row's response is its last response_len columns); GTPO's
    conflict weights align completions at their first token, so the rows are left-aligned for the call
    and shifted back. The counted tokens are `loss_mask` (within `response_mask`)."""
    cfg = as_config(config)
    adv = data["advantages"]
    response_mask = data["response_mask"]
    R = response_mask.shape[1]
    loss_mask = data["loss_mask"] if "loss_mask" in data.keys() else response_mask
    offset = first_counted(response_mask)  # the leading padding of each row

    def left(x):
        return shift_left(x, offset)

    responses = left(data["sequences"][:, -R:])  # response-level tensors are the last R columns of `sequences`
    entropy = batch_entropy(data, cfg, "this GTPOConfig's entropy filter or shaping needs the old policy's "
                            "'entropy' (B, response_length) in the batch, which SkyRL does not compute: add it, or "
                            "use gtpo_kernels.integrations.skyrl.DEFAULT_CONFIG (entropy_threshold=None, "
                            "entropy_penalty=0)")
    entropy = None if entropy is None else left(entropy)
    uids = np.array(list(data.metadata["uids"]), dtype=object)
    tok = gtpo_token_advantages(left(adv), responses, left(loss_mask), entropy, uids, config=cfg).to(adv.dtype)
    tok = shift_right(tok, offset)
    m = loss_mask != 0
    changed = float(((tok != adv) & m).sum() / m.sum().clamp(min=1))
    data["advantages"] = tok
    return {"gtpo/changed_frac": changed}


def gtpo_dual_clip_policy_loss(log_probs, old_log_probs, advantages, config, loss_mask=None, rollout_logprobs=None):
    """SkyRL policy loss `gtpo_dual_clip`: `gtpo` with SkyRL's dual clip (config.clip_ratio_c)."""
    return gtpo_policy_loss(log_probs, old_log_probs, advantages, config, loss_mask, rollout_logprobs, dual_clip=True)


def _register():
    if LOSS_NAME not in ppo_utils.PolicyLossRegistry.list_available():
        ppo_utils.register_policy_loss(LOSS_NAME)(gtpo_policy_loss)
    if LOSS_NAME_DUAL_CLIP not in ppo_utils.PolicyLossRegistry.list_available():
        ppo_utils.register_policy_loss(LOSS_NAME_DUAL_CLIP)(gtpo_dual_clip_policy_loss)


_register()


def _trainer_class():
    from skyrl.train.trainer import RayPPOTrainer

    class GTPOTrainer(RayPPOTrainer):
        """SkyRL's RayPPOTrainer with GTPO's advantage-time step (module docstring). `gtpo_config`: a
        GTPOConfig or preset name (default DEFAULT_CONFIG)."""

        def __init__(self, *args, gtpo_config=DEFAULT_CONFIG, **kwargs):
            super().__init__(*args, **kwargs)
            self.gtpo_config = as_config(gtpo_config)

        @torch.no_grad()
        def compute_advantages_and_returns(self, data):
            data = super().compute_advantages_and_returns(data)
            if getattr(self.cfg.generator, "step_wise_trajectories", False):
                raise NotImplementedError("GTPO's advantage step compares whole completions of a group: "
                                          "step-wise trajectories are not supported")
            cfg = getattr(self, "gtpo_config", DEFAULT_CONFIG)
            self.all_metrics.update(rewrite_advantages(data, cfg))
            return data

    GTPOTrainer.__qualname__ = "GTPOTrainer"
    return GTPOTrainer


GTPOTrainer = _trainer_class()

__all__ = ["gtpo_policy_loss", "gtpo_dual_clip_policy_loss", "rewrite_advantages", "GTPOTrainer", "DEFAULT_CONFIG",
           "LOSS_NAME", "LOSS_NAME_DUAL_CLIP"]
