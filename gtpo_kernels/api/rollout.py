"""The training/inference mismatch: rollout importance-sampling weights (spec 9), as TRL makes them, and the
mismatch measured (spec 14)."""
from __future__ import annotations

import torch

from ..core import checks
from ..objective.mismatch import rollout_metrics

ROLLOUT_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def rollout_is_weights(old_logps, rollout_logps, completion_mask, mode, clip_min=None, clip_max=3.0):
    """Weights for `gtpo_loss(..., rollout_is_weights=...)` from the trainer's old-policy log-probs
    and the inference engine's (vLLM, SGLang) log-probs of the same tokens: (B, T) per token (token_*),
    (B, 1) per completion (sequence_*, as TRL), which every consumer reads once per completion (VESPO
    folds one log w per completion into its weight).

    Per token the ratio is exp(m * (old - rollout)); per sequence the exp of the completion's masked
    sum. '*_truncate' clamps the ratios to [clip_min, clip_max]; '*_mask' sets ratios outside
    [clip_min, clip_max] to 0; a bound None is open (TRL's clip_max=None masks below clip_min alone). As TRL's
    GRPOConfig: clip_min < clip_max, and a truncate mode needs one of them. NaN differences (tokens the engine
    could not score) count as 0. Float64 for float64 old_logps, float32 otherwise (16-bit log-probs are not
    exponentiated in 16 bits). No gradient."""
    if mode not in ROLLOUT_IS_MODES:
        raise ValueError(f"mode must be one of {ROLLOUT_IS_MODES}, got {mode!r}")
    checks.check_float_tensor("old_logps", old_logps)
    checks.check_float_tensor("rollout_logps", rollout_logps)
    if old_logps.dim() != 2:
        raise ValueError(f"old_logps must have shape (B, T), got {tuple(old_logps.shape)}")
    checks.check_same_shape("rollout_logps", rollout_logps, tuple(old_logps.shape))
    if completion_mask is None:
        m = torch.ones(old_logps.shape, dtype=old_logps.dtype, device=old_logps.device)
    else:
        checks.check_same_shape("completion_mask", completion_mask, tuple(old_logps.shape))
        m = (completion_mask != 0).to(old_logps.dtype)
    for name, bound in (("clip_min", clip_min), ("clip_max", clip_max)):
        if bound is not None and not (isinstance(bound, (int, float)) and not isinstance(bound, bool)
                                      and bound == bound):
            raise ValueError(f"{name} must be a number or None, got {bound!r}")
    if mode.endswith("truncate") and clip_min is None and clip_max is None:
        raise ValueError(f"clip_min or clip_max must be set for mode={mode!r} (TRL's GRPOConfig refuses it too)")
    if clip_min is not None and clip_max is not None and not clip_min < clip_max:
        raise ValueError(f"clip_min ({clip_min!r}) must be less than clip_max ({clip_max!r}), as TRL's GRPOConfig "
                         "requires")
    acc = torch.float64 if old_logps.dtype == torch.float64 else torch.float32
    m = m.to(acc)
    with torch.no_grad():
        diff = torch.nan_to_num((old_logps.to(acc) - rollout_logps.to(acc)) * m, nan=0.0) * m
        if mode.startswith("sequence"):
            diff = diff.sum(-1, keepdim=True)  # (B, 1): one weight per completion
        w = torch.exp(diff)
        if mode.endswith("truncate"):
            return torch.clamp(w, min=clip_min, max=clip_max)
        lo = 0.0 if clip_min is None else clip_min
        hi = float("inf") if clip_max is None else clip_max
        return torch.where((w < lo) | (w > hi), torch.zeros_like(w), w)


def rollout_mismatch(logps, rollout_logps, completion_mask=None):
    """Spec 14's rollout/training mismatch of two log-probs of the same tokens, for a trainer that has both
    without calling the loss (e.g. its old-policy pass and the inference engine's): a dict of 0-d tensors
    rollout_k3 (mean of exp(d) - 1 - d, d = logps - rollout_logps: the k3 estimate of KL(rollout || policy)),
    rollout_abs_diff (mean |d|), rollout_max_abs_diff, rollout_outside_frac (exp(d) outside [0.9, 1.1]) and
    rollout_nan_frac, over the counted tokens (completion_mask != 0; all when None), NaN differences left out
    of the first four and counted in the last. What `metrics` of every loss call holds when it is given
    rollout_logps. Float64 for float64 logps, float32 otherwise; no gradient."""
    checks.check_float_tensor("logps", logps)
    checks.check_float_tensor("rollout_logps", rollout_logps)
    checks.check_same_shape("rollout_logps", rollout_logps, tuple(logps.shape))
    if completion_mask is None:
        m = torch.ones(logps.shape, dtype=torch.bool, device=logps.device)
    else:
        checks.check_same_shape("completion_mask", completion_mask, tuple(logps.shape))
        m = completion_mask != 0
    dt = torch.float64 if logps.dtype == torch.float64 else torch.float32
    return rollout_metrics(logps, rollout_logps, m, dt)
