"""GTPO inside OpenRLHF (0.11): a `PolicyLoss` replacement and the advantage-time step.

OpenRLHF has no loss registry: its actor (`ActorPPOTrainer.__init__`) builds the module-level name
`PolicyLoss` of `openrlhf.trainer.ray.ppo_actor` from `actor.eps_clip_low_high`, `actor.dual_clip`,
`actor.loss_agg_mode` and the IS-correction options, and `training_step` calls it as
`actor_loss_fn(log_probs, old_log_probs, advantages, action_mask=..., rollout_log_probs=...,
**loss_batch_info)`. `install()` rebinds that name (and the experience maker's class, below) in the
process that builds the actor, before it is built.

1. `GTPOPolicyLoss`, a subclass of OpenRLHF's `PolicyLoss` with the same constructor: for
   `policy_loss_type='ppo'` the per-token PPO clip is the package's PPO term on OpenRLHF's token
   advantages (`integrations.token_ppo`; the log-ratio clamped to [-20, 20] before exp, as OpenRLHF
   clamps it), then OpenRLHF's IS correction and `aggregate_loss` (token- or
   sequence-mean with the global batch info), as OpenRLHF does, its `dual_clip` (off by default)
   included; a log-prob of +-inf at a counted token is refused (the clamp would make it a finite
   ratio); `gspo` is left to OpenRLHF's own code.
2. `GTPOExperienceMaker`, OpenRLHF's `RemoteExperienceMaker` whose `compute_advantages_and_returns`
   runs OpenRLHF's estimator (e.g. `group_norm`) and then rewrites every experience's advantages with
   `gtpo_token_advantages` over the whole rollout batch: response ids (the last `action_mask.shape[1]`
   columns of `sequences`), `action_mask`, and the group of each sample, `index // n_samples_per_prompt`
   (OpenRLHF's own grouping of the rewards).

Exact: the conflict weights (spec 3) fold into the advantages exactly (lambda >= 0). OpenRLHF's
batch carries no entropies at advantage time, so the default configuration (`DEFAULT_CONFIG`) turns
the entropy filter and shaping off; a config that needs them is refused. The outcome advantages must
be one value per sample (KL in the reward, `algo.kl.use_loss=False`, makes them vary: refused).
"""
from __future__ import annotations

import torch

from ..api.advantages import gtpo_token_advantages
from ..core.config import GTPOConfig, as_config
from .token_ppo import token_config, token_ppo_losses

import openrlhf.models.loss as _loss  # noqa: E402  (OpenRLHF is required by this module)

DEFAULT_CONFIG = GTPOConfig.preset("gtpo", entropy_threshold=None, entropy_penalty=0.0)
LOG_RATIO_CLIP = 20.0  # OpenRLHF's PolicyLoss: ratio = exp(clamp(log r, -20, 20))


