"""The GRPO-family pieces of the float64 reference (spec 9): ratio level, policy terms, masks, KL and the
rollout importance-sampling weights, each one written as TRL 1.16's GRPOTrainer computes it.

TRL sources (trl/trainer/grpo_trainer.py, trl 1.16.0): GRPOTrainer._compute_loss (ratio, policy terms, KL,
order of the masks), GRPOTrainer.get_off_policy_mask, GRPOTrainer.get_high_entropy_mask,
GRPOTrainer.get_gamma_weights (VESPO) and the vLLM importance-sampling block of
GRPOTrainer._generate_and_score_completions. Where the spec and TRL differ, the spec is followed and a
comment says "TRL differs". Like gtpo_reference.py it stands alone (no import of gtpo_kernels).
"""
from __future__ import annotations

import fractions
import math

import torch

from .gtpo_verl import VERL_POLICIES

__all__ = ["POLICY_LOSSES", "IS_LEVELS", "ROLLOUT_IS_MODES", "rollout_is_weights", "rollout_mismatch"]

POLICY_LOSSES = ("ppo", "cispo", "sapo", "vespo") + VERL_POLICIES  # verl's modes: gtpo_verl.py
IS_LEVELS = ("token", "sequence")
ROLLOUT_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

_F64 = torch.float64
_LOG_1E_8 = math.log(1e-8)        # VESPO's lower clamp of log w (TRL get_gamma_weights)


# --------------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------------

def check_family_args(policy_loss, importance_sampling_level, delta, top_entropy_quantile,
                      sapo_temperature_pos, sapo_temperature_neg):
    """The refusals of spec 9, each a ValueError naming the argument."""
    if policy_loss not in POLICY_LOSSES:
        raise ValueError(f"policy_loss must be one of {POLICY_LOSSES}, got {policy_loss!r}")
    if importance_sampling_level not in IS_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {IS_LEVELS}, "
                         f"got {importance_sampling_level!r}")
    if importance_sampling_level == "sequence" and policy_loss != "ppo":
        # spec 9 refuses it. TRL differs: it only logs a warning (cispo, vespo) or nothing (sapo) and runs.
        raise ValueError(f"importance_sampling_level='sequence' is only defined for policy_loss='ppo', "
                         f"got policy_loss={policy_loss!r}")
    if delta is not None and not delta > 1:
        # spec 9: delta > 1. TRL differs: it accepts any value.
        raise ValueError(f"delta must be > 1 (or None), got {delta!r}")
    if not 0 < top_entropy_quantile <= 1:
        # spec 9: rho in (0, 1]. TRL differs: it also accepts 0 (keeps only the top-entropy token(s)).
        raise ValueError(f"top_entropy_quantile must be in (0, 1], got {top_entropy_quantile!r}")
    if policy_loss == "sapo" and not (sapo_temperature_pos > 0 and sapo_temperature_neg > 0):
        raise ValueError(f"sapo_temperature_pos and sapo_temperature_neg must be > 0, got "
                         f"{sapo_temperature_pos!r} and {sapo_temperature_neg!r}")


def rollout_weights_arg(weights, m):
    """rollout_is_weights of gtpo_loss -> (B, T) per token or (B, 1) per completion, float64 (spec 9).

    Values at masked-out positions are ignored (spec 1): they become 1."""
    if weights is None:
        return None
    B, T = m.shape
    w = torch.as_tensor(weights, device=m.device).double()
    if tuple(w.shape) == (B, T):
        w = torch.where(m, w, torch.ones_like(w))
    elif tuple(w.shape) in ((B,), (B, 1)):
        w = w.reshape(B, 1)
    else:
        raise ValueError(f"rollout_is_weights must be (B, T) = {(B, T)} per token or (B,) / (B, 1) per "
                         f"completion, got {tuple(w.shape)}")
    if (w < 0).any():
        raise ValueError("rollout_is_weights must be >= 0 at counted positions")
    return w


def rollout_logps_arg(rollout_logps, m):
    """rollout_logps of gtpo_loss (the inference engine's log-probs, (B, T)) as float64, or None."""
    if rollout_logps is None:
        return None
    rollout_logps = torch.as_tensor(rollout_logps, device=m.device).double()
    if tuple(rollout_logps.shape) != tuple(m.shape):
        raise ValueError(f"rollout_logps must be (B, T) = {tuple(m.shape)}, got {tuple(rollout_logps.shape)}")
    return rollout_logps


