"""The TRL adapter's configuration side (`gtpo_kernels.integrations.trl` re-exports the public names).

- `gtpo_config_from_args`: TRL's `GRPOConfig` fields and `loss_type`, with `gtpo_loss` / `gtpo_kwargs`,
  mapped onto the `GTPOConfig` the trainer uses (the fields TRL owns refused in gtpo_kwargs);
- `_refusals`, `_refuse_multimodal`: the TRL settings and inputs `GTPOTrainer` cannot honour;
- `_normalizer`: TRL's normalizer and gradient-accumulation scaling of each loss type;
- `_loss_kwargs`: the batch's old / reference log-probs, conflict weights, vLLM importance-sampling
  correction and kept sets (trl_sampler) as `gtpo_loss` arguments; `_loss_mask`: the completion mask
  times TRL's tool mask.

No TRL import: these read the config's and the trainer's fields. The rules:

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
as TRL does, over the completion's tokens only: TRL sums its log over every position, padding included,
so where the clip range excludes 1 and padding's ratio of 1 is clipped, TRL's VESPO weight differs) and
`sampling_per_token_logps` as `rollout_logps` (the sampling policy of the off-policy mask, as TRL's).

Refused, with an error naming them: TRL's own entropy bonus (`entropy_coef`, `use_adaptive_entropy`:
TRL adds it as a micro-batch token mean outside the loss type's normalizer, which the fused kernel
does not compute; use gtpo_kwargs={"entropy_coef": c}, aggregated like the loss),
importance_sampling_level="sequence" with cispo, sapo or vespo (gtpo_loss implements sequence-level
ratios for the PPO term only; TRL 1.16 accepts them, warning for cispo and vespo),
`top_entropy_quantile < 1` with more than one process (gtpo_loss takes the quantile over this process's
tokens, TRL over all processes), and multimodal inputs.
"""
from __future__ import annotations

import json

import torch

from .. import GTPOConfig
from .trl_sampler import _replay_kwargs, _sampler_refusals, sampler_settings

__all__ = ["TRL_LOSS_TYPES", "gtpo_config_from_args"]

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
_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
                    "num_images", "num_tiles", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def _norm(name):
    return name.strip().lower().replace("-", "_")


def gtpo_config_from_args(args) -> GTPOConfig:
    """The `GTPOConfig` a `GTPOTrainer` uses for TRL config `args` (a GTPOTrainerConfig, or a plain
    GRPOConfig, which then gets gtpo_loss="gtpo" on top of its loss_type). See the module docstring."""
    kwargs = _gtpo_kwargs(args)
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
    base = _trl_fields(args, kwargs)
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


def _gtpo_kwargs(args) -> dict:
    """args.gtpo_kwargs (a dict, a JSON object string or None) as a dict, without the fields TRL owns."""
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
    return kwargs


def _trl_fields(args, kwargs) -> dict:
    """The GTPOConfig fields TRL's config sets (and max_completion_length unless gtpo_kwargs sets it)."""
    eps_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    # getattr: an older TRL without an option behaves as its default
    opt = {f: getattr(args, f, default) for f, default in _TRL_OPTION_DEFAULTS.items()}
    base = dict(temperature=sampler_settings(args)["temperature"], eps_low=float(args.epsilon),
                eps_high=float(eps_high),
                beta=float(args.beta), importance_sampling_level=opt["importance_sampling_level"],
                use_bias_correction_kl=bool(opt["use_bias_correction_kl"]),
                top_entropy_quantile=float(opt["top_entropy_quantile"]),
                **{f: (None if opt[f] is None else float(opt[f])) for f in ("delta", "off_policy_mask_threshold")},
                **{f: float(opt[f]) for f in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
                                              "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")})
    if "max_completion_length" not in kwargs and args.max_completion_length is not None:
        base["max_completion_length"] = int(args.max_completion_length)
    return base


def _refusals(args, accelerator):
    """Raises for the TRL settings GTPOTrainer cannot honour, naming them all."""
    a = args
    bad = _sampler_refusals(a)
    if getattr(a, "entropy_coef", 0.0) != 0.0 or getattr(a, "use_adaptive_entropy", False):
        bad.append("TRL's entropy_coef / use_adaptive_entropy must be off (TRL adds its bonus as a "
                   "micro-batch token mean outside the loss normalizer, which gtpo_loss does not compute); "
                   "use gtpo_kwargs={'entropy_coef': c} for gtpo_loss's own bonus, aggregated like the loss")
    if getattr(a, "top_entropy_quantile", 1.0) < 1.0 and accelerator.num_processes > 1:
        bad.append("top_entropy_quantile < 1 needs a single process (gtpo_loss takes the entropy quantile "
                   "over this process's tokens, TRL over every process's)")
    if bad:
        raise ValueError("GTPOTrainer does not support these GRPOConfig settings: " + "; ".join(bad))


def _refuse_multimodal(inputs):
    present = [k for k in _MULTIMODAL_KEYS if inputs.get(k) is not None]
    if present:
        raise NotImplementedError(f"GTPOTrainer handles text-only batches; got {present}")


def _normalizer(trainer, cfg, inputs, mode):
    """(num_items_in_batch, scale) for one micro-batch: TRL's normalizer for the same loss type."""
    num_items, scale = None, 1.0
    if cfg.loss_agg == "token-mean" and _norm(str(trainer.args.loss_type)) in _GLOBAL_TOKEN_MEAN:
        # TRL's dapo/cispo/vespo: the generation batch's global token count, rescaled to one window
        num_items = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        if mode == "train":
            num_items = num_items * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
    elif cfg.loss_agg != "gtpo-official" and mode == "train":
        # means over this micro-batch -> mean over the accumulation window (TRL's grpo, bnpo, dr_grpo,
        # sapo, luspo scaling); 'gtpo-official' is a sum over completions, additive over micro-batches
        scale = 1.0 / trainer.current_gradient_accumulation_steps
    return num_items, scale


def _loss_kwargs(trainer, cfg, inputs, num_items):
    """The gtpo_loss / linear_gtpo_loss keyword arguments other than the tokens, advantages and mask
    (the temperature is cfg's: the sampler's)."""
    # vLLM importance-sampling correction: TRL's ratios (B, T) or (B, 1) multiply the policy term (VESPO
    # folds them into its weight); the engine's log-probs are the off-policy mask's sampling policy and,
    # whenever TRL kept them, what the rollout/training mismatch metrics compare against (spec 14)
    is_w = None
    if getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_importance_sampling_correction", False):
        is_w = inputs.get("importance_sampling_ratio")
    rollout_logps = inputs.get("sampling_per_token_logps")
    return dict(
        old_logps=inputs.get("old_per_token_logps"),
        ref_logps=inputs.get("ref_per_token_logps") if cfg.beta > 0 else None,
        lam=inputs.get("gtpo_lam") if cfg.use_conflict_mask else None,
        n_conf=inputs.get("gtpo_n_conf") if cfg.use_conflict_mask else None,
        config=cfg, num_items_in_batch=num_items, rollout_is_weights=is_w, rollout_logps=rollout_logps,
        validate=trainer.gtpo_validate, backend=trainer.gtpo_backend,
        **_replay_kwargs(trainer, inputs.get("sampling_mask"), inputs["completion_mask"], _loss_mask(inputs)))


def _loss_mask(batch) -> torch.Tensor:
    mask = batch["completion_mask"]
    tool_mask = batch.get("tool_mask")
    return mask if tool_mask is None else mask * tool_mask
