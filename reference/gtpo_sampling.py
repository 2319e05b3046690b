"""Float64 reference of spec 13: the sampler's distribution.

- `kept_sets`: the kept set K_t of each token rebuilt from its logits by vLLM's rules, by sorting (min-p
  on the full softmax, then top-k with ties kept, then top-p on an ascending sort with ties by ascending
  token id), the sampled token restored when float differences left it out.
- `replay_logprobs`: logp and entropy of the temperature-scaled softmax restricted to K_t, given as the
  compressed layout `sampling_mask = (token_ids, offsets)`, differentiable (exactly 0 outside K_t).
- `sampling_metrics`: kept_mass, mean_kept_size, replay_restored_frac.
- `replay_token_logprobs`: the same on a padded (B, T, V) or packed (N, V) batch with per-completion or
  per-token temperature / top_k / top_p / min_p.

Rows here are the counted tokens in the packed order (padded form: row-major over counted positions),
M of them. Readability first: plain loops over rows, everything in float64. No package import.
"""
from __future__ import annotations

import torch

from .gtpo_reference import _full_logp_entropy

__all__ = ["per_token", "kept_set_row", "kept_sets", "replay_logprobs", "sampling_metrics",
           "replay_token_logprobs"]

_F64 = torch.float64


def per_token(name, x, mask, cu_seqlens=None, default=None):
    """x at the counted positions, (M,) float64 in the packed order. `mask` (B, T) (padded) or (N,)
    (packed, with cu_seqlens (B + 1,)). x: None (-> default), a number, a tensor per completion
    ((B,) or (B, 1)) or per token ((B, T), or (N,) packed)."""
    mask = mask.bool()
    if x is None:
        x = default
    if not isinstance(x, torch.Tensor):
        return torch.full((int(mask.sum()),), float(x), dtype=_F64)
    x = x.detach().to(_F64)
    if mask.dim() == 2:
        B, T = mask.shape
        if x.shape == (B, T):
            return x[mask]
        if x.shape in ((B,), (B, 1)):
            return x.reshape(B, 1).expand(B, T)[mask]
        raise ValueError(f"{name}: expected a number, ({B},), ({B}, 1) or ({B}, {T}), got {tuple(x.shape)}")
    N = mask.shape[0]
    B = cu_seqlens.numel() - 1 if cu_seqlens is not None else None
    if B is not None and B == N and x.shape == (N,):
        raise ValueError(f"{name}: shape ({N},) is per completion and per token alike (B == N)")
    if x.shape == (N,):
        return x[mask]
    if B is not None and x.shape in ((B,), (B, 1)):
        counts = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        return torch.repeat_interleave(x.reshape(B), counts)[mask]
    raise ValueError(f"{name}: expected a number, ({N},) or (B,) with cu_seqlens, got {tuple(x.shape)}")


def kept_set_row(s, top_k=0, top_p=1.0, min_p=0.0):
    """K of one row of s = z' / tau (V,), as sorted token ids. vLLM's order (spec 13):
    1. min-p on the full softmax: keep p_v >= min_p * max p;
    2. top-k: keep the values >= the k-th largest remaining value (ties at it kept);
    3. top-p: sort what remains ascending, ties by ascending token id, renormalize, remove the prefix
       whose cumulative mass is <= 1 - top_p, always keeping the last (largest) one.
    Entries at s = -inf (probability 0: the sampler never draws them) are never in K."""
    s = s.to(_F64)
    x = s.tolist()  # Python floats (float64), read once
    V = len(x)
    keep = [x[v] > float("-inf") for v in range(V)]
    if min_p > 0:
        p = torch.softmax(s, 0).tolist()
        bar = min_p * max(p)
        keep = [keep[v] and p[v] >= bar for v in range(V)]
    if top_k and top_k > 0:
        vals = sorted((x[v] for v in range(V) if keep[v]), reverse=True)
        if top_k < len(vals):
            kth = vals[top_k - 1]
            keep = [keep[v] and x[v] >= kth for v in range(V)]
    if top_p < 1:
        order = sorted((v for v in range(V) if keep[v]), key=lambda v: (x[v], v))
        cum = torch.cumsum(torch.softmax(s[torch.tensor(order, dtype=torch.long)], 0), 0).tolist()
        for j, v in enumerate(order[:-1]):  # the last (largest) is always kept
            if cum[j] <= 1 - top_p:
                keep[v] = False
    return torch.tensor([v for v in range(V) if keep[v]], dtype=torch.long)


def _row_param(x, r, off):
    if x is None:
        return off
    return float(x[r]) if isinstance(x, torch.Tensor) and x.dim() else float(x)


