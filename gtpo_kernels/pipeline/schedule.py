"""Which schedule the head's `auto` runs (spec 11): a model of each schedule's time from its GEMM FLOPs,
the bytes its tiles and accumulators move and its launches, the faster one chosen (`predict`), on the
GEMM FLOPs as the head accounting counts them (`schedule_cost`):

    fused      2 V D (N + 2 L)        the projection of the N counted rows, and the two gradient GEMMs on
                                      the L rows not known to have a zero gradient before any logit is
                                      read (tile_plan.prior_live: zero advantages without shaping, lambda = 0)
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

import math
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


# The time model, fitted by least squares to the 2026-12-04 GPU record (one H200, bf16, V = 151936:
# bench/results/gpu-20261204/linear-cuda-d2048-with-liger.json and -d4096-: both schedules at N x D =
# 4096 x 2048 and 8192 x 4096, 883-row tiles; residual 0.23 ms over the four times): a GEMM TFLOP, a GB
# moved by the vocabulary kernels and the accumulators, a launch of the small kernels between the GEMMs.
MS_PER_TFLOP = 1.091  # 917 TFLOP/s
MS_PER_GB = 0.3037  # 3.29 TB/s
MS_PER_LAUNCH = 0.0195
# launches of the call apart from its tiles, of a forward tile (fused: its whole tile), of a backward tile
LAUNCHES_CALL, LAUNCHES_FWD_TILE, LAUNCHES_FUSED_TILE, LAUNCHES_BWD_TILE = 40, 3, 7, 5


class TimeModel(NamedTuple):
    fused: Optional[float]  # predicted ms (None: the schedule cannot run)
    recompute: float
    choice: str
    terms: dict  # per schedule: (TFLOP, GB, launches)


def predict(cfg, V, D, N, per_tile, elem_bytes=2, N_live=None, N_nz=None, fused_ok=True) -> TimeModel:
    """Both schedules' predicted forward + backward time (ms) for N counted rows at a budget of per_tile
    whole rows a tile and elem_bytes a logit (the projection's dtype): GEMM FLOPs as schedule_cost; bytes
    the logits tiles' (written by the GEMM, read by the forward kernel; the gradient kernel's read and
    write) and the float32 accumulators' (the fused schedule's weight gradient, read and written once a
    tile; the recompute backward's, head_backward.traffic); launches as counted (tests/test_launches.py)."""
    from .head_backward import plan, traffic
    N_live = N if N_live is None else N_live
    N_nz = expected_nonzero(cfg, N_live) if N_nz is None else N_nz
    flops = schedule_cost(cfg, V, D, N, N_live, N_nz, fused_ok)
    tile_bytes = lambda rows: rows * V * elem_bytes  # noqa: E731  (one pass over rows of logits)
    tiles = max(1, math.ceil(N / max(1, per_tile)))
    terms = {}
    if fused_ok:
        gb = (2 * tile_bytes(N) + 2 * tile_bytes(N_live) + tiles * 2 * V * D * 4) / 1e9
        terms["fused"] = (flops.fused / 1e12, gb, LAUNCHES_CALL + LAUNCHES_FUSED_TILE * tiles)
    n_nz = int(math.ceil(N_nz))
    p = plan(n_nz, V, per_tile)
    bwd_tiles = math.ceil(n_nz / p.rows) * math.ceil(V / p.cols) if n_nz else 0
    gb = (2 * tile_bytes(N) + 3 * tile_bytes(n_nz) + traffic(n_nz, V, D, p)) / 1e9
    terms["recompute"] = (flops.recompute / 1e12, gb, LAUNCHES_CALL + LAUNCHES_FWD_TILE * tiles
                          + LAUNCHES_BWD_TILE * bwd_tiles)
    ms = {k: t * MS_PER_TFLOP + g * MS_PER_GB + n * MS_PER_LAUNCH for k, (t, g, n) in terms.items()}
    choice = "fused" if fused_ok and ms["fused"] <= ms["recompute"] else "recompute"
    return TimeModel(ms.get("fused"), ms["recompute"], choice, terms)
