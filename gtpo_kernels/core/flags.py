"""The per-token flags the forward pass writes (Triton kernel, torch path and vocabulary-parallel merge
alike), defined once, below both the kernels and the checks that report them."""
import torch

BAD_NONFINITE = 1  # NaN or +inf in the counted row
BAD_TARGET_NEG_INF = 2  # the target's own logit is -inf
BAD_ID = 4  # id outside [0, V) (never read)
BAD_RULE = 8  # a truncation rule (top_k, top_p, min_p) of the token out of its range (unvalidated)


class NonFiniteRowError(ValueError):
    """A counted row whose statistics are not finite (checks.raise_on_flags; a split's rebuild that cannot
    hold it): NaN or +inf logits, or a temperature that is not > 0 (the entry point then names the
    temperature, core/entry.py)."""


FLT_MAX = 3.4028234663852886e38  # float32's largest: a tau below 1 / FLT_MAX (2.9e-39) has no float32 1 / tau


def tau_or_nan(tau):
    """The temperature as the torch passes take it: NaN where it is not > 0 or it or 1 / it is not finite in
    float32 (a number, or a tensor elementwise, read nowhere): a 0-d schedule changed in place to 0 or below,
    unvalidated, makes its tokens' outputs NaN, as the Triton kernels' 1 / tau does (vocab_jit._inv_tau), never
    a finite number."""
    if isinstance(tau, torch.Tensor):
        return torch.where((tau > 0) & (tau <= FLT_MAX) & (tau.reciprocal() <= FLT_MAX), tau, float("nan"))
    return tau if 0 < tau <= FLT_MAX and 1 / tau <= FLT_MAX else float("nan")


def nan_where(flag, values):
    """values (a dict of tensors) NaN where the 0-d bool `flag` is set: a call's metrics where no completion of
    its batch is known (an unvalidated malformed cu_seqlens)."""
    return {k: torch.where(flag, torch.full_like(v, float("nan")), v) for k, v in values.items()}


def nan_at_flags(logp, ent, bad):
    """logp and H NaN where the flags are set (a flagged token's outputs: never a finite wrong number)."""
    invalid = bad != 0
    nan = torch.full((), float("nan"), dtype=logp.dtype, device=logp.device)
    return torch.where(invalid, nan, logp), torch.where(invalid, nan, ent)
