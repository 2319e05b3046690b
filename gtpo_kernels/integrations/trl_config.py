"""The TRL adapter's configuration side (`gtpo_kernels.integrations.trl` re-exports the public names).

- `gtpo_config_from_args`: TRL's `GRPOConfig` fields and `loss_type`, with `gtpo_loss` / `gtpo_kwargs`,
  mapped onto the `GTPOConfig` the trainer uses (the fields TRL owns refused in gtpo_kwargs);
- `_refusals`, `_refuse_multimodal`: the TRL settings and inputs `GTPOTrainer` cannot honour;
- `_normalizer`: TRL's normalizer and gradient-accumulation scaling of each loss type;
- `_loss_kwargs`: the batch's old / reference log-probs, conflict weights and vLLM importance-sampling
  correction as `gtpo_loss` arguments; `_loss_mask`: the completion mask times TRL's tool mask;
- `sampler_settings`, `_replay_kwargs`, `_flat_sampling_mask`: the sampler's distribution (spec 13):
  GRPOConfig's temperature, top_k, top_p, min_p (generation_kwargs overriding them, as in TRL's
  generation) and a recorded sampling mask as the replay keywords of every log-prob pass.

No TRL import: these read the config's and the trainer's fields. The rules are in the docstring of
`gtpo_kernels.integrations.trl`.
"""
from __future__ import annotations

import json
import math
import numbers

import torch

from .. import GTPOConfig

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


# the sampler settings TRL hands both generators (vLLM's SamplingParams, transformers' GenerationConfig);
# generation_kwargs overrides them there (TRL: "they will override them"), and so here
_SAMPLER_FIELDS = ("temperature", "top_k", "top_p", "min_p")


def _generation_kwargs(args) -> dict:
    gen = getattr(args, "generation_kwargs", None) or {}
    if isinstance(gen, str):  # GRPOConfig parses a JSON string itself; a config built otherwise may not
        gen = json.loads(gen)
    return dict(gen)


def sampler_settings(args) -> dict:
    """The distribution TRL's generation samples from, as the replay keywords (spec 13): {temperature,
    top_k, top_p, min_p} from GRPOConfig's fields of those names, generation_kwargs' entries overriding
    them (as TRL passes them to vLLM and to transformers' generate). A rule that is off is None: top_k
    None / 0 / -1 (TRL's and vLLM's "off"), top_p None / 1.0, min_p None / 0.0. Bad values are refused
    naming the field."""
    gen = _generation_kwargs(args)
    raw = {f: gen[f] if f in gen else getattr(args, f, None) for f in _SAMPLER_FIELDS}

    def where(f):
        return f"generation_kwargs[{f!r}]" if f in gen else f"GRPOConfig.{f}"

    t = raw["temperature"]
    if isinstance(t, bool) or not isinstance(t, numbers.Real) or not (math.isfinite(t) and t > 0):
        raise ValueError(f"{where('temperature')} must be a number > 0 (the sampler's temperature), got {t!r}")
    k = raw["top_k"]
    if k is not None and (isinstance(k, bool) or not isinstance(k, numbers.Real) or k != int(k)):
        raise ValueError(f"{where('top_k')} must be an integer (0 or -1: off), got {k!r}")
    if k is not None and int(k) < -1:
        raise ValueError(f"{where('top_k')} must be >= 1, or 0 / -1 / None for off, got {k!r}")
    p, mp = raw["top_p"], raw["min_p"]
    if p is not None and (isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1):
        raise ValueError(f"{where('top_p')} must be in (0, 1] (1: off), got {p!r}")
    if mp is not None and (isinstance(mp, bool) or not isinstance(mp, numbers.Real) or not 0 <= mp < 1):
        raise ValueError(f"{where('min_p')} must be in [0, 1) (0 or None: off), got {mp!r}")
    return dict(temperature=float(t),
                top_k=None if k is None or int(k) in (0, -1) else int(k),
                top_p=None if p is None or p == 1 else float(p),
                min_p=None if mp is None or mp == 0 else float(mp))


