"""Which schedule the head's `auto` runs: both schedules' GEMM FLOPs as the head accounting counts them
(spec 11), the cheaper one chosen.

    fused      2 V D (N + 2 L)        the projection of the N counted rows, and the two gradient GEMMs on
                                      the L rows not known to have a zero gradient before any logit is
                                      read (tiles.prior_live: zero advantages without shaping, lambda = 0)
    recompute  2 V D (N + 3 N_nz)     the projection, then the N_nz rows whose coefficients are nonzero
                                      projected again with both gradient GEMMs (N_nz <= L)

Before the forward, N_nz is known where no logit decides it: the model then takes N_nz = L (clipping
zeroes a few tokens more; the fused schedule stays cheaper). The entropy filter drops whole completions
by their entropy, any fraction of them: for a kept fraction k of the L rows, fused costs 2 L whatever k
and recompute 3 k L. The model takes k's expectation over [0, 1], N_nz = L / 2: recompute, which costs
at most 1.5x fused's gradient GEMMs (nothing dropped) where fused wastes all of its own when everything
is. A measured N_nz (the head accounting's) gives each schedule's cost on that batch.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

FILTER_KEPT = 0.5  # the entropy filter's expected kept fraction of rows, before the logits are read


class ScheduleCost(NamedTuple):
    fused: Optional[float]  # modeled GEMM FLOPs of the fused schedule (None: it cannot run)
    recompute: float  # modeled GEMM FLOPs of the recompute schedule
    N_nz: float  # rows with a nonzero gradient the model used (given, or its expectation)
    choice: str  # 'fused' or 'recompute': the cheaper (fused on a tie: nothing kept until the backward)


def expected_nonzero(cfg, N_live) -> float:
    """The rows expected to get a gradient, before the logits are read, of the N_live rows not known to
    be zero: all of them, or FILTER_KEPT of them with the entropy filter on."""
    return N_live * (FILTER_KEPT if cfg.entropy_threshold is not None else 1.0)


def schedule_cost(cfg, V, D, N, N_live=None, N_nz=None, fused_ok=True) -> ScheduleCost:
    """Both schedules' GEMM FLOPs for a call with N counted rows, N_live of them not known to be zero
    before the logits (default N), N_nz with a nonzero gradient (default: the model's expectation for
    `cfg`); V, D: the head's size. fused_ok=False: the fused schedule cannot run (its cost is None)."""
    N_live = N if N_live is None else N_live
    N_nz = expected_nonzero(cfg, N_live) if N_nz is None else N_nz
    unit = 2.0 * V * D
    fused = unit * (N + 2 * N_live) if fused_ok else None
    recompute = unit * (N + 3 * N_nz)
    choice = "fused" if fused is not None and fused <= recompute else "recompute"
    return ScheduleCost(fused, recompute, N_nz, choice)
