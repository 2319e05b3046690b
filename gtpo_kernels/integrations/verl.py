"""GTPO inside verl (0.9.1): a `verl.plugins` plugin, loaded by verl itself in every process.

`pip install gtpo-kernels[verl]` declares the entry point `verl.plugins: gtpo = gtpo_kernels.integrations.verl`;
`import verl` imports this module (verl swallows a plugin's import error at debug level: if the loss
mode `gtpo` is reported unsupported, `import gtpo_kernels.integrations.verl` shows why). Importing it
registers, through verl's own extension points (verl's code is patched only to replay the sampler's
kept sets, point 4):

1. The policy loss `gtpo` (`register_policy_loss`): the PPO clip `-min(r A, clip(r, 1 - eps_low,
   1 + eps_high) A)` on the token advantages, eps from the actor's `clip_ratio_low` / `clip_ratio_high`
   (`clip_ratio` by default), times verl's rollout-correction weights, aggregated with verl's
   `agg_loss` and the global batch info verl sets on the actor config (`dp_size`, `batch_num_tokens`,
   `global_batch_size`, `loss_scale_factor`), for any `loss_agg_mode`, with verl's dual clip as verl's
   `vanilla` mode applies it: where A < 0 the term is at most `-A clip_ratio_c` (the actor's
   `clip_ratio_c`, verl's default 3.0; it must be > 1; GTPOConfig's `dual_clip_c`). With GTPO's parts off
   it is verl's `vanilla`. verl's KL loss and entropy bonus are added by verl's `ppo_loss` around it, as
   for any loss mode.
2. The advantage-time step, the trainer mode `gtpo` (`register_trainer`): verl's synchronous v1
   trainer (`PPOTrainerSync`) whose `_compute_advantage` runs verl's own advantage estimator (GRPO,
   RLOO, ...: `algorithm.adv_estimator`) and then rewrites the advantages with
   `gtpo_token_advantages` from the rollout batch: `responses`, `response_mask`, the old policy's
   `entropy` and the group `uid`, rows in verl's order (it reorders rows to balance ranks and pads
   the batch with all-masked rows: both handled). verl's policy-loss registry never sees token ids
   nor entropies, so this is where the conflict weights (spec 3) and the entropy filter and shaping
   (spec 2) are computed; for lambda >= 0 they fold into the advantage exactly:
   `-lambda min(r A, clip(r) A) = -min(r (lambda A), clip(r) (lambda A))`, and the dual clip's
   `-lambda A c` bound (where A < 0) as well.

3. verl's loss modes with GTPO on top, `gtpo_<mode>` for `vanilla`, `gpg`, `dppo_tv`, `dppo_kl`, `dro`,
   `cispo`, `geo_mean`, `clip_cov`, `kl_cov` (verl_modes.py): the mode, computed by this package on the
   token advantages the `gtpo` trainer wrote, with verl's settings (`clip_ratio_*`, `clip_ratio_c`,
   `policy_loss.*`) and aggregation.

4. The sampler's distribution (spec 13), verl_replay.py: when the rollout truncates its sampling
   (`actor_rollout_ref.rollout.top_k` / `top_p`; `sampler_settings`), the `gtpo` trainer puts those rules
   in the batch of its three log-prob passes, and a guarded patch of verl 0.9.1's FSDP engine, installed
   at import (`ENGINE_REPLAY` says whether), computes their log-probs and entropies over the kept sets
   (`kept_set_logprobs`, `kept_set_entropy`). `+trainer.v1.gtpo.replay_sampler=false` turns it off.
5. The rollout/training mismatch measured (spec 14): when the rollout returns its log-probs
   (`actor_rollout_ref.rollout.calculate_log_probs=True`), the `gtpo` trainer's advantage step logs the
   old-policy pass against them (`mismatch_metrics`): `rollout_corr/rollout_k3`, `rollout_corr/rollout_abs_diff`,
   `rollout_corr/rollout_max_abs_diff`, `rollout_corr/rollout_outside_frac`, `rollout_corr/rollout_nan_frac`,
   beside verl's own `rollout_corr/` metrics.

The one approximation: the entropy filter and shaping use the entropies of the policy that computed
`old_log_probs` (verl's old-policy pass), not the current policy's. That is exact on the first
mini-batch of each batch (where the two policies are the same) and the authors' code detaches the
entropy as well; later mini-batches (`ppo_epochs > 1` or several mini-batches per batch) use the
entropies of the batch's start.

Select it (verl's Hydra config; `+` adds a key verl's YAML does not have):

    algorithm.adv_estimator=grpo
    trainer.use_v1=True trainer.v1.trainer_mode=gtpo
    actor_rollout_ref.actor.policy_loss.loss_mode=gtpo
    actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean
    +trainer.v1.gtpo.preset=gtpo                     # optional; any GTPOConfig field may follow:
    +trainer.v1.gtpo.entropy_threshold=0.7

`trainer.v1.gtpo` holds a GTPOConfig preset and field overrides; of it the conflict weights,
`entropy_threshold`, `initial_entropy`, `entropy_penalty` and, with `loss_agg: gtpo-official`, the
`1 / n_conf` factor are used. Clipping, KL, entropy bonus and aggregation are verl's settings: for the
paper's GTPO use `loss_agg_mode=seq-mean-token-mean` and `clip_ratio=0.2`; the authors' unclipped
loss is `clip_ratio_low=1.0 clip_ratio_high=1e9` (then clip(r) = r), whose sum over completions is
verl's seq-mean-token-mean times the global batch size (a constant factor).

Groups are the rows that share a `uid`; with multi-turn agent loops every output of a prompt's
sessions shares it, so this is meant for single-turn rollouts.
"""
from __future__ import annotations

