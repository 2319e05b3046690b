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
   With several processes the completions are gathered first (groups may straddle processes).
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
   the MoE aux loss, multimodal inputs or `gtpo_head="logits"` they are TRL's own (its chunked head).
3. Metrics, through the trainer's logger (averaged per logging step like TRL's): `entropy`
   (token mean, TRL's key), `gtpo/clip_frac`, `gtpo/filtered_frac`, `gtpo/conflict_frac`,
   `gtpo/mean_entropy`, and `kl` when `beta > 0`.

The loss: TRL's `loss_type` x `gtpo_loss`. TRL's `loss_type` chooses the policy term, the ratio and
the normalizer, as in the stock trainer; `gtpo_loss` chooses what GTPO adds on top:

    gtpo_loss     the GTPOConfig
    None          GTPOConfig.preset(loss_type): TRL's loss exactly (GTPO parts off), through our kernel
    "gtpo"        the same, plus GTPO's conflict weights (w_pos 2.0, w_neg 0.0) and entropy control
                  (filter h_max = ln 2, shaping gamma = 0.1), e.g. loss_type="cispo" + gtpo_loss="gtpo"
                  is CISPO's policy term with conflict weights and entropy control (the default:
                  GTPOTrainerConfig's loss_type defaults to "grpo", so the default is the paper's GTPO)
    "gtpo-official"  the authors' own loss (unclipped surrogate, their sum-over-completions
                  aggregation, h_max 0.7); it replaces the loss type, so it needs loss_type="grpo"
    a TRL name    ("grpo", "dapo", ...) the same as None; it must equal loss_type (TRL's field names it)

    loss_type   policy_loss   normalizer (train; in eval the accumulation factors are 1)
    grpo        ppo           per-completion token means, mean over completions, / grad-accum steps
    bnpo        ppo           this micro-batch's token count, / grad-accum steps
    dr_grpo     ppo           B * max_completion_length, / grad-accum steps
    dapo        ppo           num_items_in_batch / num_processes * grad-accum steps / steps_per_generation
    cispo       cispo         as dapo
    sapo        sapo          as grpo
    luspo       ppo           per-completion token sums, mean over completions, / grad-accum steps
    vespo       vespo         as dapo
    (GSPO is loss_type="grpo" with importance_sampling_level="sequence".)

`gtpo_kwargs` then overrides any other GTPOConfig field (conflict weights, entropy_threshold,
initial_entropy, entropy_coef, clip, max_completion_length). The fields the trainer must agree on always
come from TRL's own fields and are refused in gtpo_kwargs: `temperature`, `epsilon` / `epsilon_high`
(eps_low / eps_high; with cispo epsilon_high is the ratio's absolute bound, 5.0 recommended), `beta`,
`loss_type` (policy_loss, loss_agg), `importance_sampling_level`, `delta`, `sapo_temperature_pos/neg`,
`vespo_k_pos`, `vespo_lambda_pos`, `vespo_k_neg`, `vespo_lambda_neg`, `use_bias_correction_kl`,
`off_policy_mask_threshold` and `top_entropy_quantile`. With vLLM importance-sampling correction
(`use_vllm=True`, `vllm_importance_sampling_correction=True`, any `vllm_importance_sampling_mode`) the
batch's `importance_sampling_ratio` is passed as `rollout_is_weights` (VESPO folds it into its weight,
as TRL does) and `sampling_per_token_logps` as `rollout_logps` (the sampling policy of the off-policy
mask, as TRL's).

Refused, with an error naming them: TRL's own entropy bonus (`entropy_coef`, `use_adaptive_entropy`:
TRL adds it as a micro-batch token mean outside the loss type's normalizer, which the fused kernel
does not compute; use gtpo_kwargs={"entropy_coef": c}, aggregated like the loss),
importance_sampling_level="sequence" with cispo, sapo or vespo (gtpo_loss implements sequence-level
ratios for the PPO term only; TRL 1.16 accepts them, warning for cispo and vespo),
`top_entropy_quantile < 1` with more than one process (gtpo_loss takes the quantile over this process's
tokens, TRL over all processes), and multimodal inputs.

Memory: with the fused head neither the stock trainer (TRL 1.16's chunked LM head) nor this adapter
holds the (B, T, V) logits; ours holds one tile of counted tokens at a time (at most TRL's tile) and
the float32 weight-gradient accumulator. On the tiny test model (V = 32000, D = 32, 8 x 64 completion
tokens, CPU) one step's peak is at most the stock trainer's (tests/test_integrations.py measures both).
`gtpo_head="logits"` holds the logits once plus their gradient, and no other tokens x vocabulary
intermediate.

Tested with trl 1.16.0 / transformers 5.24.0 (see tests/test_integrations.py: every loss type and the
options above against the stock trainer's loss and gradients).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import types
from contextlib import nullcontext
from typing import Any, Optional, Union

import torch

try:
    from trl import GRPOConfig, GRPOTrainer
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("gtpo_kernels.integrations.trl needs TRL: pip install 'gtpo-kernels[trl]'") from e

try:  # FSDP2 shards parameters as DTensors
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = ()
try:  # DeepSpeed ZeRO-3: gathers the head's partitioned weight for a direct read (TRL >= 1.16)
    from trl.trainer.utils import maybe_gather_lm_head_ctx
except ImportError:  # pragma: no cover - older TRL
    def maybe_gather_lm_head_ctx(*params):
        return nullcontext()

from .. import GTPOConfig, conflict_weights, gtpo_loss, linear_gtpo_loss, linear_token_logprobs

__all__ = ["GTPOTrainer", "GTPOTrainerConfig", "gtpo_config_from_args", "TRL_LOSS_TYPES"]

TRL_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
# GTPOConfig fields that must come from TRL's config, so that sampling, clipping, the reference model and
# TRL's own bookkeeping agree with the loss: GTPOConfig field -> TRL field
_TRL_OWNED = {"temperature": "temperature", "eps_low": "epsilon", "eps_high": "epsilon_high", "beta": "beta",
              "policy_loss": "loss_type", "loss_agg": "loss_type",
              "importance_sampling_level": "importance_sampling_level", "delta": "delta",
              "sapo_temperature_pos": "sapo_temperature_pos", "sapo_temperature_neg": "sapo_temperature_neg",
              "vespo_k_pos": "vespo_k_pos", "vespo_lambda_pos": "vespo_lambda_pos",
              "vespo_k_neg": "vespo_k_neg", "vespo_lambda_neg": "vespo_lambda_neg",
              "use_bias_correction_kl": "use_bias_correction_kl",
              "off_policy_mask_threshold": "off_policy_mask_threshold",
              "top_entropy_quantile": "top_entropy_quantile"}
# TRL options mapped one to one onto the GTPOConfig field of the same name, with TRL's defaults
_TRL_OPTION_DEFAULTS = {"importance_sampling_level": "token", "delta": None, "use_bias_correction_kl": False,
                        "off_policy_mask_threshold": None, "top_entropy_quantile": 1.0,
                        "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05, "vespo_k_pos": 2.0,
                        "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0}
# what gtpo_loss="gtpo" adds to a TRL loss type: the GTPO preset's values of these fields
_GTPO_PARTS = ("use_conflict_mask", "conflict_pos_weight", "conflict_neg_weight", "entropy_threshold",
               "entropy_penalty", "initial_entropy", "entropy_coef")
# loss types whose token-mean divides by TRL's num_items_in_batch (the window's global token count)
_GLOBAL_TOKEN_MEAN = ("dapo", "cispo", "vespo")
# TRL 1.16's _get_per_token_logps_and_entropies: (logps, entropies, aux_loss) with a compute_aux_loss flag;
# the old-policy / reference passes go through linear_token_logprobs only with that API
_TRL_LOGPS_API = "compute_aux_loss" in inspect.signature(
    GRPOTrainer._get_per_token_logps_and_entropies).parameters
_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
                    "num_images", "num_tiles", "token_type_ids", "mm_token_type_ids", "image_position_ids")


@dataclasses.dataclass
class GTPOTrainerConfig(GRPOConfig):
    """TRL's `GRPOConfig` plus the GTPO options (see the module docstring for how they combine).

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


def _norm(name):
    return name.strip().lower().replace("-", "_")


def gtpo_config_from_args(args) -> GTPOConfig:
    """The `GTPOConfig` a `GTPOTrainer` uses for TRL config `args` (a GTPOTrainerConfig, or a plain
    GRPOConfig, which then gets gtpo_loss="gtpo" on top of its loss_type). See the module docstring."""
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
    loss_type = _norm(str(args.loss_type))
    if loss_type not in TRL_LOSS_TYPES:
        raise ValueError(f"loss_type={args.loss_type!r}: GTPOTrainer knows TRL's {TRL_LOSS_TYPES}")
    name = getattr(args, "gtpo_loss", "gtpo")
    key = None if name is None or _norm(str(name)) in ("", "none") else _norm(str(name))
    if key is not None and key not in ("gtpo", "gtpo_official") + TRL_LOSS_TYPES:
        hint = " (GSPO is loss_type='grpo' with importance_sampling_level='sequence')" if key == "gspo" else ""
        raise ValueError(f"gtpo_loss={name!r}: expected 'gtpo', None, 'gtpo-official' or TRL's loss_type "
                         f"name{hint}")
    if key in TRL_LOSS_TYPES and key != loss_type:
        raise ValueError(f"gtpo_loss={name!r} but loss_type={args.loss_type!r}: TRL's loss_type names the loss "
                         f"type; set loss_type={key!r} and gtpo_loss=None (or 'gtpo' for GTPO's parts on top)")
    if key == "gtpo_official" and loss_type != "grpo":
        raise ValueError(f"gtpo_loss='gtpo-official' is the authors' whole loss (unclipped surrogate, their "
                         f"aggregation) and replaces the loss type: use it with loss_type='grpo', not "
                         f"{args.loss_type!r}; for GTPO's parts on top of {args.loss_type!r} use gtpo_loss='gtpo'")
    eps_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    # getattr: an older TRL without an option behaves as its default
    opt = {f: getattr(args, f, default) for f, default in _TRL_OPTION_DEFAULTS.items()}
    base = dict(temperature=float(args.temperature), eps_low=float(args.epsilon), eps_high=float(eps_high),
                beta=float(args.beta), importance_sampling_level=opt["importance_sampling_level"],
                use_bias_correction_kl=bool(opt["use_bias_correction_kl"]),
                top_entropy_quantile=float(opt["top_entropy_quantile"]),
                **{f: (None if opt[f] is None else float(opt[f])) for f in ("delta", "off_policy_mask_threshold")},
                **{f: float(opt[f]) for f in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
                                              "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")})
    if "max_completion_length" not in kwargs and args.max_completion_length is not None:
        base["max_completion_length"] = int(args.max_completion_length)
    if base["importance_sampling_level"] == "sequence" and loss_type in ("cispo", "sapo", "vespo"):
        raise ValueError(f"importance_sampling_level='sequence' with loss_type={args.loss_type!r} is not "
                         f"supported: gtpo_loss has sequence-level ratios for the PPO term only (TRL 1.16 "
                         f"accepts it); use importance_sampling_level='token'")
    if key == "gtpo_official":
        preset, parts = "gtpo-official", {}
    else:
        gtpo = GTPOConfig.preset("gtpo")
        preset = loss_type
        parts = {f: getattr(gtpo, f) for f in _GTPO_PARTS} if key == "gtpo" else {}
    cfg = GTPOConfig.preset(preset, **{**parts, **base, **kwargs})
    if cfg.loss_agg == "none":  # pragma: no cover - no TRL loss type maps to it
        raise ValueError("loss_agg='none' cannot be used in a trainer (it needs a scalar loss)")
    return cfg


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
        self._refuse_unsupported()
        self.gtpo_config = gtpo_config_from_args(self.args)
        self.gtpo_backend = getattr(self.args, "gtpo_backend", "auto")
        self.gtpo_validate = getattr(self.args, "gtpo_validate", True)
        head = getattr(self.args, "gtpo_head", "fused")
        if head not in ("fused", "logits"):
            raise ValueError(f"gtpo_head must be 'fused' or 'logits', got {head!r}")
        self.gtpo_head = head
        self.gtpo_memory_budget = getattr(self.args, "gtpo_memory_budget", None)

    # ------------------------------------------------------------------ options we cannot honour

    def _refuse_unsupported(self):
        a = self.args
        bad = []
        if getattr(a, "entropy_coef", 0.0) != 0.0 or getattr(a, "use_adaptive_entropy", False):
            bad.append("TRL's entropy_coef / use_adaptive_entropy must be off (TRL adds its bonus as a "
                       "micro-batch token mean outside the loss normalizer, which gtpo_loss does not compute); "
                       "use gtpo_kwargs={'entropy_coef': c} for gtpo_loss's own bonus, aggregated like the loss")
        if getattr(a, "top_entropy_quantile", 1.0) < 1.0 and self.accelerator.num_processes > 1:
            bad.append("top_entropy_quantile < 1 needs a single process (gtpo_loss takes the entropy quantile "
                       "over this process's tokens, TRL over every process's)")
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

        mode = "train" if self.model.training else "eval"
        num_items, scale = None, 1.0
        if cfg.loss_agg == "token-mean" and _norm(str(self.args.loss_type)) in _GLOBAL_TOKEN_MEAN:
            # TRL's dapo/cispo/vespo: the generation batch's global token count, rescaled to one window
            num_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                num_items = num_items * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        elif cfg.loss_agg != "gtpo-official" and mode == "train":
            # means over this micro-batch -> mean over the accumulation window (TRL's grpo, bnpo, dr_grpo,
            # sapo, luspo scaling); 'gtpo-official' is a sum over completions, additive over micro-batches
            scale = 1.0 / self.current_gradient_accumulation_steps

        # vLLM importance-sampling correction: TRL's ratios (B, T) or (B, 1) multiply the policy term (VESPO
        # folds them into its weight); the engine's log-probs are the off-policy mask's sampling policy
        is_w = None
        if getattr(self, "use_vllm", False) and getattr(self, "vllm_importance_sampling_correction", False):
            is_w = inputs.get("importance_sampling_ratio")
        rollout_logps = inputs.get("sampling_per_token_logps") if cfg.off_policy_mask_threshold is not None \
            else None
        loss_kw = dict(
            old_logps=inputs.get("old_per_token_logps"),
            ref_logps=inputs.get("ref_per_token_logps") if cfg.beta > 0 else None,
            lam=inputs.get("gtpo_lam") if cfg.use_conflict_mask else None,
            n_conf=inputs.get("gtpo_n_conf") if cfg.use_conflict_mask else None,
            config=cfg, num_items_in_batch=num_items, rollout_is_weights=is_w, rollout_logps=rollout_logps,
            validate=self.gtpo_validate, backend=self.gtpo_backend)

        model_kwargs = dict(input_ids=input_ids, attention_mask=attention_mask)
        if self.aux_loss_enabled:
            model_kwargs["output_router_logits"] = True
        if self.gtpo_head == "fused":
            # The backbone only; inside the model's forward (as TRL's fused head: FSDP / ZeRO-3 / DDP hooks
            # armed), the hidden states of the T positions before each completion token and the LM head's
            # weight go to linear_gtpo_loss, a tile of logits at a time
            fp32 = bool(getattr(self.args, "cast_lm_head_to_fp32", False))

            def head(hidden, weight, bias, logit_scale, logit_softcap):
                h = _completion_rows(hidden, T)
                h, w, b, no_autocast = _head_dtypes(h, weight, bias, fp32)
                dev = w.device
                budget = _memory_budget(self.gtpo_memory_budget, h, w)
                kw = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in loss_kw.items()}
                # ZeRO-3 re-partitions the weight after the forward: only the schedule that forms the
                # gradient in the forward can run there
                schedule = "fused" if _zero3() else "auto"
                try:
                    with no_autocast:
                        return linear_gtpo_loss(h, w, completion_ids.to(dev), inputs["advantages"].to(dev),
                                                mask.to(dev), bias=b, logit_scale=logit_scale,
                                                logit_softcap=logit_softcap, memory_budget=budget,
                                                schedule=schedule, **kw)
                except ValueError as e:
                    if schedule == "fused" and "schedule='fused'" in str(e):
                        raise ValueError("under DeepSpeed ZeRO-3 the fused LM head needs a loss whose gradient "
                                         "is formed in the forward (" + str(e) + "); set gtpo_head='logits' "
                                         "or raise gtpo_memory_budget") from e
                    raise

            with self.accelerator.autocast():
                outputs = model(**model_kwargs, gtpo_head=head)
            out = outputs.value
        else:
            # Logits of the last T + 1 positions: row t (the position before completion token t) predicts
            # completion token t; the last row predicts past the end and gets a zero gradient.
            with self.accelerator.autocast():
                outputs = model(**model_kwargs, logits_to_keep=T + 1, use_cache=False)
            logits = outputs.logits
            logits_start = logits.size(1) - T - 1  # 0 unless the model ignored logits_to_keep
            if logits_start < 0:
                raise RuntimeError(f"the model returned {logits.size(1)} logit rows for {T} completion tokens")
            out = gtpo_loss(logits, completion_ids, inputs["advantages"], mask, logits_start=logits_start,
                            **loss_kw)
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
        """TRL's old-policy and reference log-probs (no gradient, text only) through the fused head:
        linear_token_logprobs on the backbone's hidden states, chunked over rows as TRL does. Anything
        else (a gradient, the MoE aux loss, multimodal inputs, gtpo_head='logits', a TRL whose method
        differs from 1.16's) is TRL's own."""
        batch_size = kwargs.get("batch_size")
        compute_entropy = kwargs.get("compute_entropy", False)
        others = {k: v for k, v in kwargs.items() if k not in ("batch_size", "compute_entropy", "compute_aux_loss")}
        if self.gtpo_head != "fused" or torch.is_grad_enabled() or args or kwargs.get("compute_aux_loss") or \
                any(v is not None for v in others.values()) or not _TRL_LOGPS_API:
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              *args, **kwargs)
        fp32 = bool(getattr(self.args, "cast_lm_head_to_fp32", False))
        K = logits_to_keep
        batch_size = batch_size or input_ids.size(0)
        all_logps, all_ent = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids = input_ids[start:start + batch_size]
            am = attention_mask[start:start + batch_size]

            def head(hidden, weight, bias, logit_scale, logit_softcap, ids=ids, am=am):
                h, w, b, no_autocast = _head_dtypes(_completion_rows(hidden, K), weight, bias, fp32)
                dev = w.device
                with no_autocast:
                    return linear_token_logprobs(h, w, ids[:, -K:].to(dev), self.temperature, am[:, -K:].to(dev),
                                                 bias=b, logit_scale=logit_scale, logit_softcap=logit_softcap,
                                                 memory_budget=_memory_budget(self.gtpo_memory_budget, h, w),
                                                 validate=self.gtpo_validate, backend=self.gtpo_backend)

            with self.accelerator.autocast():
                lp, ent = model(input_ids=ids, attention_mask=am, gtpo_head=head).value
            self._gtpo_logprob_calls += 1
            all_logps.append(lp)
            all_ent.append(ent)
        return torch.cat(all_logps, 0), (torch.cat(all_ent, 0) if compute_entropy else None), None

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


# ---------------------------------------------------------------------- the fused head inside the model


class _HeadOutput:
    """What a forward with gtpo_head=fn returns: fn's result and the MoE load-balancing loss (or None).
    A plain object, so that wrappers converting output tensors (accelerate's fp32 outputs) leave it alone."""

    def __init__(self, value, aux_loss):
        self.value, self.aux_loss = value, aux_loss


def _base_model(model):
    """The module TRL patches with its fused head: PEFT's base model, else the model."""
    from accelerate.utils import is_peft_model
    return model.get_base_model() if is_peft_model(model) else model


def _head_scaling(text_config):
    """(logit_scale, logit_softcap) of a model's config, read as TRL 1.16's add_fused_lm_head reads them:
    Gemma's final_logit_softcapping; logit_scale, output_multiplier, lm_head_multiplier, or Granite /
    MiniCPM3's 1 / logits_scaling (HyperCLOVA X multiplies by it)."""
    cap = getattr(text_config, "final_logit_softcapping", None)
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        ls = text_config.logits_scaling
        scale = ls if getattr(text_config, "model_type", None) == "hyperclovax" else 1 / ls
    return (1.0 if scale is None else float(scale)), (None if cap is None else float(cap))


def _add_gtpo_head(model):
    """Patches model.forward (TRL's fused-head forward, or the model's own) so that
    `model(..., gtpo_head=fn)` runs the backbone only and returns `_HeadOutput(fn(hidden, weight, bias,
    logit_scale, logit_softcap), aux_loss)`: hidden the backbone's last hidden states (B, L, D) on the
    head's device, weight / bias the LM head's (an FSDP2 DTensor gathered with full_tensor, a ZeRO-3
    partitioned one gathered for the call), as TRL's fused head does. Without gtpo_head the previous
    forward runs (generation, TRL's own calls). Idempotent."""
    if getattr(model, "_gtpo_head_added", False):
        return
    import transformers
    from packaging.version import Version

    previous = model.forward
    text_config = model.config.get_text_config()
    logit_scale, logit_softcap = _head_scaling(text_config)
    # as TRL: before transformers 5, vision-language models expose their language backbone as `model`
    backbone_attr = "base_model"
    if text_config is not model.config and Version(transformers.__version__) < Version("5.0.0"):
        backbone_attr = "model"

    @functools.wraps(type(model).forward)  # keeps the signature: generate validates its kwargs against it
    def _gtpo_forward(self, *args, gtpo_head=None, **kwargs):
        if gtpo_head is None:
            return previous(*args, **kwargs)
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        backbone_out = getattr(self, backbone_attr)(*args, **kwargs)
        lm_head = self.get_output_embeddings()  # looked up per call: FSDP and PEFT replace modules
        weight, bias = lm_head.weight, lm_head.bias
        hidden = backbone_out.last_hidden_state.to(weight.device)
        if isinstance(weight, DTensor):  # FSDP2: gather the sharded head (differentiable)
            weight = weight.full_tensor()
            if bias is not None:
                bias = bias.full_tensor()
        with maybe_gather_lm_head_ctx(weight, bias):
            value = gtpo_head(hidden, weight, bias, logit_scale, logit_softcap)
        aux = None
        if kwargs.get("output_router_logits"):
            aux = _router_aux_loss(self, text_config, backbone_out.router_logits, kwargs.get("attention_mask"))
        return _HeadOutput(value, aux)

    model.forward = types.MethodType(_gtpo_forward, model)
    model._gtpo_head_added = True


def _router_aux_loss(model, text_config, router_logits, attention_mask):
    """The MoE load-balancing loss as TRL 1.16's fused head computes it (Mixtral's)."""
    import transformers
    from packaging.version import Version
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    v = Version(transformers.__version__)
    if v < Version("5.0.0") or (text_config.model_type == "gpt_oss" and v < Version("5.6.0")):
        num_experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
        num_experts = text_config.num_experts if num_experts is None else num_experts
        top_k = text_config.num_experts_per_tok if top_k is None else top_k
    else:
        num_experts, top_k = text_config.num_experts, text_config.num_experts_per_tok
    return load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)


def _completion_rows(hidden, T):
    """The rows predicting the last T tokens: positions L-T-1 .. L-2 of (B, L, D), a view."""
    L = hidden.size(1)
    if L < T + 1:
        raise RuntimeError(f"the backbone returned {L} positions for {T} completion tokens")
    return hidden[:, L - T - 1:L - 1]


def _head_dtypes(hidden, weight, bias, fp32):
    """The head's compute dtype, as TRL's fused head: float32 with cast_lm_head_to_fp32, else autocast's
    dtype when autocast is on, else the hidden states'. Returns hidden, weight, bias in it and a context
    that turns autocast off for the call (the kernels choose their own accumulation dtypes)."""
    dev = hidden.device.type
    on = torch.is_autocast_enabled(dev)
    dt = torch.float32 if fp32 else (torch.get_autocast_dtype(dev) if on else hidden.dtype)

    def cast(x):
        return x if x is None or x.dtype == dt else x.to(dt)
    return cast(hidden), cast(weight), cast(bias), (torch.autocast(dev, enabled=False) if on else nullcontext())


def _memory_budget(budget, hidden, weight):
    """gtpo_memory_budget, or by default TRL's fused-head tile (4096 tokens x min(V, 32768) vocabulary
    entries in the compute dtype) for the tile and its gradient: no tile holds more logits than TRL's."""
    if budget is not None:
        return int(budget)
    try:
        from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE as tokens
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as vocab
    except ImportError:  # pragma: no cover - another TRL: its 1.16 values
        tokens, vocab = 4096, 32768
    return 2 * int(tokens) * min(int(vocab), weight.shape[0]) * hidden.element_size()


def _zero3():
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:  # pragma: no cover
        return False
    return bool(is_deepspeed_zero3_enabled())


def _loss_mask(batch) -> torch.Tensor:
    mask = batch["completion_mask"]
    tool_mask = batch.get("tool_mask")
    return mask if tool_mask is None else mask * tool_mask