# --------------------------------------------------------------------------------------------------
# ratio and policy terms (TRL _compute_loss)
# --------------------------------------------------------------------------------------------------

def importance_ratio(logp, old, m, level):
    """r = exp(logp - old) per token (B, T); at the sequence level (GSPO, spec 9)
    r[i] = exp(sum_t m (logp - old) / max(n[i], 1)), shape (B, 1): the gradient flows through the mean
    into every counted token's logp (TRL: log_importance_weights). old = sg(logp) when on-policy."""
    log_ratio = logp - old
    if level == "token":
        return torch.exp(log_ratio)
    mf = m.double()
    log_w = (log_ratio * mf).sum(dim=1, keepdim=True) / mf.sum(dim=1, keepdim=True).clamp(min=1)
    return torch.exp(log_w)


@torch.no_grad()
def vespo_phi(logp, old, m, A, rollout_w, k_pos, lambda_pos, k_neg, lambda_neg):
    """VESPO's per-completion weight phi (B, 1), no gradient (spec 9; TRL get_gamma_weights):
    L = clamp(sum_t m clamp(logp - old, -20, 20) + sum_t log w_rollout, log 1e-8, 20), w = exp(L),
    log phi = lam_v + k L - lam_v w with (k, lam_v) chosen by the sign of the raw A; non-finite -> 0, but a NaN
    input (invalid, unchecked) gives NaN: it is no overflow."""
    mf = m.double()
    L = (torch.clamp(logp - old, -20.0, 20.0) * mf).sum(dim=1, keepdim=True)
    if rollout_w is not None:
        # TRL clamps each log weight to [log 1e-8, 20] (a masked-out weight 0 -> log 1e-8).
        log_rw = torch.clamp(torch.log(rollout_w), _LOG_1E_8, 20.0)
        if rollout_w.shape[1] == m.shape[1]:
            # TRL differs: it sums over all T positions; its own weights are 1 (log 0) on padding unless
            # the clip range excludes 1. Here masked-out values are ignored (spec 1).
            log_rw = torch.where(m, log_rw, torch.zeros_like(log_rw)).sum(dim=1, keepdim=True)
        L = L + log_rw                       # a per-completion weight enters once
    L = torch.clamp(L, _LOG_1E_8, 20.0)
    w = torch.exp(L)
    # TRL differs: torch.where on Python floats gives float32 k and lambda (exact for the defaults).
    nonneg = (A >= 0).reshape(-1, 1)
    k = torch.where(nonneg, torch.full_like(w, k_pos), torch.full_like(w, k_neg))
    lam_v = torch.where(nonneg, torch.full_like(w, lambda_pos), torch.full_like(w, lambda_neg))
    lam_v = lam_v.clamp(min=1e-4)            # as TRL (not in the spec)
    log_phi = lam_v + k * L - lam_v * w
    phi = torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return torch.where(torch.isnan(L), L, phi)  # (L is NaN only from a NaN input: its clamps bound the rest)


def policy_term(policy, r, Ahat, logp, *, clip, eps_low, eps_high, delta, sapo_temperature_pos,
                sapo_temperature_neg, phi=None):
    """The per-token policy term pg before lambda, masks and weights (spec 4, 9).

    Returns (pg, clip_removed): clip_removed marks where PPO's clip (or delta) took the gradient away
    (Ahat != 0 and the branch the minimum takes is a constant there); the other policy terms remove none.
    """
    none_removed = torch.zeros_like(r, dtype=torch.bool)
    if policy == "ppo":
        r1 = r if delta is None else torch.clamp(r, max=delta)   # INTELLECT-2 two-sided clip
        capped = none_removed if delta is None else r > delta    # min(r, delta) = delta, a constant
        unclipped = r1 * Ahat
        if not clip:
            return -unclipped, capped & (Ahat != 0)
        clipped = torch.clamp(r, 1.0 - eps_low, 1.0 + eps_high) * Ahat   # the unclamped r (as TRL)
        outside = (r < 1.0 - eps_low) | (r > 1.0 + eps_high)            # clip(r) is a constant there
        # the minimum takes the clipped branch where unclipped > clipped: it keeps the gradient of r
        # inside the clip range (A < 0, delta < r < 1 + eps_high), none outside
        removed = torch.where(unclipped > clipped, outside, capped) & (Ahat != 0)
        return -torch.min(unclipped, clipped), removed
    if policy == "cispo":
        # eps_high is an absolute bound on the ratio here (TRL's convention)
        return -torch.clamp(r, max=eps_high).detach() * Ahat * logp, none_removed
    if policy == "sapo":
        # spec 9: temperature chosen by the sign of Ahat (TRL: of its advantages, = Ahat with GTPO off).
        # TRL differs: torch.where on Python floats makes it float32 (1.05 -> 1.0499999523).
        tau = torch.where(Ahat > 0, torch.full_like(Ahat, sapo_temperature_pos),
                          torch.full_like(Ahat, sapo_temperature_neg))
        # sigmoid(x) as exp(-softplus(-x)): autograd's gradient is then sigmoid(x) sigmoid(-x), exact where sigmoid(x)
        # rounds to 1 (sigmoid's own backward forms 1 - sigmoid(x): 0 beyond x ~ 37); -x <= tau, below softplus's
        # threshold, since r >= 0
        gate = torch.exp(-torch.nn.functional.softplus(-tau * (r - 1.0)))
        return -gate * 4.0 / tau * Ahat, none_removed
    # "vespo": -sg(phi) * Ahat * logp (phi from vespo_phi, already detached)
    return -phi * Ahat * logp, none_removed


