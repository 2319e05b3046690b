"""The verl plugin's replay of the sampler's distribution (spec 13): log-prob passes over the rollout's kept sets.

When the rollout truncates its sampling (`actor_rollout_ref.rollout.top_k` / `top_p`; `sampler_settings`),
the plugin's `gtpo` trainer (verl.py) puts those rules in the batch of its three log-prob passes (old
policy, reference, actor update; `REPLAY_KEYS`), and verl's FSDP engine computes each token's log-prob and
entropy over the kept set rebuilt from its own temperature-scaled logits by vLLM's rules
(`kept_set_logprobs`, `kept_set_entropy`). verl 0.9.1 has no hook for how the actor turns logits into
log-probs, so this is a guarded patch: installed when this module is imported (the plugin imports it) only
on verl 0.9.1's `FSDPEngineWithLMHead` (`ENGINE_REPLAY` says whether), acting only on micro-batches that
carry the rules (`replay_rules_of`; any other batch runs verl's code untouched), refused with the fused
kernels, without remove-padding and with top-k distillation. `+trainer.v1.gtpo.replay_sampler=false`
(`replay_sampler_from`) turns it off (the whole vocabulary, verl's behaviour).

`gtpo_kernels.integrations.verl` re-exports the public names.
"""
from __future__ import annotations

import contextvars
import functools
import logging
from typing import Optional

import torch

from ..core.config import GTPOConfig
from ..core.sampling import sampler_rules
from ..kernels.kept_set import kept_sets as _kept_sets, rows_per_block as _rows_per_block
from ..kernels.replay import replay_logprobs as _replay_logprobs

import verl.utils.torch_functional as verl_F  # noqa: E402  (verl is required by this module)

logger = logging.getLogger(__package__ + ".verl")  # the plugin's logger: these are the plugin's messages

__all__ = ["REPLAY_KEYS", "sampler_settings", "replay_sampler_from", "kept_set_logprobs", "kept_set_entropy",
           "replay_rules_of", "ENGINE_REPLAY"]

# the rules travel to the workers in the batch's extra_info (non-tensor data of every micro-batch)
REPLAY_KEYS = {"top_k": "gtpo_top_k", "top_p": "gtpo_top_p", "min_p": "gtpo_min_p"}


def replay_sampler_from(section) -> bool:
    """`trainer.v1.gtpo.replay_sampler` (default True): whether the `gtpo` trainer's log-prob passes are over
    the rollout's kept sets when its sampling truncates (top_k / top_p)."""
    if section is None or isinstance(section, (str, GTPOConfig)):
        return True
    value = section.get("replay_sampler", True)
    if not isinstance(value, bool):
        raise ValueError(f"trainer.v1.gtpo.replay_sampler must be true or false, got {value!r}")
    return value


def sampler_settings(rollout) -> dict:
    """The distribution verl's rollout samples from, as the replay keywords: {temperature, top_k, top_p,
    min_p} from `actor_rollout_ref.rollout` (a RolloutConfig or its DictConfig section). A rule that is off
    is None: top_k -1 / 0 / None (vLLM's and HF's "off"), top_p 1.0, min_p None / 0.0 (verl 0.9.1 has no
    min_p field: read when a later verl has one). Bad values are refused naming the field
    (core.sampling.sampler_rules)."""
    def get(name, default=None):
        return rollout.get(name, default) if hasattr(rollout, "get") else getattr(rollout, name, default)

    return sampler_rules(get("temperature", 1.0), get("top_k", -1), get("top_p", 1.0), get("min_p", None),
                         name="actor_rollout_ref.rollout.{}".format)


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
    """verl's `entropy_from_logits` over each row's kept set (the rules' set: `_kept_label`, always kept,
    stands in for the label); extra keywords of verl's chunked variant (chunk_size) are ignored."""
    return kept_set_logprobs(logits, _kept_label(logits), top_k=top_k, top_p=top_p, min_p=min_p,
                             backend=backend)[1]


def _kept_label(logits):
    """The id of each row's maximum, the highest one where it is tied: kept by every rule (min-p and top-k
    keep the maximum; top-p sorts ties by ascending id and always keeps the last), so never added back.
    A block of rows at a time (one reversed copy of a block, not of the logits)."""
    V = logits.shape[-1]
    rows = logits.detach().reshape(-1, V)
    last = [V - 1 - blk.flip(-1).argmax(-1) for blk in rows.split(_rows_per_block(V))]
    return torch.cat(last).reshape(logits.shape[:-1])  # (split gives one block even of no rows)


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