def kept_sets(logits, temperature=1.0, top_k=None, top_p=None, min_p=None, targets=None):
    """K_t of each row of `logits` (M, V) (z', after scale and soft-cap), recomputed from s = z' / tau.
    temperature, top_k, top_p, min_p: numbers or (M,) tensors (top_k 0 / None, top_p 1, min_p 0: off).
    targets (M,): the sampled tokens, added back where the rules left them out.
    Returns (token_ids (K,), offsets (M + 1,)) int64 and restored (M,) bool."""
    M = logits.shape[0]
    ids, counts, restored = [], [0], torch.zeros(M, dtype=torch.bool)
    for r in range(M):
        tau = _row_param(temperature, r, 1.0)
        k = int(_row_param(top_k, r, 0))
        row = kept_set_row(logits[r].detach().to(_F64) / tau, k, _row_param(top_p, r, 1.0),
                           _row_param(min_p, r, 0.0))
        if targets is not None and not bool((row == int(targets[r])).any()):
            row = torch.sort(torch.cat([row, targets[r].reshape(1).long()])).values
            restored[r] = True
        ids.append(row)
        counts.append(row.numel())
    token_ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)
    return token_ids, torch.cumsum(torch.tensor(counts, dtype=torch.long), 0), restored


def replay_logprobs(logits, targets, sampling_mask, temperature=1.0):
    """Per row of `logits` (M, V) (z'), over its kept set K (sampling_mask = (token_ids, offsets)):
    logp = s_y - log sum_{v in K} exp(s_v),  H = -sum_{v in K} p^K_v log p^K_v,  s = z' / tau.
    Returns (logp (M,), H (M,)) float64, differentiable w.r.t. logits: the gradient is
    [v = y] - p^K_v and -p^K_v (log p^K_v + H) on K and exactly 0 outside it."""
    token_ids, offsets = sampling_mask
    M = logits.shape[0]
    logp, ent = [], []
    for r in range(M):
        ids = token_ids[int(offsets[r]):int(offsets[r + 1])].long()
        pos = (ids == int(targets[r])).nonzero()
        if pos.numel() != 1:
            raise ValueError(f"sampling_mask: the sampled token {int(targets[r])} of row {r} is not once in its set")
        tau = _row_param(temperature, r, 1.0)
        s_k = logits[r].to(_F64)[ids] / tau  # index_select: the gradient flows back to K only
        lp, h = _full_logp_entropy(s_k.reshape(1, 1, -1), pos.reshape(1, 1), 1.0)
        logp.append(lp.reshape(()))
        ent.append(h.reshape(()))
    empty = logits.new_zeros(0, dtype=_F64)
    return (torch.stack(logp) if logp else empty), (torch.stack(ent) if ent else empty)


def sampling_metrics(logits, sampling_mask, temperature=1.0, restored=None):
    """kept_mass: mean over rows of the full-vocabulary mass of softmax(z' / tau) on K;
    mean_kept_size: mean |K|; replay_restored_frac: fraction of rows whose sampled token was restored
    (0 for a given mask). Rows = counted tokens; 0-d float64 tensors (0 with no rows)."""
    token_ids, offsets = sampling_mask
    M = logits.shape[0]
    mass = []
    for r in range(M):
        ids = token_ids[int(offsets[r]):int(offsets[r + 1])].long()
        p = torch.softmax(logits[r].detach().to(_F64) / _row_param(temperature, r, 1.0), 0)
        mass.append(p[ids].sum())
    sizes = (offsets[1:] - offsets[:-1]).to(_F64)
    n = max(M, 1)
    rest = torch.zeros(M, dtype=torch.bool) if restored is None else restored
    return {"kept_mass": (torch.stack(mass).sum() if mass else torch.zeros((), dtype=_F64)) / n,
            "mean_kept_size": sizes.sum() / n, "replay_restored_frac": rest.to(_F64).sum() / n}


def replay_token_logprobs(logits, ids, mask=None, *, temperature=1.0, sampling_mask=None, top_k=None,
                          top_p=None, min_p=None, cu_seqlens=None):
    """The replayed (logp, entropy) of a batch: logits (B, T, V) and ids (B, T), or packed logits (N, V)
    and ids (N,) with cu_seqlens; 0 at uncounted positions. Per-token parameters as `per_token` takes
    them. With sampling_mask the sets are given (one per counted token, in the packed order); else they
    are recomputed from top_k / top_p / min_p (all None: K = the vocabulary).
    Returns (logp, entropy, metrics, (token_ids, offsets))."""
    if sampling_mask is not None and (top_k, top_p, min_p) != (None, None, None):
        raise ValueError("sampling_mask is given together with top_k / top_p / min_p")
    m = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask.bool()
    rows = logits[m]  # (M, V), the counted tokens in the packed order
    y = ids[m].long()
    tau = per_token("temperature", temperature, m, cu_seqlens, 1.0)
    if sampling_mask is None:
        sampling_mask = kept_sets(rows, tau, per_token("top_k", top_k, m, cu_seqlens, 0),
                                  per_token("top_p", top_p, m, cu_seqlens, 1.0),
                                  per_token("min_p", min_p, m, cu_seqlens, 0.0), y)
        sampling_mask, restored = sampling_mask[:2], sampling_mask[2]
    else:
        restored = None
    lp, h = replay_logprobs(rows, y, sampling_mask, tau)
    logp = torch.zeros(ids.shape, dtype=_F64).masked_scatter(m, lp)
    ent = torch.zeros(ids.shape, dtype=_F64).masked_scatter(m, h)
    return logp, ent, sampling_metrics(rows, sampling_mask, tau, restored), sampling_mask
