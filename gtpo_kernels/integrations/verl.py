"""GTPO inside verl (0.9.1): a `verl.plugins` plugin, loaded by verl itself in every process.

`pip install gtpo-kernels[verl]` declares the entry point `verl.plugins: gtpo = gtpo_kernels.integrations.verl`;
`import verl` imports this module (verl swallows a plugin's import error at debug level: if the loss
mode `gtpo` is reported unsupported, `import gtpo_kernels.integrations.verl` shows why). Importing it
registers, through verl's own extension points (verl is not patched):

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

4. The sampler's distribution (spec 13): when the rollout truncates its sampling
   (`actor_rollout_ref.rollout.top_k` / `top_p`; `sampler_settings`), the `gtpo` trainer puts those rules
   in the batch of its three log-prob passes (old policy, reference, actor update), and verl's FSDP
   engine computes each token's log-prob and entropy over the kept set rebuilt from its own
   temperature-scaled logits by vLLM's rules (`kept_set_logprobs`, `kept_set_entropy`). verl 0.9.1 has no
   hook for how the actor turns logits into log-probs, so this is a guarded patch: installed at import
   only on verl 0.9.1's `FSDPEngineWithLMHead` (`ENGINE_REPLAY` says whether), acting only on
   micro-batches that carry the rules (any other batch runs verl's code untouched), refused with the
   fused kernels, without remove-padding and with top-k distillation. `+trainer.v1.gtpo.replay_sampler=false`
   turns it off (the whole vocabulary, verl's behaviour).

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

import contextvars
import functools
import logging
import numbers
from typing import Any, Optional

import numpy as np
import torch

from ..api.advantages import gtpo_token_advantages
from ..core.config import GTPOConfig, as_config
from ..kernels.kept_set import kept_sets as _kept_sets
from ..kernels.replay import replay_logprobs as _replay_logprobs
from .verl_modes import MODES, register_modes

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


def replay_sampler_from(section) -> bool:
    """`trainer.v1.gtpo.replay_sampler` (default True): whether the `gtpo` trainer's log-prob passes are over
    the rollout's kept sets when its sampling truncates (top_k / top_p)."""
    if section is None or isinstance(section, (str, GTPOConfig)):
        return True
    value = section.get("replay_sampler", True)
    if not isinstance(value, bool):
        raise ValueError(f"trainer.v1.gtpo.replay_sampler must be true or false, got {value!r}")
    return value


def rewrite_advantages(batch, uid, cfg) -> dict:
    """The advantage-time step on a padded batch (a TensorDict or dict of (bs, response_length)
    tensors: `advantages`, `responses`, `response_mask`, and `entropy` when the config's entropy
    control needs it; `uid` one key per row): replaces batch['advantages'] by GTPO's token advantages.
    Returns metrics."""
    for key in ("advantages", "responses", "response_mask"):
        if key not in batch.keys():
            raise KeyError(f"the GTPO advantage step needs '{key}' in the batch")
    entropy = None
    if cfg.shapes_advantages:
        if "entropy" not in batch.keys():
            raise KeyError("the GTPO advantage step needs the old policy's 'entropy' in the batch (verl "
                           "computes it with old_log_probs; rollout_correction.bypass_mode skips that pass): "
                           "disable the entropy filter and shaping (+trainer.v1.gtpo.entropy_threshold=null "
                           "+trainer.v1.gtpo.entropy_penalty=0) or recompute old_log_probs")
        entropy = batch["entropy"].float()
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

# ------------------------------------------------------------------ the sampler's distribution (spec 13)

# the rules travel to the workers in the batch's extra_info (non-tensor data of every micro-batch)
REPLAY_KEYS = {"top_k": "gtpo_top_k", "top_p": "gtpo_top_p", "min_p": "gtpo_min_p"}


def sampler_settings(rollout) -> dict:
    """The distribution verl's rollout samples from, as the replay keywords: {temperature, top_k, top_p,
    min_p} from `actor_rollout_ref.rollout` (a RolloutConfig or its DictConfig section). A rule that is off
    is None: top_k -1 / 0 / None (vLLM's and HF's "off"), top_p 1.0, min_p None / 0.0 (verl 0.9.1 has no
    min_p field: read when a later verl has one). Bad values are refused naming the field."""
    def get(name, default=None):
        return rollout.get(name, default) if hasattr(rollout, "get") else getattr(rollout, name, default)

    t, k, p, mp = get("temperature", 1.0), get("top_k", -1), get("top_p", 1.0), get("min_p", None)
    where = "actor_rollout_ref.rollout."
    if isinstance(t, bool) or not isinstance(t, numbers.Real) or not t > 0:
        raise ValueError(f"{where}temperature must be a number > 0 to replay the sampler, got {t!r}")
    if k is not None and (isinstance(k, bool) or not isinstance(k, numbers.Real) or k != int(k) or k < -1):
        raise ValueError(f"{where}top_k must be an integer >= 1, or -1 / 0 for off, got {k!r}")
    if p is not None and (isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1):
        raise ValueError(f"{where}top_p must be in (0, 1] (1: off), got {p!r}")
    if mp is not None and (isinstance(mp, bool) or not isinstance(mp, numbers.Real) or not 0 <= mp < 1):
        raise ValueError(f"{where}min_p must be in [0, 1) (0: off), got {mp!r}")
    return dict(temperature=float(t), top_k=None if k is None or int(k) in (-1, 0) else int(k),
                top_p=None if p is None or p == 1 else float(p), min_p=None if not mp else float(mp))


