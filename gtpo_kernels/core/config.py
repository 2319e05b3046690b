"""GTPOConfig: every option of the loss in one dataclass, with the presets of spec section 5."""
from __future__ import annotations

import copy
import dataclasses
import math
import numbers
from typing import Optional

import torch

from .flags import FLT_MAX

POLICY_LOSSES = ("ppo", "cispo", "sapo", "vespo",
                 # verl 0.9.1's loss modes (spec 9)
                 "gpg", "dppo-tv", "dppo-kl", "dro", "verl-cispo", "geo-mean", "clip-cov", "kl-cov")
IS_LEVELS = ("token", "sequence")
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


# the fields that must be finite numbers (or 0-d floating tensors) in every config
_NUMBER_FIELDS = ("temperature", "eps_low", "eps_high", "conflict_pos_weight", "conflict_neg_weight",
                  "entropy_penalty", "entropy_coef", "beta", "sapo_temperature_pos", "sapo_temperature_neg",
                  "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "top_entropy_quantile",
                  "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")


@dataclasses.dataclass(frozen=True)
class GTPOConfig:
    """Options of `gtpo_loss` (defaults: the paper's GTPO, spec sections 2-5).

    temperature           logits are divided by it before the softmax (> 0; it and 1 / it finite in float32)
    eps_low, eps_high     PPO clip range [1 - eps_low, 1 + eps_high], each in [0, 1) (verl-cispo, dppo: >= 0)
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
    under torch.compile a graph input, a new value does not recompile; a CPU tensor read without a sync)
    loss_agg              one of LOSS_AGGS ('_' or '-' accepted)
    max_completion_length denominator of 'seq-mean-token-sum-norm' (default: T; packed: the longest completion)
    local_count           with 'token-mean', always over this call's counted tokens (the 'bnpo' preset:
                          TRL's bnpo): num_items_in_batch is then refused (use 'dapo' to divide by it)

    The GRPO family (spec 9; TRL's names):
    policy_loss           'ppo' (clipped surrogate), 'cispo' (eps_high is then an absolute bound on the
                          ratio, e.g. 5.0), 'sapo' (soft gate), 'vespo' (gamma weights per completion)
    importance_sampling_level  'token' or 'sequence' (GSPO: one ratio per completion, the exp of the
                          mean log-ratio); 'sequence' is refused with cispo, sapo and vespo
    delta                 INTELLECT-2's two-sided clip: the unclipped ratio capped at delta (> 1), or None
    sapo_temperature_pos, sapo_temperature_neg   SAPO's gate temperatures (Ahat > 0, else)
    vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg   VESPO's gamma weights (A >= 0, else)
    use_bias_correction_kl  multiply the k3 term by the ratio r (DeepSeek-V3.2)
    off_policy_mask_threshold  drop the policy term of completions with A < 0 whose mean
                          (sampling logp - logp) exceeds it (DeepSeek-V3.2), or None
    top_entropy_quantile  rho in (0, 1]: only the counted tokens with the top rho fraction of entropies
                          keep their policy term and entropy bonus (1.0: all)

    verl 0.9.1's modes (spec 9; policy_loss 'gpg', 'dppo_tv', 'dppo_kl', 'dro', 'verl_cispo' (r clipped to
    [1 - eps_low, 1 + eps_high]), 'geo_mean' (GMPO), 'clip_cov', 'kl_cov'):
    dual_clip_c           verl's clip_ratio_c or None: the dual clip of 'ppo' and 'clip_cov' (> 1; for A < 0
                          the term is at most -A c); the cap c of dppo's sg(min(r, c)) (> 0; None: no cap)
    dro_beta              DRO's penalty dro_beta / 2 (logp - old)^2 (> 0, required by 'dro')
    clip_cov_ratio, clip_cov_lb, clip_cov_ub   max(1, floor(ratio * counted tokens)) tokens at random among
                          the counted, unclipped ones of covariance in (lb, ub) lose their term
    kl_cov_ratio, ppo_kl_coef   as many counted tokens of largest covariance add coef * |logp - old|
    generator             clip_cov's torch.Generator, on the tokens' device (None: the device's default);
                          with a process_group, in the same state on every rank (compared, refused otherwise).
                          It draws one number per token of the layout given (B x T padded, N packed), so one
                          state chooses a different (equally random) subset in the padded and packed forms
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
    local_count: bool = False
    policy_loss: str = "ppo"
    importance_sampling_level: str = "token"
    delta: Optional[float] = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    use_bias_correction_kl: bool = False
    off_policy_mask_threshold: Optional[float] = None
    top_entropy_quantile: float = 1.0
    dual_clip_c: Optional[float] = None
    dro_beta: Optional[float] = None
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    ppo_kl_coef: float = 0.1
    generator: Optional[torch.Generator] = None

    def __post_init__(self, read=None):
        """Every field checked. read: the fields whose 0-d tensor values are read (None: all, once, here;
        replace: the changed ones; while torch.compile traces none, their shape and dtype alone)."""
        object.__setattr__(self, "_read", () if torch.compiler.is_compiling() else read)  # (not a field)
        try:
            self._need("temperature", lambda v: FLT_MAX >= v > 0 and 1 / v <= FLT_MAX,
                       "> 0, with temperature and 1 / temperature finite in float32")
            for f in _NUMBER_FIELDS[1:]:  # (after temperature: each 0-d tensor read once)
                self._number(f)
            for check in (self._check_policy_term, self._check_masks_and_kl, self._check_switches_and_aggregation,
                          self._check_verl_modes):
                check()
        finally:
            self.__dict__.pop("_read")  # (vars(config) holds the fields alone)

    def _bad(self, field, expected):
        raise ValueError(f"GTPOConfig.{field} must be {expected}, got {getattr(self, field)!r}")

    def _number(self, field):
        """The field's number (None: a 0-d floating tensor not read, see __post_init__)."""
        v = getattr(self, field)
        if isinstance(v, torch.Tensor):
            if v.dim() != 0 or not v.dtype.is_floating_point:
                self._bad(field, "a finite number or a 0-d floating-point tensor")
            if self._read is not None and field not in self._read:
                return None
            v = float(v)
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            self._bad(field, "a finite number or a 0-d floating-point tensor")
        return v

    def _need(self, field, ok, expected):
        """Refuse the field unless ok(its number); a tensor not read passes (see __post_init__)."""
        v = self._number(field)
        if v is not None and not ok(v):
            self._bad(field, expected)

    def _check_policy_term(self):
        """policy_loss (normalised), importance_sampling_level, the clip range, delta, SAPO's temperatures."""
        pl = _norm(self.policy_loss) if isinstance(self.policy_loss, str) else None
        if pl not in POLICY_LOSSES:
            self._bad("policy_loss", f"one of {POLICY_LOSSES}")
        object.__setattr__(self, "policy_loss", pl)
        level = self.importance_sampling_level
        if level not in IS_LEVELS:
            self._bad("importance_sampling_level", f"one of {IS_LEVELS}")
        if level == "sequence" and pl != "ppo":
            self._bad("importance_sampling_level", f"'token' with policy_loss={pl!r} (its policy term has no "
                      "sequence-level form here; TRL warns about it)")
        # verl-cispo: any width (1 - eps_low <= 0: no lower bound, CISPO's); dppo: a divergence's threshold, any
        top, span = (math.inf, f">= 0 with policy_loss={pl!r}") if pl in ("verl-cispo", "dppo-tv", "dppo-kl") else (1.0, "in [0, 1)")
        self._need("eps_low", lambda v: 0.0 <= v < top, span)
        if pl == "cispo":
            self._need("eps_high", lambda v: v > 0, "> 0 with policy_loss='cispo' (the ratio's upper bound, e.g. 5.0)")
        else:
            self._need("eps_high", lambda v: 0.0 <= v < top, span)
        if self.delta is not None:
            self._need("delta", lambda v: v > 1.0, "None or > 1")
        for f in ("sapo_temperature_pos", "sapo_temperature_neg"):
            self._need(f, lambda v: v > 0, "> 0")

    def _check_masks_and_kl(self):
        """The off-policy mask, the entropy quantile, the KL term and the entropy control's optional numbers."""
        if self.off_policy_mask_threshold is not None:
            self._number("off_policy_mask_threshold")
        self._need("top_entropy_quantile", lambda v: 0.0 < v <= 1.0, "in (0, 1]")
        if not isinstance(self.use_bias_correction_kl, bool):
            self._bad("use_bias_correction_kl", "a bool")
        self._need("beta", lambda v: v >= 0, ">= 0")
        for f in (f for f in ("entropy_threshold", "initial_entropy") if getattr(self, f) is not None):
            self._number(f)

    def _check_switches_and_aggregation(self):
        """clip, use_conflict_mask and local_count (bools), loss_agg (normalised), max_completion_length."""
        for f in ("clip", "use_conflict_mask", "local_count"):
            if not isinstance(getattr(self, f), bool):
                self._bad(f, "a bool")
        if not isinstance(self.loss_agg, str) or _norm(self.loss_agg) not in LOSS_AGGS:
            self._bad("loss_agg", f"one of {LOSS_AGGS}")
        object.__setattr__(self, "loss_agg", _norm(self.loss_agg))
        m = self.max_completion_length
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            self._bad("max_completion_length", "None or a positive int")

    def _check_verl_modes(self):
        """dual_clip_c, dro_beta, clip_cov's and kl_cov's numbers, the generator (spec 9, verl's modes)."""
        pl = self.policy_loss
        if self.dual_clip_c is not None:
            if pl in ("dppo-tv", "dppo-kl"):
                self._need("dual_clip_c", lambda v: v > 0, "None or > 0 (the cap of the truncated ratio)")
            elif pl not in ("ppo", "clip-cov"):
                self._bad("dual_clip_c", f"None with policy_loss={pl!r} (an option of the PPO term, of clip_cov "
                          "and of dppo_tv / dppo_kl)")
            else:
                self._need("dual_clip_c", lambda v: v > 1.0, "None or > 1")
        if self.dro_beta is not None:
            self._need("dro_beta", lambda v: v > 0, "None or > 0")
        if pl == "dro" and self.dro_beta is None:
            self._bad("dro_beta", "> 0 with policy_loss='dro' (its quadratic penalty; verl requires it too)")
        for f in ("clip_cov_ratio", "kl_cov_ratio"):
            self._need(f, lambda v: v > 0, "> 0")
        self._need("ppo_kl_coef", lambda v: v >= 0, ">= 0")
        ub = self._number("clip_cov_ub")
        self._need("clip_cov_lb", lambda v: ub is None or v < ub, f"< clip_cov_ub = {self.clip_cov_ub!r}")
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            self._bad("generator", "None or a torch.Generator")
        if pl == "geo-mean" and self.loss_agg == "none":
            self._bad("loss_agg", "aggregated with policy_loss='geo-mean' (a token's term depends on its completion)")

    @property
    def top_entropy_on(self) -> bool:
        """The top-entropy mask is on: a quantile below 1, or a tensor (never assumed 1: no launch to compare)."""
        q = self.top_entropy_quantile
        return isinstance(q, torch.Tensor) or q != 1.0

    @property
    def sequence_term(self) -> bool:
        """A token's policy term depends on its whole completion (GSPO's ratio, GMPO's mean)."""
        return self.importance_sampling_level == "sequence" or self.policy_loss == "geo-mean"

    @property
    def batch_term(self) -> bool:
        """A token's policy term depends on the whole batch (clip_cov's, kl_cov's covariances)."""
        return self.policy_loss in ("clip-cov", "kl-cov")

    @classmethod
    def preset(cls, name: str, **overrides) -> "GTPOConfig":
        """A preset of spec sections 5 and 9 (see PRESETS: 'gtpo', 'gtpo-official', 'grpo', 'dapo',
        'dr_grpo', 'bnpo', 'cispo', 'sapo', 'gspo', 'luspo', 'vespo' and verl's 'vanilla', 'gpg', 'dppo_tv',
        'dppo_kl', 'dro' (needs dro_beta), 'verl_cispo', 'geo_mean', 'clip_cov', 'kl_cov'), with any field overridden by
        keyword (e.g. GTPO's conflict weights and entropy control on top of any TRL loss type:
        GTPOConfig.preset('cispo', use_conflict_mask=True, entropy_threshold=0.7))."""
        key = _norm(name) if isinstance(name, str) else None
        if key not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
        unknown = set(overrides) - set(cls.__dataclass_fields__)  # (not dataclasses.fields(cls): compile traces it)
        if unknown:
            raise TypeError(f"GTPOConfig.preset: unknown field(s) {sorted(unknown)}")
        return cls(**{**PRESETS[key], **overrides})

    def replace(self, **changes) -> "GTPOConfig":
        """A copy with `changes`, checked as a new config reading only the changed 0-d tensors (trace-safe)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"GTPOConfig.replace: unknown field(s) {sorted(unknown)}")
        new = copy.copy(self)
        for k, v in changes.items():
            object.__setattr__(new, k, v)
        new.__post_init__(read=tuple(changes))
        return new

    @property
    def shapes_advantages(self) -> bool:
        """The entropy filter or shaping (spec 2) is on: Ahat needs the completions' entropies."""
        return self.entropy_threshold is not None or not is_zero(self.entropy_penalty)

    @property
    def needs_entropy(self) -> bool:
        """Some term reads the per-token entropies: the filter, shaping, the bonus or the quantile mask."""
        return self.shapes_advantages or not is_zero(self.entropy_coef) or \
            not is_zero(self.top_entropy_quantile - 1.0)