class GTPOPolicyLoss(_loss.PolicyLoss):
    """OpenRLHF's PolicyLoss with the package's PPO term (module docstring); same constructor."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.policy_loss_type == "ppo":  # checked here: the actor builds the loss once, at start
            self._token_cfg = token_config(self.clip_eps_low, self.clip_eps_high, self.dual_clip,
                                           ("clip_eps_low", "clip_eps_high", "dual_clip"))

    def forward(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, dp_size=1,
                batch_num_tokens=None, global_batch_size=None):
        if self.policy_loss_type != "ppo" or self.is_correction_level != "off":
            # GSPO and the IS correction: OpenRLHF's own code (it owns that math)
            return super().forward(log_probs, old_log_probs, advantages, action_mask, rollout_log_probs,
                                   dp_size, batch_num_tokens, global_batch_size)
        mask = action_mask if action_mask is not None else torch.ones_like(log_probs)
        loss = token_ppo_losses(log_probs, old_log_probs, advantages, mask, self._token_cfg,
                                LOG_RATIO_CLIP).to(log_probs.dtype)
        loss = _loss.aggregate_loss(loss, mask, token_level_loss=self.token_level_loss, dp_size=dp_size,
                                    batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)
        with torch.no_grad():
            log_ratio = log_probs - old_log_probs
            r = log_ratio.clamp(-LOG_RATIO_CLIP, LOG_RATIO_CLIP).exp()
            clipped = r.clamp(1 - self.clip_eps_low, 1 + self.clip_eps_high) * advantages < r * advantages
            clip_ratio = _loss.masked_mean(clipped.float(), action_mask, dim=None)
            ppo_kl = _loss.masked_mean(-log_ratio.detach(), action_mask, dim=None)
        return loss, clip_ratio, ppo_kl, None, None


def rewrite_advantages(experiences, n_samples_per_prompt, config=DEFAULT_CONFIG):
    """The advantage-time step on OpenRLHF's experiences (after its estimator, every sample's `index`
    set): each experience's advantages (B_e, A_e) become GTPO's token advantages, groups of
    `n_samples_per_prompt` by `index`. Returns metrics."""
    cfg = as_config(config)
    if cfg.shapes_advantages:
        raise ValueError("OpenRLHF carries no entropies at advantage time: use a GTPOConfig without the entropy "
                         "filter and shaping (entropy_threshold=None, entropy_penalty=0), e.g. DEFAULT_CONFIG")
    A = max(e.action_mask.shape[1] for e in experiences)

    def right_pad(x):  # (B_e, A_e) -> (B_e, A): OpenRLHF's response tensors start at column 0
        return torch.nn.functional.pad(x, (0, A - x.shape[1]))

    responses = torch.cat([right_pad(e.sequences[:, -e.action_mask.shape[1]:]) for e in experiences])
    mask = torch.cat([right_pad(e.action_mask.long()) for e in experiences]).bool()
    adv = torch.cat([right_pad(e.advantages) for e in experiences])
    index = torch.tensor([i for e in experiences for i in e.index], dtype=torch.long)
    tok = gtpo_token_advantages(adv, responses, mask, None, index // n_samples_per_prompt, config=cfg)
    changed = float(((tok.to(adv.dtype) != adv) & mask).sum() / mask.sum().clamp(min=1))
    start = 0
    for e in experiences:
        b, a = e.action_mask.shape
        e.advantages = tok[start:start + b, :a].to(e.advantages.dtype)
        start += b
    return {"gtpo/changed_frac": changed}


def _experience_maker_class():
    from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker

    class GTPOExperienceMaker(RemoteExperienceMaker):
        """OpenRLHF's experience maker with GTPO's advantage-time step (module docstring)."""

        gtpo_config = DEFAULT_CONFIG

        @torch.no_grad()
        def compute_advantages_and_returns(self, experiences):
            experiences = super().compute_advantages_and_returns(experiences)
            n = self.strategy.args.rollout.n_samples_per_prompt
            metrics = rewrite_advantages(experiences, n, self.gtpo_config)
            for e in experiences:
                e.info["gtpo_changed_frac"] = torch.full((len(e.index),), metrics["gtpo/changed_frac"])
            return experiences

    GTPOExperienceMaker.__qualname__ = "GTPOExperienceMaker"
    return GTPOExperienceMaker


def install(config=DEFAULT_CONFIG, *, policy_loss=True, experience_maker=True):
    """Make OpenRLHF build GTPO's loss and advantage step: rebinds `PolicyLoss` in the actor's module
    (`openrlhf.trainer.ray.ppo_actor`) and `RemoteExperienceMaker` in `openrlhf.trainer.ppo_trainer`,
    where OpenRLHF builds them. Call it in every process that builds an actor or the experience maker,
    before they are built. Returns the experience maker class (or None)."""
    cls = None
    if policy_loss:
        import openrlhf.trainer.ray.ppo_actor as ppo_actor
        ppo_actor.PolicyLoss = GTPOPolicyLoss
    if experience_maker:
        import openrlhf.trainer.ppo_trainer as ppo_trainer
        cls = _experience_maker_class()
        cls.gtpo_config = as_config(config)
        ppo_trainer.RemoteExperienceMaker = cls
    return cls


__all__ = ["GTPOPolicyLoss", "rewrite_advantages", "install", "DEFAULT_CONFIG"]