def _sampler_refusals(args) -> list:
    """The sampler settings whose kept sets cannot be rebuilt as the generator built them."""
    s = sampler_settings(args)
    if not getattr(args, "use_vllm", False) and s["min_p"] is not None and s["top_p"] is not None:
        return ["min_p together with top_p < 1 under transformers' generate (use_vllm=False): it applies "
                "min-p after top-p, where vLLM (whose order the replay follows: min-p, top-k, top-p) applies "
                "it first, and the kept sets differ; set one of the two, or generate with vLLM"]
    return []


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
    # folds them into its weight); the engine's log-probs are the off-policy mask's sampling policy
    is_w = None
    if getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_importance_sampling_correction", False):
        is_w = inputs.get("importance_sampling_ratio")
    rollout_logps = inputs.get("sampling_per_token_logps") if cfg.off_policy_mask_threshold is not None \
        else None
    return dict(
        old_logps=inputs.get("old_per_token_logps"),
        ref_logps=inputs.get("ref_per_token_logps") if cfg.beta > 0 else None,
        lam=inputs.get("gtpo_lam") if cfg.use_conflict_mask else None,
        n_conf=inputs.get("gtpo_n_conf") if cfg.use_conflict_mask else None,
        config=cfg, num_items_in_batch=num_items, rollout_is_weights=is_w, rollout_logps=rollout_logps,
        validate=trainer.gtpo_validate, backend=trainer.gtpo_backend,
        **_replay_kwargs(trainer, inputs.get("sampling_mask"), inputs["completion_mask"], _loss_mask(inputs)))


def _replay_kwargs(trainer, rows, completion_mask, counted) -> dict:
    """The kept-set keywords of one log-prob pass (spec 13): the recorded sets when the batch carries
    them (`rows`: one (token_ids, offsets) per completion, see _flat_sampling_mask; they replace the
    rules that made them), else the sampler's top_k / top_p / min_p that are on, else none."""
    if rows is not None:
        return dict(sampling_mask=_flat_sampling_mask(rows, completion_mask, counted))
    return dict(trainer.gtpo_replay)


def _flat_sampling_mask(rows, completion_mask, counted, name="sampling_mask"):
    """Per-completion kept sets -> gtpo_loss's sampling_mask for the tokens `counted` selects.

    rows: a list with one (token_ids, offsets) per completion (row): the kept sets of that completion's
    tokens where completion_mask is nonzero, in order (tool / environment tokens included: any set
    holding the token, they are not in the loss), vLLM's compressed layout per completion: offsets
    (n_i + 1,) non-decreasing, set j = token_ids[offsets[j]:offsets[j + 1]]. A list travels with its rows
    through TRL's shuffle and split. counted: the pass's counted tokens (a subset of completion_mask).
    Returns (token_ids, offsets) over the counted tokens, row-major (gtpo_loss's packed order)."""
    B = completion_mask.size(0)
    if not isinstance(rows, (list, tuple)) or len(rows) != B:
        got = f"{len(rows)} entries" if isinstance(rows, (list, tuple)) else type(rows).__name__
        raise ValueError(f"{name} must be a list with one (token_ids, offsets) per completion ({B}), got {got}")
    cm, cnt = completion_mask != 0, counted != 0
    n = cm.sum(1).tolist()
    dev = completion_mask.device
    sizes, ids = [], []
    for i, r in enumerate(rows):
        if not (isinstance(r, (tuple, list)) and len(r) == 2 and all(
                isinstance(x, torch.Tensor) and x.dim() == 1 and not x.dtype.is_floating_point
                and x.dtype != torch.bool for x in r)):
            raise ValueError(f"{name}[{i}] must be a pair (token_ids, offsets) of 1-D integer tensors")
        tok, off = r[0].to(dev, torch.long), r[1].to(dev, torch.long)
        if off.numel() != n[i] + 1:
            raise ValueError(f"{name}[{i}]: offsets has {off.numel()} entries for the completion's {n[i]} "
                             f"tokens (completion_mask): want {n[i] + 1}, one set per token")
        lo, hi = int(off[0]), int(off[-1])
        if lo < 0 or hi > tok.numel():
            raise ValueError(f"{name}[{i}]: offsets span [{lo}, {hi}) outside token_ids' {tok.numel()} entries")
        sizes.append(off[1:] - off[:-1])
        ids.append(tok[lo:hi])
    sizes = torch.cat(sizes) if sizes else torch.zeros(0, dtype=torch.long, device=dev)
    ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long, device=dev)
    if bool((sizes < 0).any()):
        raise ValueError(f"{name}: offsets must be non-decreasing within each completion")
    keep = cnt[cm]  # the counted tokens among each completion's tokens, row-major
    token_ids = ids[keep.repeat_interleave(sizes)]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), sizes[keep].cumsum(0)])
    return token_ids, offsets


def _loss_mask(batch) -> torch.Tensor:
    mask = batch["completion_mask"]
    tool_mask = batch.get("tool_mask")
    return mask if tool_mask is None else mask * tool_mask