def kept_set_logprobs(logits, labels, *, top_k=None, top_p=None, min_p=None, backend="auto"):
    """verl's `logprobs_from_logits` over the sampler's kept sets: logits (..., V) already divided by the
    temperature (as verl's engine hands them), labels (...) the tokens -> (logp, entropy) of labels' shape,
    each row's set rebuilt from its logits by vLLM's rules (spec 13; the label added back where float
    differences left it out). Differentiable w.r.t. logits (exactly 0 outside the sets)."""
    V = logits.shape[-1]
    flat = logits.reshape(1, -1, V)
    y = labels.reshape(-1).long()
    rows_b = torch.zeros_like(y)
    rows_t = torch.arange(y.numel(), device=y.device)
    token_ids, offsets, _, nonfinite, _ = _kept_sets(flat, rows_b, rows_t, y, 1.0, top_k, top_p, min_p)
    logp, ent, _ = _replay_logprobs(flat, rows_b, rows_t, y, 1.0, token_ids, offsets, nonfinite, backend=backend)
    return logp.reshape(labels.shape), ent.reshape(labels.shape)


def kept_set_entropy(logits, *, top_k=None, top_p=None, min_p=None, backend="auto", **_verl_kwargs):
    """verl's `entropy_from_logits` over each row's kept set (the rules' set: the row's largest logit, always
    kept, stands in for the label); extra keywords of verl's chunked variant (chunk_size) are ignored."""
    return kept_set_logprobs(logits, logits.detach().argmax(-1), top_k=top_k, top_p=top_p, min_p=min_p,
                             backend=backend)[1]


def replay_rules_of(data) -> Optional[dict]:
    """The kept-set rules a micro-batch carries (the `gtpo` trainer puts them in extra_info), or None."""
    from verl.utils import tensordict_utils as tu
    rules = {k: tu.get_non_tensor_data(data=data, key=key, default=None) for k, key in REPLAY_KEYS.items()}
    return {k: v for k, v in rules.items() if v is not None} or None


_ACTIVE = contextvars.ContextVar("gtpo_replay_rules", default=None)  # the rules of the micro-batch in flight


def _install_engine_replay() -> bool:
    """A guarded patch of verl 0.9.1's FSDP LM-head engine (verl has no hook for how the actor computes its
    log-probs): `FSDPEngineWithLMHead.prepare_model_outputs`, for a micro-batch carrying kept-set rules
    (replay_rules_of), computes the log-probs (the module's `logprobs_from_logits`) and entropies (the
    engine's `compute_entropy_from_logits`) over the kept sets; any other micro-batch runs verl's code
    untouched. Installed only when verl is 0.9.1 and those names are verl's own; returns whether it is."""
    try:
        import verl
        from verl.workers.engine.fsdp import transformer_impl as ti
    except Exception as e:  # pragma: no cover - an engine that does not import here (no FSDP)
        logger.debug("gtpo: verl's FSDP engine is not importable (%s); kept sets are not replayed", e)
        return False
    engine = getattr(ti, "FSDPEngineWithLMHead", None)
    if getattr(verl, "__version__", None) != "0.9.1" or engine is None or \
            getattr(ti, "logprobs_from_logits", None) is not verl_F.logprobs_from_logits or \
            not hasattr(engine, "prepare_model_outputs"):
        logger.debug("gtpo: not verl 0.9.1's FSDP engine; kept sets are not replayed")
        return False
    verl_logprobs = ti.logprobs_from_logits
    verl_outputs = engine.prepare_model_outputs

    def logprobs_from_logits(logits, labels, inplace_backward=True):
        rules = _ACTIVE.get()
        if rules is None:
            return verl_logprobs(logits=logits, labels=labels, inplace_backward=inplace_backward)
        return kept_set_logprobs(logits, labels, **rules)[0]

    @functools.wraps(verl_outputs)
    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        rules = replay_rules_of(micro_batch)
        if rules is None:
            return verl_outputs(self, output, output_args, micro_batch, logits_processor_func)
        from verl.utils import tensordict_utils as tu
        for key, default, why in (("use_fused_kernels", False, "the fused kernels compute log-probs without logits"),
                                  ("use_remove_padding", True, "the padded path computes entropies elsewhere"),
                                  ("distillation_use_topk", False, "distillation reads the logits")):
            if bool(tu.get_non_tensor_data(data=micro_batch, key=key, default=default)) != default:
                raise NotImplementedError(f"gtpo: the sampler's kept sets ({rules}) are replayed on verl's FSDP "
                                          f"engine with {key}={default} only ({why}); set it, or "
                                          f"+trainer.v1.gtpo.replay_sampler=false")
        token = _ACTIVE.set(rules)
        saved = self.__dict__.get("compute_entropy_from_logits")
        self.compute_entropy_from_logits = functools.partial(kept_set_entropy, **rules)
        try:
            return verl_outputs(self, output, output_args, micro_batch, logits_processor_func)
        finally:
            _ACTIVE.reset(token)
            if saved is None:
                del self.compute_entropy_from_logits
            else:
                self.compute_entropy_from_logits = saved

    ti.logprobs_from_logits = logprobs_from_logits
    engine.prepare_model_outputs = prepare_model_outputs
    return True


ENGINE_REPLAY = _install_engine_replay()  # whether verl's engine replays kept sets (in this process)

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
            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
            response_mask = data["response_mask"]  # nested (bs, response_len)
            padded = data.to_padded_tensor()
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
