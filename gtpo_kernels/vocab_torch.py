"""The vocabulary passes in plain PyTorch, a fixed number of rows at a time (the CPU path).

Same contract as `vocab_triton.logprob_fwd` / `logprob_bwd` and the same memory behaviour: only a
chunk of rows is ever upcast to float32, the forward keeps O(1) statistics per token, and the backward
recomputes the softmax from them, writing each chunk of the gradient in place.
"""
from __future__ import annotations

import torch

from .checks import BAD_ID, BAD_NONFINITE, BAD_TARGET_NEG_INF

# float32 elements upcast at a time (16 MiB): the chunk of rows is CHUNK_ELEMENTS // V rows.
CHUNK_ELEMENTS = 1 << 22


def _rows_per_chunk(V: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(V, 1))


def _acc_dtype(x):
    """float32 accumulation, float64 for float64 logits."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def logprob_fwd(logits3, ids, counted, temperature, logits_start):
    B, T_l, V = logits3.shape
    n = ids.numel()
    T = n // B if B else 0
    dev = logits3.device
    acc = _acc_dtype(logits3)
    logp = torch.zeros(n, device=dev, dtype=acc)
    ent = torch.zeros_like(logp)
    lse = torch.zeros_like(logp)
    q = torch.zeros_like(logp)
    bad = torch.zeros(n, device=dev, dtype=torch.int8)
    rows_idx = counted.nonzero().squeeze(1)  # masked-out rows are never read
    if rows_idx.numel() == 0 or V == 0:
        return logp, ent, lse, q, bad
    bi, ti = rows_idx // T, rows_idx % T + logits_start
    inv_t = 1.0 / temperature
    step = _rows_per_chunk(V)
    for k in range(0, rows_idx.numel(), step):
        sl = slice(k, k + step)
        idx = rows_idx[sl]
        s = logits3[bi[sl], ti[sl]].to(acc) * inv_t  # (rows, V): one chunk
        y = ids[idx].long()
        y_ok = (y >= 0) & (y < V)
        flag = ((s != s) | (s == float("inf"))).any(-1).to(torch.int8) * BAD_NONFINITE
        # lse = max + log1p(R), R the sum without the maximum element (exact for confident rows)
        mx = s.max(-1).values
        mx_safe = torch.where(mx == float("-inf"), torch.zeros_like(mx), mx)
        ex = torch.exp(s - mx_safe[:, None])
        r = ex.scatter(1, s.argmax(-1, keepdim=True), 0.0).sum(-1)
        c_lse = mx_safe + torch.log1p(r)
        c_lse = torch.where(mx == float("-inf"), mx, c_lse)
        c_lse_safe = torch.where(torch.isfinite(c_lse), c_lse, torch.zeros_like(c_lse))
        logq = s - c_lse_safe[:, None]
        p = torch.exp(logq)
        # H = -sum p log p, summed on log p (no cancellation between lse and sum p s)
        c_ent = -torch.where(p > 0, p * logq, torch.zeros_like(p)).sum(-1)
        s_y = s.gather(1, y.clamp(0, V - 1)[:, None]).squeeze(1)
        s_y = torch.where(y_ok, s_y, torch.full_like(s_y, float("nan")))
        # q = 1 - p_y as the sum of the other probabilities (exact for a confident token)
        c_q = p.scatter(1, y.clamp(0, V - 1)[:, None], 0.0).sum(-1)
        flag = flag | ((s_y == float("-inf")).to(torch.int8) * BAD_TARGET_NEG_INF)
        flag = flag | ((~y_ok).to(torch.int8) * BAD_ID)
        logp[idx] = torch.where((c_q < 0.5) & (s_y == s_y), torch.log1p(-c_q), s_y - c_lse)
        q[idx] = c_q
        ent[idx] = c_ent
        lse[idx] = c_lse
        bad[idx] = flag
        del s, p, logq, ex
    return logp, ent, lse, q, bad


def logprob_bwd(logits3, grad3, ids, lse, ent, q, c, e, temperature, logits_start):
    B, T_l, V = logits3.shape
    n = ids.numel()
    T = n // B if B else 0
    # rows outside the completion window, and rows with no gradient, are zeros
    active = c != 0
    if e is not None:
        active = active | (e != 0)
    if grad3.data_ptr() != logits3.data_ptr():
        grad3.zero_()
        zero_rows = None
    else:  # in place: zero what is outside the window and the inactive rows (after reading)
        grad3[:, :logits_start].zero_()
        grad3[:, logits_start + T:].zero_()
        zero_rows = (~active).nonzero().squeeze(1)
    rows_idx = active.nonzero().squeeze(1)
    inv_t = 1.0 / temperature
    step = _rows_per_chunk(V)
    for k in range(0, rows_idx.numel(), step):
        idx = rows_idx[k:k + step]
        bi, ti = idx // T, idx % T + logits_start
        s = logits3[bi, ti].to(lse.dtype) * inv_t
        logq = s - lse[idx, None]
        p = torch.exp(logq)
        cc = c[idx, None]
        g = -cc * p
        g.scatter_(1, ids[idx].long()[:, None], cc * q[idx, None])  # c (1 - p_y), with 1 - p_y = q
        if e is not None:
            g -= e[idx, None] * torch.where(p > 0, p * (logq + ent[idx, None]), torch.zeros_like(p))
        grad3[bi, ti] = (g * inv_t).to(grad3.dtype)
        del s, logq, p, g
    if zero_rows is not None and zero_rows.numel():
        grad3[zero_rows // T, zero_rows % T + logits_start] = 0
    return grad3
