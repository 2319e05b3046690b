"""The rollout/training mismatch of spec 14, measured where both log-probs meet: over the counted tokens,
d = logp - rollout_logps (logp replayed over the sampler's kept sets when they are in use)."""
from __future__ import annotations

import torch

NAMES = ("rollout_k3", "rollout_abs_diff", "rollout_max_abs_diff", "rollout_outside_frac", "rollout_nan_frac")


def k3_of(d):
    """exp(d) - 1 - d without cancellation: its Taylor series for |d| < 0.1 (to d^12), expm1(d) - d
    elsewhere, +inf at d = +inf. d float64."""
    series = torch.zeros_like(d)
    term = d * d / 2.0
    for k in range(3, 14):
        series = series + term
        term = term * d / k
    direct = torch.where(d == float("inf"), float("inf"), torch.expm1(d) - d)
    return torch.where(d.abs() < 0.1, series, direct)


@torch.no_grad()
def rollout_metrics(logp, rollout_logps, counted, dtype):
    """{name: 0-d tensor in dtype} (NAMES): means over the counted tokens whose d is not NaN (0 when there
    are none), the maximum |d| over them, and the fraction of counted tokens whose d is NaN. Computed in
    float64 whatever the inputs' dtype, so that k3 of a small d (about d**2 / 2) keeps its digits."""
    d = logp.reshape(-1).double() - rollout_logps.reshape(-1).double()
    m = counted.reshape(-1)
    nan = m & torch.isnan(d)
    ok = m & ~nan
    zero = torch.zeros((), dtype=torch.float64, device=d.device)
    d = torch.where(ok, d, zero)
    n_ok = ok.sum(dtype=torch.float64).clamp(min=1)
    r = torch.exp(d)
    vals = torch.stack([torch.where(ok, k3_of(d), zero).sum() / n_ok, d.abs().sum() / n_ok,
                        torch.cat([d.abs(), zero.reshape(1)]).max(),
                        (ok & ((r < 0.9) | (r > 1.1))).sum(dtype=torch.float64) / n_ok,
                        nan.sum(dtype=torch.float64) / m.sum(dtype=torch.float64).clamp(min=1)]).to(dtype)
    return dict(zip(NAMES, vals.unbind()))
