"""GTPO inside TRL: `GTPOTrainer`, a `GRPOTrainer` whose loss is `gtpo_loss`.

    from gtpo_kernels.integrations.trl import GTPOTrainer, GTPOTrainerConfig

    args = GTPOTrainerConfig(output_dir="out", num_generations=8, max_completion_length=256,
                             loss_type="grpo",                     # TRL's loss type (any of them)
                             gtpo_loss="gtpo",                     # GTPO's parts on top of it (None: off)
                             gtpo_kwargs={"conflict_pos_weight": 2.0})  # any other GTPOConfig field
    trainer = GTPOTrainer(model=model, reward_funcs=reward_fn, args=args, train_dataset=ds,
                          processing_class=tokenizer)
    trainer.train()

What changes against the stock `GRPOTrainer` (everything else, generation, rewards, advantages,
vLLM, logging, checkpoints, is TRL's own):

1. Advantage time (`_generate_and_score_completions`): after TRL has computed the group advantages,
   and before it shuffles the batch and splits it into micro-batches, the conflict-token weights of
   spec section 3 are computed on whole groups with `conflict_weights` and stored in the batch
   (`gtpo_lam`, `gtpo_n_conf`), so they travel with their rows through the shuffle and the split.
   With several processes `conflict_weights(process_group=...)` gathers the groups' ids, mask and
   advantage signs over the processes (groups may straddle them) and returns this process's rows.
2. Loss (`_compute_loss`), with `gtpo_head="fused"` (the default): the model's forward runs the
   backbone only (a `gtpo_head=` mode patched onto the forward next to TRL's own fused head, in the
   same module: PEFT's base model, the model under its DDP / FSDP / DeepSpeed wrapper, so their hooks
   run), and inside it the hidden states of the T positions before each completion token (a view) and
   the LM head's weight and bias go to `linear_gtpo_loss`, which projects a tile of counted tokens at a
   time and never holds the (B, T, V) logits. The head is read as TRL's head reads it: looked up per
   call with `get_output_embeddings()` (tied embeddings: the shared matrix), an FSDP2 DTensor weight
   gathered with `full_tensor()`, a DeepSpeed ZeRO-3 one gathered by TRL's `maybe_gather_lm_head_ctx`
   (there only the schedule that forms the gradient in the forward can run: the other recomputes in
   the backward, after ZeRO-3 has re-partitioned the weight, and is refused), the config's
   `final_logit_softcapping` and logit scale (`logit_scale`, `output_multiplier`, `lm_head_multiplier`,
   `logits_scaling`), the compute dtype autocast's (float32 with `cast_lm_head_to_fp32`), and MoE
   router logits give TRL's load-balancing loss. Tiles hold at most TRL's 4096 x 32768 logits
   (`gtpo_memory_budget` changes it). `gtpo_head="logits"` keeps the materialized path for debugging:
   one forward with `logits_to_keep = T + 1`, then `gtpo_loss(logits, ..., logits_start=0)` on those
   logits as they are. Either way the loss is normalised and scaled for gradient accumulation exactly
   as TRL does it for the same loss type (see "Normalizers").
   Old-policy and reference passes (`_get_per_token_logps_and_entropies` under no_grad, text only):
   the same backbone-only forward and `linear_token_logprobs`, in TRL's row chunks; with a gradient,
   the MoE aux loss, multimodal inputs or `gtpo_head="logits"` they are TRL's own (its chunked head),
   except that with kept sets on `gtpo_head="logits"` runs the model's logits and `token_logprobs`, and
   the others are refused (TRL's would be over the whole vocabulary).
3. The sampler's distribution (spec 13; trl_sampler): GRPOConfig's `top_k`, `top_p`, `min_p` and
   `temperature` (`generation_kwargs` overriding each) go to every log-prob pass as the kept-set keywords
   (`sampler_settings`), or the sets a rollout_func recorded (`sampling_mask`) replace those rules.
4. Metrics, through the trainer's logger (averaged per logging step like TRL's): `entropy`
   (token mean, TRL's key), `gtpo/clip_frac`, `gtpo/filtered_frac`, `gtpo/conflict_frac`,
   `gtpo/mean_entropy`, `kl` when `beta > 0`, and when TRL keeps the engine's log-probs
   (`sampling_per_token_logps`) the rollout/training mismatch of the loss's log-probs (spec 14):
   `gtpo/rollout_k3`, `gtpo/rollout_abs_diff`, `gtpo/rollout_max_abs_diff`, `gtpo/rollout_outside_frac`,
   `gtpo/rollout_nan_frac` (means over all processes' tokens, the maximum over all processes), and when
   the loss replays kept sets (item 3) spec 13's `gtpo/mean_kept_size`, `gtpo/replay_restored_frac` and,
   with sets rebuilt by the sampler's rules, `gtpo/kept_mass` (means over all processes' counted tokens).

The loss: TRL's `loss_type` (the policy term, the ratio and the normalizer, as in the stock trainer) x
`gtpo_loss` (what GTPO adds on top: "gtpo", None, "gtpo-official"), `gtpo_kwargs` overriding any other
GTPOConfig field; the table, the fields TRL owns and the refusals are in trl_config's docstring.

Memory: with the fused head neither the stock trainer (TRL 1.16's chunked LM head) nor this adapter
holds the (B, T, V) logits; ours holds one tile of counted tokens at a time (at most TRL's tile) and
the float32 weight-gradient accumulator. On the tiny test model (V = 32000, D = 32, 8 x 64 completion
tokens, CPU) one step's peak is at most the stock trainer's (tests/test_trl_models.py measures both).
`gtpo_head="logits"` holds the logits once plus their gradient, and no other tokens x vocabulary
intermediate.

Tested with trl 1.16.0 / transformers 5.24.0 (see tests/test_trl_losses.py: every loss type and the
options above against the stock trainer's loss and gradients).

Layout: this module (the trainer and its config; re-exports `gtpo_config_from_args`, `TRL_LOSS_TYPES`,
`sampler_settings`), `trl_config` (TRL's config onto GTPOConfig, the refusals, the normalizers),
`trl_sampler` (the sampler's kept sets in every log-prob pass), `trl_forward` (the backbone-only forward:
the head's weight and scaling), `trl_head` (the loss and the old-policy / reference passes) and
`trl_metrics` (the metrics logged beyond TRL's own: spec 13's and 14's).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Optional, Union

import torch

try:
    from trl import GRPOConfig, GRPOTrainer
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("gtpo_kernels.integrations.trl needs TRL: pip install 'gtpo-kernels[trl]'") from e

from .. import conflict_weights
from .trl_config import (TRL_LOSS_TYPES, _loss_kwargs, _loss_mask, _normalizer, _refusals, _refuse_multimodal,
                         gtpo_config_from_args)
from .trl_forward import _add_gtpo_head, _base_model, _head_scaling  # noqa: F401  (_head_scaling: read here)
from .trl_head import _fused_logps_and_entropies, _fused_loss, _logits_logps_and_entropies, _logits_loss
from .trl_metrics import _log_clip_ratios, _log_mismatch, _log_replay, _logged_kl
from .trl_sampler import _pass_replays, _recorded_sets, _sampler_rules, sampler_settings

__all__ = ["GTPOTrainer", "GTPOTrainerConfig", "gtpo_config_from_args", "sampler_settings", "TRL_LOSS_TYPES"]

# TRL 1.16's _get_per_token_logps_and_entropies: (logps, entropies, aux_loss) with a compute_aux_loss flag;
# the old-policy / reference passes go through linear_token_logprobs only with that API
_TRL_LOGPS_API = "compute_aux_loss" in inspect.signature(
    GRPOTrainer._get_per_token_logps_and_entropies).parameters


@dataclasses.dataclass
class GTPOTrainerConfig(GRPOConfig):
    """TRL's `GRPOConfig` plus the GTPO options (see trl_config's docstring for how they combine).

    loss_type      TRL's loss type, as in GRPOConfig, but defaulting to "grpo" (the GTPO paper's
                   aggregation) instead of TRL's "dapo"
    gtpo_loss      what GTPO adds to TRL's loss type: "gtpo" (conflict weights and entropy control),
                   None (nothing: TRL's loss), "gtpo-official" (the authors' loss; loss_type="grpo"),
                   or TRL's loss_type name itself (= None)
    gtpo_kwargs    dict (or JSON string, for the command line) of GTPOConfig fields overriding those,
                   e.g. {"conflict_pos_weight": 2.0, "entropy_threshold": 0.7, "initial_entropy": 1.3};
                   the fields TRL owns are refused here (temperature, eps_low/eps_high, beta,
                   policy_loss/loss_agg, importance_sampling_level, delta, sapo_*, vespo_*,
                   use_bias_correction_kl, off_policy_mask_threshold, top_entropy_quantile): set TRL's
    gtpo_backend   'auto' (Triton on CUDA, chunked torch on CPU), 'triton' or 'torch'
    gtpo_validate  host-side input checks in gtpo_loss (one host sync per micro-batch); False skips them
    gtpo_head      'fused' (default): the backbone's hidden states and the LM head's weight go to
                   linear_gtpo_loss / linear_token_logprobs, the logits are never held; 'logits': the
                   model's own forward with logits_to_keep = T + 1 and gtpo_loss on its logits (for
                   debugging; it holds the (B, T + 1, V) logits and their gradient)
    gtpo_memory_budget  bytes of one tile of logits and its gradient in the fused head (None: as many
                   logits per tile as TRL's fused head, 4096 x 32768: 1 GiB in float32, 512 MiB in bf16)
    """

    loss_type: str = dataclasses.field(
        default="grpo", metadata={"help": "TRL's loss type: grpo (default here), bnpo, dr_grpo, dapo, cispo, "
                                          "sapo, luspo or vespo."})
    gtpo_loss: Optional[str] = dataclasses.field(
        default="gtpo", metadata={"help": "What GTPO adds to TRL's loss_type: gtpo (conflict weights and entropy "
                                          "control), None (nothing), or gtpo-official (the authors' loss)."})
    gtpo_kwargs: Optional[Union[dict, str]] = dataclasses.field(
        default=None, metadata={"help": "GTPOConfig fields overriding the preset (dict or JSON string)."})
    gtpo_backend: str = dataclasses.field(
        default="auto", metadata={"help": "gtpo_loss backend: auto, triton or torch."})
    gtpo_validate: bool = dataclasses.field(
        default=True, metadata={"help": "Host-side input checks in gtpo_loss."})
    gtpo_head: str = dataclasses.field(
        default="fused", metadata={"help": "fused (linear_gtpo_loss on the backbone's hidden states and the LM "
                                           "head's weight, no logits) or logits (the model's logits and gtpo_loss; "
                                           "for debugging)."})
    gtpo_memory_budget: Optional[int] = dataclasses.field(
        default=None, metadata={"help": "Bytes of one tile of logits and its gradient in the fused head "
                                        "(None: TRL's tile, 4096 x 32768 logits)."})


class GTPOTrainer(GRPOTrainer):
    """TRL's `GRPOTrainer` with `gtpo_loss` as its loss (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._gtpo_calls = 0  # number of gtpo_loss / linear_gtpo_loss calls, for tests and sanity checks
        self._gtpo_logprob_calls = 0  # old-policy / reference passes through linear_token_logprobs
        self._gtpo_setup()
        # The fused head goes into the same modules TRL gives its own fused head (PEFT: the base model;
        # the reference model under its DeepSpeed / FSDP / DDP wrapper), on top of TRL's patched forward
        _add_gtpo_head(_base_model(self.model))
        if self.ref_model is not None:
            _add_gtpo_head(_base_model(self.accelerator.unwrap_model(self.ref_model)))

    def _gtpo_setup(self):
        """(Re)reads the GTPO options from self.args: the GTPOConfig, the backend, the head, the refusals."""
        _refusals(self.args, self.accelerator)  # the settings we cannot honour
        self.gtpo_config = gtpo_config_from_args(self.args)
        self.gtpo_backend = getattr(self.args, "gtpo_backend", "auto")
        self.gtpo_validate = getattr(self.args, "gtpo_validate", True)
        head = getattr(self.args, "gtpo_head", "fused")
        if head not in ("fused", "logits"):
            raise ValueError(f"gtpo_head must be 'fused' or 'logits', got {head!r}")
        self.gtpo_head = head
        self.gtpo_memory_budget = getattr(self.args, "gtpo_memory_budget", None)
        self.gtpo_replay = _sampler_rules(self.args)  # the sampler's kept sets, rebuilt in every log-prob pass

    # ------------------------------------------------------------------ advantage time

    def _generate(self, prompts):
        """TRL's generation; a `sampling_mask` returned by the rollout_func (one (token_ids, offsets) per
        completion) is taken out of the reward functions' extra fields and kept for the log-prob passes."""
        out = super()._generate(prompts)
        rows = _recorded_sets(out)
        if rows is not None:
            self._gtpo_sampling_rows = rows
        return out

    def _generate_and_score_completions(self, inputs):
        self._gtpo_sampling_rows = None  # set by _generate when the rollout_func records the kept sets
        try:
            out = super()._generate_and_score_completions(inputs)
        finally:
            rows, self._gtpo_sampling_rows = getattr(self, "_gtpo_sampling_rows", None), None
        if rows is not None:
            out["sampling_mask"] = rows  # a list: TRL's shuffle and split carry it with its rows
        if self.gtpo_config.use_conflict_mask:
            mode = "train" if self.model.training else "eval"
            group = self.num_generations if mode == "train" else self.num_generations_eval
            lam, n_conf = self._gtpo_conflict_weights(out, group)
            out["gtpo_lam"], out["gtpo_n_conf"] = lam, n_conf
        return out

    def _gtpo_conflict_weights(self, batch, group_size):
        ids, mask, adv = batch["completion_ids"], _loss_mask(batch), batch["advantages"]
        group = None
        if self.accelerator.num_processes > 1:
            # TRL normalises rewards over all processes' completions and keeps this process's contiguous
            # slice (process_index * B ..., rank order), padded to this process's longest completion; a group
            # may straddle processes, so conflict_weights gathers the batch over the default process group
            # (ids, mask, advantage signs, in rank order) and returns this process's rows
            import torch.distributed as dist
            group = dist.group.WORLD
        return conflict_weights(ids, mask, adv, group_size, config=self.gtpo_config, process_group=group)

    # ------------------------------------------------------------------ the loss

    def _compute_loss(self, model, inputs):
        _refuse_multimodal(inputs)
        cfg = self.gtpo_config
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids = inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, inputs["completion_mask"]], dim=1)
        mask = _loss_mask(inputs)
        T = completion_ids.size(1)

        mode = "train" if self.model.training else "eval"
        num_items, scale = _normalizer(self, cfg, inputs, mode)
        loss_kw = _loss_kwargs(self, cfg, inputs, num_items)
        model_kwargs = dict(input_ids=input_ids, attention_mask=attention_mask)
        if self.aux_loss_enabled:
            model_kwargs["output_router_logits"] = True
        # the backbone with linear_gtpo_loss as its head, or (for debugging) the model's logits and gtpo_loss
        loss_fn = _fused_loss if self.gtpo_head == "fused" else _logits_loss
        out, outputs = loss_fn(self, model, model_kwargs, inputs, mask, T, loss_kw)
        self._gtpo_calls += 1
        loss = out.loss * scale
        if self.aux_loss_enabled:
            aux = outputs.aux_loss
            loss = loss + self.router_aux_loss_coef * aux / (self.current_gradient_accumulation_steps
                                                             if mode == "train" else 1.0)
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather(aux.detach()).mean().item())

        self._gtpo_log(mode, out, mask, inputs)
        return loss

    # ------------------------------------------------------------------ old-policy and reference passes

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args,
                                           **kwargs):
        """TRL's old-policy and reference log-probs (no gradient, text only) through the fused head
        (trl_head._fused_logps_and_entropies), or with gtpo_head='logits' and the sampler's kept sets on,
        the model's logits and token_logprobs (trl_head._logits_logps_and_entropies). With kept sets, both
        over the same sets as the loss (the sampler's top_k / top_p / min_p, or the rollout's recorded
        sampling_mask), and with gtpo_head='logits' at generation_kwargs' temperature where it is not
        args.temperature (TRL's pass divides by the latter). Anything else (a gradient, the MoE aux loss,
        multimodal inputs, gtpo_head='logits' without either, a TRL whose method differs from 1.16's) is TRL's
        own: refused with kept sets, where TRL's would be over the whole vocabulary."""
        others = {k: v for k, v in kwargs.items() if k not in ("batch_size", "compute_entropy", "compute_aux_loss")}
        rows = getattr(self, "_gtpo_sampling_rows", None)
        trl_own = bool(torch.is_grad_enabled() or args or kwargs.get("compute_aux_loss") or
                       any(v is not None for v in others.values()) or not _TRL_LOGPS_API)
        replay = _pass_replays(self, rows, input_ids.size(0), trl_own)  # refuses kept sets TRL's pass would drop
        # (generation_kwargs' temperature, which the loss and the sampler use, over TRL's args.temperature)
        tau = float(self.gtpo_config.temperature) != float(self.args.temperature)
        if not trl_own and (self.gtpo_head == "fused" or replay or tau):
            fn = _fused_logps_and_entropies if self.gtpo_head == "fused" else _logits_logps_and_entropies
            return fn(self, model, input_ids, attention_mask, logits_to_keep, kwargs.get("batch_size"),
                      kwargs.get("compute_entropy", False), rows)
        return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                          *args, **kwargs)

    def _gtpo_log(self, mode, out, mask, inputs):
        """Token- and completion-weighted means over all processes, appended to TRL's metric lists."""
        m = mask.to(torch.float32)
        n_tok = m.sum()
        n_seq = torch.tensor(float(m.size(0)), device=m.device)
        met = out.metrics
        stats = [met["mean_entropy"] * n_tok, met["clip_frac"] * n_tok, met["conflict_frac"] * n_tok,
                 met["filtered_frac"] * n_seq, n_tok, n_seq]
        counted = mask.bool()
        if self.gtpo_config.beta > 0:
            stats.insert(4, (_logged_kl(self.gtpo_config, out.logps, counted, inputs) * m).sum())
        s = self.accelerator.reduce(torch.stack([x.detach().float() for x in stats]), reduction="sum")
        tok, seq = s[-2].clamp(min=1.0), s[-1].clamp(min=1.0)
        ent = (s[0] / tok).item()
        self._metrics[mode]["entropy"].append(ent)
        self._metrics[mode]["gtpo/mean_entropy"].append(ent)
        self._metrics[mode]["gtpo/clip_frac"].append((s[1] / tok).item())
        self._metrics[mode]["gtpo/conflict_frac"].append((s[2] / tok).item())
        self._metrics[mode]["gtpo/filtered_frac"].append((s[3] / seq).item())
        if self.gtpo_config.beta > 0:
            self._metrics[mode]["kl"].append((s[4] / tok).item())
        _log_clip_ratios(self, mode, self.gtpo_config, out.logps, counted, inputs)
        if "rollout_k3" in met:
            _log_mismatch(self, mode, met, n_tok)
        _log_replay(self, mode, met, n_tok)  # the loss's kept-set metrics, when it replays kept sets