# --------------------------------------------------------------------------------------------------
# masks and KL
# --------------------------------------------------------------------------------------------------

def off_policy_mask(A, logp, sampling_logp, m, threshold):
    """DeepSeek-V3.2 off-policy sequence mask (B, 1) float64 (spec 9; TRL get_off_policy_mask): keep
    completion i if A[i] >= 0 or sum_t m (sampling_logp - sg(logp)) / max(n[i], 1) <= threshold."""
    # NaN differences count as 0 (as TRL; its torch.nan_to_num also maps +-inf to +-float max).
    kl = torch.nan_to_num(sampling_logp - logp.detach(), nan=0.0)
    kl = torch.where(m, kl, torch.zeros_like(kl))
    avg_kl = kl.sum(dim=1, keepdim=True) / m.double().sum(dim=1, keepdim=True).clamp(min=1)
    keep = (A.reshape(-1, 1) >= 0) | (avg_kl <= threshold)
    return keep.double()


def top_entropy_mask(H, m, rho):
    """Counted tokens whose entropy is >= the (1 - rho) quantile of the counted tokens' entropies
    (spec 9; TRL get_high_entropy_mask; torch.quantile's linear interpolation). Bool (B, T)."""
    counted = H.detach()[m]
    if counted.numel() == 0:
        return torch.zeros_like(m)
    # The position (n - 1)(1 - rho) exactly, rho read as the decimal it is written as (0.7 = 7/10: position 3 of
    # 11 tokens, where float64's 1 - 0.7 = 0.30000000000000004 would put it past 3 and mask that token out; TRL's
    # float32 quantile rounds it to 3 too). The entropies in float64 (TRL: a float32 copy).
    srt = counted.sort().values
    pos = (srt.numel() - 1) * (1 - fractions.Fraction(repr(float(rho))))
    lo = math.floor(pos)
    hi = min(lo + 1, srt.numel() - 1)
    frac = pos - lo
    threshold = srt[lo] if frac == 0 or srt[hi] == srt[lo] else srt[lo] + (srt[hi] - srt[lo]) * float(frac)
    if torch.isnan(srt).any():  # as torch.quantile: a NaN entropy, a NaN threshold (no token kept)
        threshold = srt.new_tensor(float("nan"))
    return (H.detach() >= threshold) & m


def k3(ref, logp, r=None, old=None):
    """k3 = exp(ref - logp) - (ref - logp) - 1 (spec 4), times the ratio r (unclamped, with its
    gradient) for DeepSeek-V3.2's bias correction (spec 9; TRL use_bias_correction_kl). old: given where r is the
    token's own exp(logp - old); then k3 r is formed as exp(ref - old) - (d + 1) r, the same number whose first
    term has no gradient, where autograd's r (1 - e^d) + k3 r adds two terms of size e^d r that cancel (e^d = 1e23
    at d = 53 leaves nothing of the gradient -d r)."""
    d = ref - logp
    kl = torch.exp(d) - d - 1.0
    if r is None:
        return kl
    return kl * r if old is None else torch.exp(ref - old) - (d + 1.0) * r


