"""GTPOConfig: every option of the loss in one dataclass, with the presets of spec section 5."""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional, Union

import torch

LOSS_AGGS = (
    "seq-mean-token-mean",
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "gtpo-official",
    "none",
)


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


@dataclasses.dataclass(frozen=True)
class GTPOConfig:
    """Options of `gtpo_loss` (defaults: the paper's GTPO, spec sections 2-5).

    temperature           logits are divided by it before the softmax (> 0)
    eps_low, eps_high     PPO clip range [1 - eps_low, 1 + eps_high], each in [0, 1)
    clip                  False: plain surrogate -lam * r * Ahat
    use_conflict_mask     conflict-token weights lambda (spec 3)
    conflict_pos_weight   lambda on conflict tokens of positive completions (w_pos)
    conflict_neg_weight   lambda on conflict tokens of negative completions (w_neg)
    entropy_threshold     h_max of the entropy filter; None turns the filter off
    entropy_penalty       gamma in Ahat = delta * (A - gamma * Hbar)
    initial_entropy       the starting model's mean entropy; above h_max it turns the filter off
    entropy_coef          optional differentiable entropy bonus (- coef * H per token)
    beta                  weight of the k3 KL term against ref_logps (0: no reference model)
    (every float above may also be a 0-d floating tensor, e.g. a schedule the trainer updates in place:
    under torch.compile it is then a graph input, and a new value does not recompile; a CPU tensor
    is read without a device sync)
    loss_agg              one of LOSS_AGGS ('_' or '-' accepted)
    max_completion_length denominator of 'seq-mean-token-sum-norm' (default: T, or the longest
                          completion in the packed form)
    """

    temperature: float = 1.0
    eps_low: float = 0.2
    eps_high: float = 0.2
    clip: bool = True
    use_conflict_mask: bool = True
    conflict_pos_weight: float = 2.0
    conflict_neg_weight: float = 0.0
    entropy_threshold: Optional[float] = math.log(2.0)
    entropy_penalty: float = 0.1
    initial_entropy: Optional[float] = None
    entropy_coef: float = 0.0
    beta: float = 0.0
    loss_agg: str = "seq-mean-token-mean"
    max_completion_length: Optional[int] = None

    def __post_init__(self):
        def bad(field, expected):
            raise ValueError(f"GTPOConfig.{field} must be {expected}, got {getattr(self, field)!r}")

        def value(field):
            """The field's number; a 0-d floating tensor is read once, here (see is_tensor_param)."""
            v = getattr(self, field)
            if isinstance(v, torch.Tensor):
                if v.dim() != 0 or not v.dtype.is_floating_point:
                    bad(field, "a finite number or a 0-d floating-point tensor")
                v = float(v)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                bad(field, "a finite number or a 0-d floating-point tensor")
            return v

        for f in ("temperature", "eps_low", "eps_high", "conflict_pos_weight", "conflict_neg_weight",
                  "entropy_penalty", "entropy_coef", "beta"):
            value(f)
        if value("temperature") <= 0:
            bad("temperature", "> 0")
        for f in ("eps_low", "eps_high"):
            if not 0.0 <= value(f) < 1.0:
                bad(f, "in [0, 1)")
        if value("beta") < 0:
            bad("beta", ">= 0")
        for f in ("entropy_threshold", "initial_entropy"):
            if getattr(self, f) is not None:
                value(f)
        if not isinstance(self.clip, bool):
            bad("clip", "a bool")
        if not isinstance(self.use_conflict_mask, bool):
            bad("use_conflict_mask", "a bool")
        if not isinstance(self.loss_agg, str) or _norm(self.loss_agg) not in LOSS_AGGS:
            bad("loss_agg", f"one of {LOSS_AGGS}")
        object.__setattr__(self, "loss_agg", _norm(self.loss_agg))
        m = self.max_completion_length
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            bad("max_completion_length", "None or a positive int")

    @classmethod
    def preset(cls, name: str, **overrides) -> "GTPOConfig":
        """A preset of spec section 5 ('gtpo', 'gtpo-official', 'grpo', 'dapo', 'dr_grpo'),
        with any field overridden by keyword."""
        key = _norm(name) if isinstance(name, str) else None
        if key not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - fields
        if unknown:
            raise TypeError(f"GTPOConfig.preset: unknown field(s) {sorted(unknown)}")
        return cls(**{**PRESETS[key], **overrides})

    def replace(self, **changes) -> "GTPOConfig":
        return dataclasses.replace(self, **changes)


_NO_GTPO = dict(use_conflict_mask=False, entropy_threshold=None, entropy_penalty=0.0)
PRESETS = {
    "gtpo": {},
    "gtpo-official": dict(entropy_threshold=0.7, clip=False, loss_agg="gtpo-official"),
    "grpo": dict(_NO_GTPO),
    "dapo": dict(_NO_GTPO, eps_high=0.28, loss_agg="token-mean"),
    "dr-grpo": dict(_NO_GTPO, loss_agg="seq-mean-token-sum-norm"),
}


def is_zero(x) -> bool:
    """True for a Python 0; a tensor is never assumed to be 0 (its value may change between calls)."""
    return not isinstance(x, torch.Tensor) and x == 0


def as_config(config) -> GTPOConfig:
    if isinstance(config, GTPOConfig):
        return config
    if isinstance(config, str):
        return GTPOConfig.preset(config)
    raise TypeError(f"config must be a GTPOConfig or a preset name, got {type(config).__name__}")
