"""The vocabulary-parallel merge of spec 12: each slice's statistics -> the whole vocabulary's, exactly,
around two all-reduces (the caller makes them, distributed.vocab_parallel.vp_forward):

    M = max_r m_r                                  (all-reduce MAX of local_max, 4 bytes per token)
    w_r = exp((m_r - M) / tau),  S = sum_r w_r S_r,  U = sum_r w_r (U_r + S_r (m_r - M) / tau)
    R = S - 1 summed without cancellation: the slices at the maximum add R_r, the others w_r S_r, plus
        (number of slices at the maximum - 1)
    (z_y - M) / tau from the slice that owns y;  whether y sits at the global maximum;  non-finite flags
                                                   (all-reduce SUM of local_sums' 7 numbers, 28 bytes)

then `finish`: log S = log1p(R), H = log S - U / S, logp = (z_y - M) / tau - log S and q = 1 - p_y as on
one device. A slice all at -inf (banned), an empty slice or a non-finite one adds nothing to the sums.
This module is the torch path (and the Triton kernels' twin in tests); `select(backend)` gives the
implementation: on the Triton backend the forward kernel stores local_max's values itself and
vp_merge_triton's two launches make the sums and the finish.
"""
from __future__ import annotations

import sys

import torch

from ..core.flags import BAD_ID, BAD_NONFINITE, BAD_TARGET_NEG_INF, nan_at_flags


def select(backend):
    """The module whose local_sums / finish the backend runs (local_max: this module's, the torch path's)."""
    if backend == "triton":
        from . import vp_merge_triton
        return vp_merge_triton
    return sys.modules[__name__]


def _slice(stats_r, ent_r, bad_r, V_local):
    m_r, ls_r = stats_r[:, 0], stats_r[:, 1]
    S_r = torch.exp(ls_r)
    nonfinite = ((bad_r & BAD_NONFINITE) != 0) | torch.isnan(ls_r) | torch.isnan(m_r)
    live = (S_r > 0) & ~torch.isnan(ent_r) & ~nonfinite & (V_local > 0)
    return m_r, ls_r, S_r, nonfinite, live


def local_max(stats_r, ent_r, bad_r, V_local):
    """This slice's row maximum, -inf where it adds nothing: the all-reduce MAX's input (a fresh tensor)."""
    m_r, _, _, _, live = _slice(stats_r, ent_r, bad_r, V_local)
    return torch.where(live, m_r, torch.full((), float("-inf"), dtype=m_r.dtype, device=m_r.device))


def local_sums(logp_r, ent_r, stats_r, bad_r, ids_loc, counted, M, temperature, V_local, id_start=0):
    """This slice's 7 numbers per token against the global maximum M: the all-reduce SUM's input (ids_loc -
    id_start: this slice's ids)."""
    m_r, ls_r, S_r, nonfinite, live = _slice(stats_r, ent_r, bad_r, V_local)
    inv_t = 1.0 / temperature  # a number or a tensor (no host read)
    m_eff = torch.where(live, m_r, torch.full((), float("-inf"), dtype=m_r.dtype, device=m_r.device))
    M_safe = torch.where(torch.isfinite(M), M, torch.zeros_like(M))
    zero = torch.zeros_like(S_r)
    delta = torch.where(live, (m_eff - M_safe) * inv_t, zero)
    w = torch.where(live, torch.exp(delta), zero)
    at_max = live & (m_eff == M)
    R_r = torch.expm1(ls_r)
    U_r = torch.where(live, (ls_r - ent_r) * S_r, zero)
    ids_loc, counted = ids_loc.reshape(-1) - id_start, counted.reshape(-1)
    owned = counted & (ids_loc >= 0) & (ids_loc < V_local)
    t_r = logp_r + ls_r  # (z_y - m_r) / tau on the owner
    return torch.stack([
        torch.where(live, w * S_r, zero),                           # S
        torch.where(live, w * (U_r + S_r * delta), zero),           # U
        torch.where(at_max, R_r, torch.where(live, w * S_r, zero)),  # R, less (slices at the max - 1)
        torch.where(owned, t_r + delta, zero),                      # (z_y - M) / tau
        at_max.to(S_r.dtype),                                       # slices at the maximum
        (owned & at_max & (t_r == 0)).to(S_r.dtype),                # the target at the global maximum
        (nonfinite & counted).to(S_r.dtype),
    ], 1)


def finish(vec, M, ids, counted, V, nan_flagged=False):
    """The merged sums -> (logp, H, stats = (M, log S, q), flags) per token, as ops.vocab_fwd returns them
    for the whole vocabulary (0 at tokens not counted; V: the whole vocabulary's size); nan_flagged: logp
    and H NaN at a flagged (counted) token."""
    ids, counted = ids.reshape(-1).long(), counted.reshape(-1)
    S, U, R = vec[:, 0], vec[:, 1], vec[:, 2] + (vec[:, 4] - 1).clamp(min=0)
    log_s = torch.log1p(R)
    ent = log_s - U / S
    logp = vec[:, 3] - log_s
    top = vec[:, 5] > 0
    q = torch.where(top, R / S, -torch.expm1(torch.where(top, torch.zeros_like(logp), logp)))
    bad = torch.where((vec[:, 6] > 0) | (M == float("inf")), BAD_NONFINITE, 0)
    bad = bad | torch.where(logp == float("-inf"), BAD_TARGET_NEG_INF, 0)
    bad = bad | torch.where((ids < 0) | (ids >= V), BAD_ID, 0)
    bad = torch.where(counted, bad, 0).to(torch.int8)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    M_safe = torch.where(torch.isfinite(M), M, torch.zeros_like(M))
    logp, ent, q = (torch.where(counted, x, zero) for x in (logp, ent, q))
    if nan_flagged:
        logp, ent = nan_at_flags(logp, ent, bad)
    return logp, ent, torch.stack([M_safe, torch.where(counted, log_s, zero), q], 1), bad
