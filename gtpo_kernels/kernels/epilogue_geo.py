"""geo_mean (verl's GMPO) in the epilogue kernel's pass 1: per completion, the sums that make its log R
(objective/verl_modes.geo_mean, surrogate.geo_mean_log_w). The token terms are epilogue_terms._policy's
(POLICY 8); pass 2 spreads d loss / d log R over the tokens the clip did not stop, as the sequence level
spreads d loss / d log r."""
from __future__ import annotations

import triton
import triton.language as tl

from .epilogue_terms import _finite_or_nan, _rollout_w


@triton.jit
def _geo_sums(o, inb, m, lp, old_ptr, rw_ptr, lo, hi, HAS_OLD: tl.constexpr, RW: tl.constexpr):
    """A block's float64 sums over its counted tokens of min(log r, xc) and max(log r, xc), xc = clip(log r,
    -eps_low, eps_high) (y for Ahat > 0 and Ahat < 0), and with per-token rollout weights (RW 1) of
    log(w + 1e-10) (NaN for a weight not finite and >= 0); lp: the tokens' logp (NaN where flagged)."""
    if HAS_OLD:
        old = _finite_or_nan(tl.where(m, tl.load(old_ptr + o, mask=inb, other=0.0).to(tl.float32), 0.0))
        lr = lp - old
    else:
        lr = lp - lp
    xc = tl.minimum(tl.maximum(lr, -lo, propagate_nan=tl.PropagateNan.ALL), hi, propagate_nan=tl.PropagateNan.ALL)
    y_lo = tl.where(m, tl.minimum(lr, xc, propagate_nan=tl.PropagateNan.ALL), 0.0)
    y_hi = tl.where(m, tl.maximum(lr, xc, propagate_nan=tl.PropagateNan.ALL), 0.0)
    if RW == 1:
        w = _rollout_w(tl.load(rw_ptr + o, mask=inb, other=1.0).to(tl.float32))
        lw = tl.where(m, tl.log(w + 1e-10), 0.0)
    else:
        lw = tl.zeros_like(lr)
    return (tl.sum(y_lo.to(tl.float64), axis=0), tl.sum(y_hi.to(tl.float64), axis=0),
            tl.sum(lw.to(tl.float64), axis=0))


@triton.jit
def _geo_log_w(lw_sum, rw_ptr, i, n_safe, RW: tl.constexpr):
    """Completion i's log of its geometric-mean rollout weight: the mean of log(w + 1e-10) over its counted
    tokens (RW 1: lw_sum, _geo_sums'), log(w_i + 1e-10) per completion (RW 2), else 0."""
    if RW == 1:
        return lw_sum.to(tl.float32) / n_safe
    elif RW == 2:
        return tl.log(_rollout_w(tl.load(rw_ptr + i).to(tl.float32)) + 1e-10)
    return n_safe * 0.0