def _k3_of(d):
    """exp(d) - 1 - d without cancellation: its Taylor series sum_{k>=2} d^k / k! for |d| < 0.1 (to d^12,
    relative error below 1e-16), expm1(d) - d elsewhere; +inf at d = +inf (where expm1(d) - d is inf - inf)."""
    series = torch.zeros_like(d)
    term = d * d / 2.0
    for k in range(3, 14):
        series = series + term
        term = term * d / k
    direct = torch.where(d == math.inf, math.inf, torch.expm1(d) - d)
    return torch.where(d.abs() < 0.1, series, direct)


@torch.no_grad()
def rollout_mismatch(logp, rollout_logps, m):
    """Spec 14's rollout/training mismatch over counted tokens, d = logp - rollout_logps (float64):
    rollout_k3 = mean of exp(d) - 1 - d, rollout_abs_diff = mean |d|, rollout_max_abs_diff = max |d|,
    rollout_outside_frac = fraction with exp(d) outside [0.9, 1.1], over the counted tokens whose d is not
    NaN (0 when there are none); rollout_nan_frac = the counted tokens with a NaN d over all counted ones."""
    d = logp.detach().double() - rollout_logps.double()
    nan = m & torch.isnan(d)
    ok = m & ~nan
    d = torch.where(ok, d, torch.zeros_like(d))
    n_ok = ok.double().sum().clamp(min=1)
    r = torch.exp(d)
    return {"rollout_k3": torch.where(ok, _k3_of(d), 0.0).sum() / n_ok,
            "rollout_abs_diff": d.abs().sum() / n_ok,
            "rollout_max_abs_diff": d.abs().max() if d.numel() else torch.zeros((), dtype=_F64, device=d.device),
            "rollout_outside_frac": (ok & ((r < 0.9) | (r > 1.1))).double().sum() / n_ok,
            "rollout_nan_frac": nan.double().sum() / m.double().sum().clamp(min=1)}


# --------------------------------------------------------------------------------------------------
# rollout correction weights (TRL: the vLLM importance-sampling block of _generate_and_score_completions)
# --------------------------------------------------------------------------------------------------

@torch.no_grad()
def rollout_is_weights(old_logps, rollout_logps, completion_mask, mode, clip_min=None, clip_max=3.0):
    """-> float64 training/inference importance weights (spec 9), as TRL computes them: (B, T) for the
    token modes, (B, 1) per completion for the sequence modes (as TRL; consumers read it once).

    d = m * (old - rollout) with NaN -> 0; token modes use exp(d) per token, sequence modes exp of the
    completion's sum of d. "*_truncate" clamps to
    [clip_min, clip_max]; "*_mask" sets values outside [clip_min, clip_max] to 0 (a None bound is open).
    """
    if mode not in ROLLOUT_IS_MODES:
        raise ValueError(f"mode must be one of {ROLLOUT_IS_MODES}, got {mode!r}")
    old = torch.as_tensor(old_logps).double()
    device = old.device
    roll = torch.as_tensor(rollout_logps, device=device).double()
    if old.dim() != 2 or roll.shape != old.shape:
        raise ValueError(f"old_logps and rollout_logps must both be (B, T), got {tuple(old.shape)} and "
                         f"{tuple(roll.shape)}")
    B, T = old.shape
    if completion_mask is None:
        mf = torch.ones(B, T, dtype=_F64, device=device)
    else:
        mf = torch.as_tensor(completion_mask, device=device)
        if tuple(mf.shape) != (B, T):
            raise ValueError(f"completion_mask must have shape {(B, T)}, got {tuple(mf.shape)}")
        mf = (mf != 0).double()
    truncate = mode.endswith("_truncate")
    # TRL's GRPOConfig refuses these two settings
    if truncate and clip_min is None and clip_max is None:
        raise ValueError("clip_min or clip_max must be set for a '*_truncate' mode")
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        raise ValueError(f"clip_min ({clip_min}) must be less than clip_max ({clip_max})")

    # TRL: torch.nan_to_num(nan=0.0), which also maps +-inf to +-float max, as here
    diff = torch.nan_to_num((old - roll) * mf, nan=0.0)
    if mode.startswith("sequence_"):
        diff = diff.sum(dim=1, keepdim=True)
    w = torch.exp(diff)
    if truncate:
        w = torch.clamp(w, min=clip_min, max=clip_max)
    else:
        lo = -math.inf if clip_min is None else clip_min
        hi = math.inf if clip_max is None else clip_max
        w = w.masked_fill((w < lo) | (w > hi), 0.0)
    return w