import logging
import numbers
from typing import Any, Optional

import numpy as np
import torch

from ..api.advantages import batch_entropy, gtpo_token_advantages
from ..api.rollout import rollout_mismatch
from ..core.config import GTPOConfig, as_config
from .verl_modes import MODES, register_modes
# the kept-set replay (re-exported: the plugin's public names), its engine patch installed by this import
from .verl_replay import (ENGINE_REPLAY, REPLAY_KEYS, kept_set_entropy, kept_set_logprobs,  # noqa: F401
                          replay_rules_of, replay_sampler_from, sampler_settings)

import verl.utils.torch_functional as verl_F  # noqa: E402  (verl is required by this module)
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss  # noqa: E402

logger = logging.getLogger(__name__)

LOSS_MODE = "gtpo"
TRAINER_MODE = "gtpo"


@register_policy_loss(LOSS_MODE)
def compute_policy_loss_gtpo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Optional[Any] = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl policy loss `gtpo`: PPO clip with verl's dual clip on GTPO token advantages (see the module
    docstring).

    advantages (bs, response_length) are `gtpo_token_advantages` (written by the `gtpo` trainer);
    with plain GRPO advantages this is verl's `vanilla` mode.
    """
    if config is None:
        raise ValueError("the gtpo policy loss needs the actor config (clip_ratio, global_batch_info)")
    clip_ratio = config.clip_ratio
    eps_low = config.clip_ratio_low if config.clip_ratio_low is not None else clip_ratio
    eps_high = config.clip_ratio_high if config.clip_ratio_high is not None else clip_ratio
    clip_c = _dual_clip(config)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)  # as verl's vanilla loss
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    clipped = torch.maximum(loss1, loss2)  # -min(r A, clip(r) A)
    loss3 = -advantages * clip_c  # the dual clip: where A < 0, at most -c A (verl's vanilla)
    pg_losses = torch.where(advantages < 0, torch.minimum(loss3, clipped), clipped)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    info = dict(getattr(config, "global_batch_info", None) or {})
    pg_loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **info)
    with torch.no_grad():
        lower = torch.gt(clipped, loss3) * (advantages < 0)
        metrics = {
            "actor/pg_clipfrac": verl_F.masked_mean(torch.gt(loss2, loss1).float(), response_mask).item(),
            "actor/ppo_kl": verl_F.masked_mean(-log_ratio, response_mask).item(),
            "actor/pg_clipfrac_lower": verl_F.masked_mean(lower.float(), response_mask).item(),
        }
    return pg_loss, metrics


def _dual_clip(config) -> float:
    """The actor's clip_ratio_c as verl's vanilla mode reads it (default 3.0), checked: > 1."""
    c = config.get("clip_ratio_c", 3.0) if hasattr(config, "get") else getattr(config, "clip_ratio_c", 3.0)
    if isinstance(c, bool) or not isinstance(c, numbers.Real) or not c > 1.0:
        raise ValueError(f"actor clip_ratio_c must be a number > 1 (the dual clip's bound, as in verl's vanilla "
                         f"loss; a large value turns it off), got {c!r}")
    return float(c)


def gtpo_config_from(section) -> GTPOConfig:
    """`trainer.v1.gtpo` (None, a preset name, or a mapping {preset: ..., <GTPOConfig field>: ...})."""
    if section is None:
        return GTPOConfig.preset("gtpo")
    if isinstance(section, (str, GTPOConfig)):
        return as_config(section)
    try:
        from omegaconf import OmegaConf
        if OmegaConf.is_config(section):
            section = OmegaConf.to_container(section, resolve=True)
    except ImportError:  # pragma: no cover - verl depends on omegaconf
        pass
    fields = dict(section)
    fields.pop("replay_sampler", None)  # the trainer's switch (replay_sampler_from), not a GTPOConfig field
    return GTPOConfig.preset(fields.pop("preset", "gtpo"), **fields)


def rewrite_advantages(batch, uid, cfg) -> dict:
    """The advantage-time step on a padded batch (a TensorDict or dict of (bs, response_length)
    tensors: `advantages`, `responses`, `response_mask`, and `entropy` when the config's entropy
    control needs it; `uid` one key per row): replaces batch['advantages'] by GTPO's token advantages.
    Returns metrics."""
    for key in ("advantages", "responses", "response_mask"):
        if key not in batch.keys():
            raise KeyError(f"the GTPO advantage step needs '{key}' in the batch")
    entropy = batch_entropy(batch, cfg, "the GTPO advantage step needs the old policy's 'entropy' in the batch "
                            "(verl computes it with old_log_probs; rollout_correction.bypass_mode skips that pass): "
                            "disable the entropy filter and shaping (+trainer.v1.gtpo.entropy_threshold=null "
                            "+trainer.v1.gtpo.entropy_penalty=0) or recompute old_log_probs")
    adv = batch["advantages"]
    mask = batch["response_mask"]
    tok = gtpo_token_advantages(adv, batch["responses"], mask, entropy, uid, config=cfg)
    tok = tok.to(adv.dtype)
    m = mask.bool()
    n = m.sum().clamp(min=1)
    metrics = {"gtpo/changed_frac": float(((tok != adv) & m).sum() / n)}  # counted tokens GTPO reweighted
    batch["advantages"] = tok
    return metrics


register_modes(register_policy_loss, agg_loss)

def _rollout_logps_kept(config) -> bool:
    """Whether the rollout returns its log-probs (`actor_rollout_ref.rollout.calculate_log_probs`)."""
    from omegaconf import OmegaConf
    return bool(OmegaConf.select(config, "actor_rollout_ref.rollout.calculate_log_probs", default=False))


def mismatch_metrics(old_log_probs, rollout_log_probs, response_mask) -> dict:
    """Spec 14's rollout/training mismatch of the old-policy pass (the trainer's log-probs at the rollout's
    weights) against the engine's, under verl's `rollout_corr/` prefix: rollout_corr/rollout_k3,
    rollout_corr/rollout_abs_diff, rollout_corr/rollout_max_abs_diff, rollout_corr/rollout_outside_frac,
    rollout_corr/rollout_nan_frac (floats)."""
    got = rollout_mismatch(old_log_probs, rollout_log_probs, response_mask)
    return {f"rollout_corr/{k}": float(v) for k, v in got.items()}


# ------------------------------------------------------------------ the trainer mode

tq = None  # transfer_queue, once the trainer is registered (a module global: tests replace it)


def _register_trainer():
    """The trainer mode `gtpo`: needs verl's v1 trainer (TransferQueue and its server deps)."""
    global tq
    from tensordict import TensorDict
    import transfer_queue
    from verl.trainer.ppo.v1 import PPOTrainerSync, register_trainer
    from verl.workers.utils.padding import response_to_nested
    tq = transfer_queue

    @register_trainer(TRAINER_MODE)
    class GTPOTrainer(PPOTrainerSync):
        """verl's synchronous v1 trainer with GTPO's advantage-time step (module docstring)."""

        def _gtpo_config(self) -> GTPOConfig:
            cfg = getattr(self, "_gtpo_cfg", None)
            if cfg is None:
                cfg = self._gtpo_cfg = gtpo_config_from(self.config.trainer.v1.get("gtpo", None))
            return cfg

        def _gtpo_replay_info(self) -> dict:
            """The kept-set rules of the rollout's sampling, for the workers' log-prob passes (extra_info)."""
            info = getattr(self, "_gtpo_replay", None)
            if info is None:
                rules = {}
                if replay_sampler_from(self.config.trainer.v1.get("gtpo", None)):
                    s = sampler_settings(self.config.actor_rollout_ref.rollout)
                    rules = {REPLAY_KEYS[k]: s[k] for k in REPLAY_KEYS if s[k] is not None}
                    arr = self.config.actor_rollout_ref
                    strategies = {arr.get(role, {}).get("strategy", "fsdp") for role in ("actor", "ref")}
                    if rules and (not ENGINE_REPLAY or not strategies <= {"fsdp", "fsdp2"}):
                        raise RuntimeError(
                            "gtpo: the rollout truncates its sampling (" + ", ".join(
                                f"{k}={s[k]}" for k in REPLAY_KEYS if s[k] is not None) + ") but the engine "
                            f"(strategy {sorted(strategies)}) cannot replay kept sets: the plugin patches verl "
                            "0.9.1's FSDP engine only; set +trainer.v1.gtpo.replay_sampler=false to train on the "
                            "whole vocabulary")
                info = self._gtpo_replay = rules
            return info

        # the three log-prob passes: old policy (with the entropies GTPO's filter reads), reference, update
        def _compute_old_log_prob(self, batch, metrics: dict):
            batch.extra_info.update(self._gtpo_replay_info())
            return super()._compute_old_log_prob(batch, metrics)

        def _compute_ref_log_prob(self, batch, metrics: dict):
            batch.extra_info.update(self._gtpo_replay_info())
            return super()._compute_ref_log_prob(batch, metrics)

        def _update_actor(self, batch, metrics: dict):
            batch.extra_info.update(self._gtpo_replay_info())
            return super()._update_actor(batch, metrics)

        def _compute_advantage(self, batch, metrics: dict):
            batch = super()._compute_advantage(batch, metrics)
            cfg = self._gtpo_config()
            fields = ["uid", "responses", "response_mask", "advantages"] + (["entropy"] if cfg.shapes_advantages else [])
            measure = _rollout_logps_kept(self.config)
            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                   select_fields=fields + (["old_log_probs", "rollout_log_probs"] if measure else []))
            response_mask = data["response_mask"]  # nested (bs, response_len)
            padded = data.to_padded_tensor()
            if measure:  # spec 14: the old-policy pass against the engine's log-probs, same weights
                metrics.update(mismatch_metrics(padded.pop("old_log_probs"), padded.pop("rollout_log_probs"),
                                                padded["response_mask"]))
            uid = np.array(padded.pop("uid").tolist(), dtype=object)
            metrics.update(rewrite_advantages(padded, uid, cfg))
            out = TensorDict({"advantages": response_to_nested(padded["advantages"], response_mask)},
                             batch_size=len(batch))
            return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=out)

    GTPOTrainer.__qualname__ = "GTPOTrainer"  # the module-level name below (pickle, repr)
    return GTPOTrainer


try:
    GTPOTrainer = _register_trainer()
except ImportError as _e:  # verl's v1 trainer needs TransferQueue, fastapi, uvicorn, cachetools
    GTPOTrainer = None
    logger.debug("gtpo: verl's v1 trainer is not importable (%s); the trainer mode 'gtpo' is not registered", _e)

__all__ = ["compute_policy_loss_gtpo", "MODES", "rewrite_advantages", "gtpo_config_from", "replay_sampler_from",
           "sampler_settings", "kept_set_logprobs", "kept_set_entropy", "ENGINE_REPLAY", "GTPOTrainer", "LOSS_MODE",
           "TRAINER_MODE"]