_NO_GTPO = dict(use_conflict_mask=False, entropy_threshold=None, entropy_penalty=0.0)
PRESETS = {
    "gtpo": {},
    "gtpo-official": dict(entropy_threshold=0.7, clip=False, loss_agg="gtpo-official"),
    "grpo": dict(_NO_GTPO),
    "dapo": dict(_NO_GTPO, eps_high=0.28, loss_agg="token-mean"),
    "dr-grpo": dict(_NO_GTPO, loss_agg="seq-mean-token-sum-norm"),
    # spec 9: TRL's loss types
    "bnpo": dict(_NO_GTPO, loss_agg="token-mean", local_count=True),
    "cispo": dict(_NO_GTPO, policy_loss="cispo", eps_high=5.0, loss_agg="token-mean"),
    "sapo": dict(_NO_GTPO, policy_loss="sapo"),
    "gspo": dict(_NO_GTPO, importance_sampling_level="sequence"),
    "luspo": dict(_NO_GTPO, importance_sampling_level="sequence", loss_agg="seq-mean-token-sum"),
    "vespo": dict(_NO_GTPO, policy_loss="vespo", loss_agg="token-mean"),
    # spec 9: verl 0.9.1's loss modes (verl's default token-mean unless the mode forces its own)
    "vanilla": dict(_NO_GTPO, dual_clip_c=3.0, loss_agg="token-mean"),
    "gpg": dict(_NO_GTPO, policy_loss="gpg", loss_agg="token-mean"),
    "dppo-tv": dict(_NO_GTPO, policy_loss="dppo-tv", dual_clip_c=3.0, loss_agg="token-mean"),
    "dppo-kl": dict(_NO_GTPO, policy_loss="dppo-kl", dual_clip_c=3.0, loss_agg="token-mean"),
    "dro": dict(_NO_GTPO, policy_loss="dro", loss_agg="token-mean"),
    "verl-cispo": dict(_NO_GTPO, policy_loss="verl-cispo", loss_agg="token-mean"),
    "geo-mean": dict(_NO_GTPO, policy_loss="geo-mean", loss_agg="seq-mean-token-mean"),
    "clip-cov": dict(_NO_GTPO, policy_loss="clip-cov", loss_agg="token-mean"),
    "kl-cov": dict(_NO_GTPO, policy_loss="kl-cov", loss_agg="token-mean"),
}


def is_zero(x) -> bool:
    """True for a Python 0; a tensor is never assumed to be 0 (its value may change between calls)."""
    return not isinstance(x, torch.Tensor) and x == 0


def as_config(config) -> GTPOConfig:
    if isinstance(config, GTPOConfig):
        return config
    if isinstance(config, str):  # the presets are built once (torch.compile then reads a constant)
        named = _NAMED.get(_norm(config))
        return named if named is not None else GTPOConfig.preset(config)
    raise TypeError(f"config must be a GTPOConfig or a preset name, got {type(config).__name__}")


_NAMED = {name: GTPOConfig.preset(name) for name in PRESETS if name != "dro"}  # dro needs its dro_beta
