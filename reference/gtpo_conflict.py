"""Conflict-token weights lambda of spec section 3, in plain Python loops (part of the float64 reference:
`gtpo_reference.conflict_weights`). Readability first: groups, completions and positions one by one."""
from __future__ import annotations

import torch

__all__ = ["conflict_weights"]


def _is_conflict(i, t_of, ids, mask, pos, neg, group):
    """raw_d[i, t_of(i)] of spec 3 for one alignment d.

    t_of(j) maps completion j to its row at the current aligned position (None if it has none).
    Holds when i's row is masked in and its token id stands, masked in, at the aligned row of at
    least one positive and at least one negative completion of the group (i itself counts)."""
    ti = t_of(i)
    if ti is None or not mask[i][ti]:
        return False
    token = ids[i][ti]
    seen_pos = seen_neg = False
    for j in group:
        tj = t_of(j)
        if tj is None or not mask[j][tj] or ids[j][tj] != token:
            continue
        seen_pos = seen_pos or pos[j]
        seen_neg = seen_neg or neg[j]
    return seen_pos and seen_neg


def conflict_weights(ids, mask, advantages, group_size, pos_weight=2.0, neg_weight=0.0):
    """-> (lam (B,T) float64, n_conf (B,) float64), spec section 3.

    Forward runs (rows aligned at row 0) and backward runs (rows right-aligned at each completion's
    last masked-in row) of conflict tokens; lam = lam_f * lam_b and
    n_conf = max(1, max(len_run_f, len_run_b)). mask may be bool/int/float (None = all ones);
    advantages (B,) or (B,1).
    """
    if ids.dim() != 2:
        raise ValueError(f"ids must be (B, T), got shape {tuple(ids.shape)}")
    B, T = ids.shape
    device = ids.device
    m_t = torch.ones((B, T), dtype=torch.bool, device=device) if mask is None else \
        torch.as_tensor(mask, device=device) != 0
    if tuple(m_t.shape) != (B, T):
        raise ValueError(f"mask must have shape {(B, T)}, got {tuple(m_t.shape)}")
    A_t = torch.as_tensor(advantages, device=device).reshape(-1)
    if A_t.numel() != B:
        raise ValueError(f"advantages must have B={B} entries, got shape {tuple(A_t.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if B % group_size != 0:
        raise ValueError(f"group_size={group_size} must divide the batch size B={B}")

    # Plain Python lists: the loops below read like the spec.
    ids_l = ids.tolist()
    mask_l = m_t.tolist()
    A = A_t.double().tolist()
    pos = [a > 0 for a in A]                    # spec 3: flags from the raw advantages
    neg = [a < 0 for a in A]
    # last masked-in row of every completion (None: nothing is masked in)
    last = [max((t for t in range(T) if mask_l[i][t]), default=None) for i in range(B)]

    lam = [[1.0] * T for _ in range(B)]
    n_conf = [1.0] * B

    def weight(i):
        return pos_weight if pos[i] else neg_weight

    for g in range(B // group_size):
        group = range(g * group_size, (g + 1) * group_size)
        for i in group:
            if not (pos[i] or neg[i]):
                continue                        # A = 0: inactive, lambda = 1 everywhere

            # Forward alignment: position k is row k of every completion.
            run_f = 0
            for k in range(T):
                if not _is_conflict(i, lambda j: k, ids_l, mask_l, pos, neg, group):
                    break                       # a non-conflict or masked-out row ends the run
                lam[i][k] *= weight(i)
                run_f += 1

            # Backward alignment: reverse index r is row last[j] - r of completion j.
            def row_from_end(j, r):
                if last[j] is None or last[j] - r < 0:
                    return None
                return last[j] - r

            run_b = 0
            for r in range(T):
                if not _is_conflict(i, lambda j: row_from_end(j, r), ids_l, mask_l, pos, neg, group):
                    break
                lam[i][last[i] - r] *= weight(i)   # lam = lam_f * lam_b (w**2 where runs overlap)
                run_b += 1

            # The authors OR the two runs in index space: the longer run's length (spec 3).
            n_conf[i] = float(max(1, run_f, run_b))

    return (torch.tensor(lam, dtype=torch.float64, device=device).reshape(B, T),
            torch.tensor(n_conf, dtype=torch.float64, device=device).reshape(B))
