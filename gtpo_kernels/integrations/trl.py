"""GTPO inside TRL: `GTPOTrainer`, a `GRPOTrainer` whose loss is `gtpo_loss`.

    from gtpo_kernels.integrations.trl import GTPOTrainer, GTPOTrainerConfig

    args = GTPOTrainerConfig(output_dir="out", num_generations=8, max_completion_length=256,
                             gtpo_loss="gtpo",                     # a preset of spec section 5
                             gtpo_kwargs={"conflict_pos_weight": 2.0})  # any other GTPOConfig field
    trainer = GTPOTrainer(model=model, reward_funcs=reward_fn, args=args, train_dataset=ds,
                          processing_class=tokenizer)
    trainer.train()

What changes against the stock `GRPOTrainer` (everything else, generation, rewards, advantages,
old/reference passes, logging, checkpoints, is TRL's own):

1. Advantage time (`_generate_and_score_completions`): after TRL has computed the group advantages,
   and before it shuffles the batch and splits it into micro-batches, the conflict-token weights of
   spec section 3 are computed on whole groups with `conflict_weights` and stored in the batch
   (`gtpo_lam`, `gtpo_n_conf`), so they travel with their rows through the shuffle and the split.
   With several processes the completions are gathered first (groups may straddle processes).
2. Loss (`_compute_loss`): one forward of the policy with `logits_to_keep = T + 1`, then
   `gtpo_loss(logits, ..., logits_start=0)` on those logits as they are: no slice copy, no
   log_softmax over the vocabulary (the fused kernel computes log-probs, entropies and the gradient in
   place of it). The loss is scaled for gradient accumulation exactly as TRL scales its own.
3. Metrics, through the trainer's logger (averaged per logging step like TRL's): `entropy`
   (token mean, TRL's key), `gtpo/clip_frac`, `gtpo/filtered_frac`, `gtpo/conflict_frac`,
   `gtpo/mean_entropy`, and `kl` when `beta > 0`.

Options. The loss is `GTPOConfig.preset(args.gtpo_loss, **args.gtpo_kwargs)`, except for the knobs
the rest of the trainer must agree on, which always come from TRL's own fields: `temperature`
(sampling temperature = loss temperature), `epsilon` / `epsilon_high` (clip range), `beta` (whether
TRL loads a reference model) and `max_completion_length` (Dr. GRPO's denominator, unless given in
gtpo_kwargs). TRL's `loss_type` is not used: the aggregation is the preset's `loss_agg`
(`gtpo_loss="grpo"` reproduces TRL's `loss_type="grpo"`, `"dapo"` its `"dapo"` for the same
epsilons, `"dr_grpo"` its `"dr_grpo"`). TRL options that change the per-token loss in ways
`gtpo_loss` does not implement are refused with an error naming them (sequence-level importance
sampling, `top_entropy_quantile`, `off_policy_mask_threshold`, `delta`, TRL's `entropy_coef` (use
`gtpo_kwargs={"entropy_coef": ...}`), vLLM importance-sampling correction, `use_bias_correction_kl`)
and so are multimodal inputs.

Memory note: TRL's stock loss (1.16) computes log-probs from the hidden states with its own chunked
LM head and never holds the (B, T, V) logits; this adapter holds them once (plus their gradient)
because `gtpo_loss` takes logits. It never holds a log_softmax, a float32 copy or any other
tokens x vocabulary intermediate.

Tested with trl 1.16.0 / transformers 5.24.0 (see tests/test_integrations.py).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional, Union

import torch

try:
    from trl import GRPOConfig, GRPOTrainer
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("gtpo_kernels.integrations.trl needs TRL: pip install 'gtpo-kernels[trl]'") from e

from ..api import conflict_weights, gtpo_loss
from ..config import GTPOConfig

__all__ = ["GTPOTrainer", "GTPOTrainerConfig", "gtpo_config_from_args"]

# GTPOConfig fields that must come from TRL's config, so that sampling, clipping and the reference model agree
_TRL_OWNED = {"temperature": "temperature", "eps_low": "epsilon", "eps_high": "epsilon_high", "beta": "beta"}
_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
                    "num_images", "num_tiles", "token_type_ids", "mm_token_type_ids", "image_position_ids")


@dataclasses.dataclass
class GTPOTrainerConfig(GRPOConfig):
    """TRL's `GRPOConfig` plus the GTPO options.

    gtpo_loss      preset of `GTPOConfig.preset` ('gtpo', 'gtpo-official', 'grpo', 'dapo', 'dr_grpo')
    gtpo_kwargs    dict (or JSON string, for the command line) of GTPOConfig fields overriding the preset,
                   e.g. {"conflict_pos_weight": 2.0, "entropy_threshold": 0.7, "initial_entropy": 1.3};
                   temperature, eps_low, eps_high and beta are refused here: set TRL's temperature,
                   epsilon, epsilon_high, beta
    gtpo_backend   'auto' (Triton on CUDA, chunked torch on CPU), 'triton' or 'torch'
    gtpo_validate  host-side input checks in gtpo_loss (one host sync per micro-batch); False skips them
    """

    gtpo_loss: str = dataclasses.field(
        default="gtpo", metadata={"help": "GTPO preset: gtpo, gtpo-official, grpo, dapo or dr_grpo."})
    gtpo_kwargs: Optional[Union[dict, str]] = dataclasses.field(
        default=None, metadata={"help": "GTPOConfig fields overriding the preset (dict or JSON string)."})
    gtpo_backend: str = dataclasses.field(
        default="auto", metadata={"help": "gtpo_loss backend: auto, triton or torch."})
    gtpo_validate: bool = dataclasses.field(
        default=True, metadata={"help": "Host-side input checks in gtpo_loss."})


def gtpo_config_from_args(args) -> GTPOConfig:
    """The `GTPOConfig` a `GTPOTrainer` uses for TRL config `args` (a GTPOTrainerConfig, or a plain
    GRPOConfig, which then gets the 'gtpo' preset)."""
    kwargs = getattr(args, "gtpo_kwargs", None) or {}
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError as e:
            raise ValueError(f"gtpo_kwargs must be a dict or a JSON object string, got {kwargs!r}") from e
    if not isinstance(kwargs, dict):
        raise TypeError(f"gtpo_kwargs must be a dict or a JSON object string, got {type(kwargs).__name__}")
    for field, trl_field in _TRL_OWNED.items():
        if field in kwargs:
            raise ValueError(f"gtpo_kwargs[{field!r}] is not accepted: the trainer must agree on it, so set "
                             f"the TRL config's `{trl_field}` instead")
    eps_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    base = dict(temperature=float(args.temperature), eps_low=float(args.epsilon), eps_high=float(eps_high),
                beta=float(args.beta))
    if "max_completion_length" not in kwargs and args.max_completion_length is not None:
        base["max_completion_length"] = int(args.max_completion_length)
    cfg = GTPOConfig.preset(getattr(args, "gtpo_loss", "gtpo"), **{**base, **kwargs})
    if cfg.loss_agg == "none":
        raise ValueError("loss_agg='none' cannot be used in a trainer (it needs a scalar loss)")
    return cfg


class GTPOTrainer(GRPOTrainer):
    """TRL's `GRPOTrainer` with `gtpo_loss` as its loss (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gtpo_config = gtpo_config_from_args(self.args)
        self.gtpo_backend = getattr(self.args, "gtpo_backend", "auto")
        self.gtpo_validate = getattr(self.args, "gtpo_validate", True)
        self._gtpo_calls = 0  # number of gtpo_loss calls, for tests and sanity checks
        self._refuse_unsupported()

    # ------------------------------------------------------------------ options we cannot honour

    def _refuse_unsupported(self):
        a = self.args
        bad = []
        if getattr(a, "importance_sampling_level", "token") != "token":
            bad.append("importance_sampling_level must be 'token'")
        if getattr(a, "top_entropy_quantile", 1.0) < 1.0:
            bad.append("top_entropy_quantile must be 1.0")
        if getattr(a, "off_policy_mask_threshold", None) is not None:
            bad.append("off_policy_mask_threshold must be None")
        if getattr(a, "delta", None) is not None:
            bad.append("delta (two-sided clipping) must be None")
        if getattr(a, "entropy_coef", 0.0) != 0.0 or getattr(a, "use_adaptive_entropy", False):
            bad.append("TRL's entropy_coef / use_adaptive_entropy must be off; use "
                       "gtpo_kwargs={'entropy_coef': c} for gtpo_loss's own entropy bonus")
        if getattr(a, "use_vllm", False) and getattr(a, "vllm_importance_sampling_correction", False):
            bad.append("vllm_importance_sampling_correction must be False")
        if self.beta != 0.0 and getattr(a, "use_bias_correction_kl", False):
            bad.append("use_bias_correction_kl must be False")
        if bad:
            raise ValueError("GTPOTrainer does not support these GRPOConfig settings: " + "; ".join(bad))

    # ------------------------------------------------------------------ advantage time

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.gtpo_config.use_conflict_mask:
            mode = "train" if self.model.training else "eval"
            group = self.num_generations if mode == "train" else self.num_generations_eval
            lam, n_conf = self._gtpo_conflict_weights(out, group)
            out["gtpo_lam"], out["gtpo_n_conf"] = lam, n_conf
        return out

    def _gtpo_conflict_weights(self, batch, group_size):
        ids, mask, adv = batch["completion_ids"], _loss_mask(batch), batch["advantages"]
        acc = self.accelerator
        if acc.num_processes == 1:
            return conflict_weights(ids, mask, adv, group_size, config=self.gtpo_config)
        # TRL normalises rewards over all processes' completions and then keeps this process's slice;
        # a group may straddle two processes, so the weights are computed on the gathered batch.
        B, T = ids.shape
        ids_all = acc.gather(acc.pad_across_processes(ids, dim=1, pad_index=0))
        mask_all = acc.gather(acc.pad_across_processes(mask.to(torch.int32), dim=1, pad_index=0))
        adv_all = acc.gather(adv)
        lam, n_conf = conflict_weights(ids_all, mask_all, adv_all, group_size, config=self.gtpo_config)
        rows = slice(acc.process_index * B, (acc.process_index + 1) * B)
        return lam[rows, :T].contiguous(), n_conf[rows].contiguous()

    # ------------------------------------------------------------------ the loss

    def _compute_loss(self, model, inputs):
        present = [k for k in _MULTIMODAL_KEYS if inputs.get(k) is not None]
        if present:
            raise NotImplementedError(f"GTPOTrainer handles text-only batches; got {present}")
        cfg = self.gtpo_config
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids = inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, inputs["completion_mask"]], dim=1)
        mask = _loss_mask(inputs)
        T = completion_ids.size(1)

        # Logits of the last T + 1 positions: row t (the position before completion token t) predicts
        # completion token t; the last row predicts past the end and gets a zero gradient.
        model_kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=T + 1,
                            use_cache=False)
        if self.aux_loss_enabled:
            model_kwargs["output_router_logits"] = True
        with self.accelerator.autocast():
            outputs = model(**model_kwargs)
        logits = outputs.logits
        logits_start = logits.size(1) - T - 1  # 0 unless the model ignored logits_to_keep
        if logits_start < 0:
            raise RuntimeError(f"the model returned {logits.size(1)} logit rows for {T} completion tokens")

        mode = "train" if self.model.training else "eval"
        num_items, scale = None, 1.0
        if cfg.loss_agg == "token-mean":  # normalised by the window's global token count, as TRL's dapo
            num_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                num_items = num_items * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        elif cfg.loss_agg != "gtpo-official" and mode == "train":
            # means over this micro-batch -> mean over the accumulation window (TRL's grpo/dr_grpo scaling);
            # 'gtpo-official' is a sum over completions, additive over micro-batches as it is
            scale = 1.0 / self.current_gradient_accumulation_steps

        out = gtpo_loss(
            logits, completion_ids, inputs["advantages"], mask,
            old_logps=inputs.get("old_per_token_logps"),
            ref_logps=inputs.get("ref_per_token_logps") if cfg.beta > 0 else None,
            lam=inputs.get("gtpo_lam"), n_conf=inputs.get("gtpo_n_conf"),
            config=cfg, logits_start=logits_start, num_items_in_batch=num_items,
            validate=self.gtpo_validate, backend=self.gtpo_backend)
        self._gtpo_calls += 1
        loss = out.loss * scale
        if self.aux_loss_enabled:
            aux = outputs.aux_loss
            loss = loss + self.router_aux_loss_coef * aux / (self.current_gradient_accumulation_steps
                                                             if mode == "train" else 1.0)
            self._metrics[mode]["aux_loss"].append(self.accelerator.gather(aux.detach()).mean().item())

        self._gtpo_log(mode, out, mask, inputs)
        return loss

    def _gtpo_log(self, mode, out, mask, inputs):
        """Token- and completion-weighted means over all processes, appended to TRL's metric lists."""
        m = mask.to(torch.float32)
        n_tok = m.sum()
        n_seq = torch.tensor(float(m.size(0)), device=m.device)
        met = out.metrics
        stats = [met["mean_entropy"] * n_tok, met["clip_frac"] * n_tok, met["conflict_frac"] * n_tok,
                 met["filtered_frac"] * n_seq, n_tok, n_seq]
        if self.gtpo_config.beta > 0:
            ref = inputs["ref_per_token_logps"].to(out.logps.dtype)
            d = ref - out.logps
            stats.insert(4, ((torch.exp(d) - d - 1) * m).sum())
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


def _loss_mask(batch) -> torch.Tensor:
    mask = batch["completion_mask"]
    tool_mask = batch.get("tool_mask")
    return mask if tool_mask is None else mask * tool_mask
