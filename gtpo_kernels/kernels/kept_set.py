"""Recompute the sampler's kept sets from the current logits (spec 13), a block of rows at a time.

For each counted token (row (rows_b[m], rows_t[m]) of logits3, sampled id y[m]), on s = z' / tau in the
accumulation dtype, in vLLM's order:

    min-p   keep exp(s_v - max s) >= min_p          (p_v >= min_p * max p, on the full softmax)
    top-k   keep s_v >= the k-th largest remaining value (ties at it kept)
    top-p   sort what remains ascending, ties by ascending id (a stable sort of the id-ordered row),
            renormalize, remove the prefix whose cumulative mass is <= 1 - top_p, keep the last always

then entries at s = -inf (probability 0) are dropped, and the sampled token is added back where float
differences left it out (`restored`). One ascending stable sort per block serves both top-k (the k-th
largest remaining value is at position V - k, the removed entries being -inf at the front) and top-p;
when every row of the block has a top_k (<= TOPK_PATH), only the candidates at or above the k-th value
are sorted (torch.topk, then a stable sort of a few hundred entries per row). Memory: a block of
rows_per_block(V) rows of V values (and their sort indices), never (M, V); the output is the compressed
layout (token_ids, offsets), ids ascending within a set. Its size is only known on the host: one read
per block (the number of kept entries; the top-k path one more, the candidates' count).
"""
from __future__ import annotations

import torch

from ..core.layout import float_dtype_for
from .vocab_torch import CHUNK_ELEMENTS, _transform


def rows_per_block(V: int) -> int:
    """Rows per block: CHUNK_ELEMENTS values of the accumulation dtype, with their int64 sort indices."""
    return max(1, CHUNK_ELEMENTS // max(V, 1))


def _param(x, sl, off, dtype, device):
    """A block's slice of a per-token rule (number or (M,) tensor) as a (R,) tensor; None -> off."""
    if x is None:
        x = off
    if isinstance(x, torch.Tensor):
        return x[sl].to(device=device, dtype=dtype)
    return torch.full((sl.stop - sl.start,), x, dtype=dtype, device=device)


# the top-k path sorts only the candidates when every row of a block has 0 < top_k <= TOPK_PATH
TOPK_PATH = 4096


def _ascending(sm, k):
    """(values ascending, their ids) of each row of sm (R, V) that top-k leaves (ties by ascending id),
    the removed entries as -inf at the front. With every k in (0, TOPK_PATH] only the candidates
    s >= the k-th largest value are sorted (their count: one host read); else the whole row."""
    R, V = sm.shape
    ninf = float("-inf")
    if bool(((k > 0) & (k <= min(TOPK_PATH, V - 1))).all()):
        kth = torch.topk(sm, int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        cand = torch.where(sm >= kth, sm, torch.full_like(sm, ninf))
        vals, idx = torch.topk(cand, int((cand > ninf).sum(-1).max().clamp(min=1)), dim=-1)
        idx, perm = torch.sort(idx, dim=-1)  # ids ascending, then a stable sort by value
        srt, p2 = torch.sort(vals.gather(1, perm), dim=-1, stable=True)
        return srt, idx.gather(1, p2)
    srt, idx = torch.sort(sm, dim=-1, stable=True)
    # top-k: the k-th largest remaining value sits at V - k of the ascending sort (k = 0 or >= V: off)
    on_k = (k > 0) & (k < V)
    kth = srt.gather(1, (V - k.clamp(1, V))[:, None])
    kth = torch.where(on_k[:, None], kth, torch.full_like(kth, ninf))
    return torch.where(srt >= kth, srt, torch.full_like(srt, ninf)), idx  # a prefix: still sorted


def _block(s, k, top_p, min_p):
    """keep (R, V) bool of one block of s (R, V) (NaN already replaced by -inf)."""
    ninf = float("-inf")
    keep = s > ninf
    mx = s.max(-1, keepdim=True).values
    mx = torch.where(mx == ninf, torch.zeros_like(mx), mx)
    keep &= torch.exp(s - mx) >= min_p[:, None]  # min_p = 0 keeps every entry
    srt, idx = _ascending(torch.where(keep, s, torch.full_like(s, ninf)), k)
    # top-p on what remains (top_p = 1: off, so that underflowed masses are not removed); the masses summed in
    # float64, as the Triton kernel's: a cumulative mass just above the cut is not rounded onto it
    prob = torch.softmax(srt.to(torch.float64), dim=-1)
    cum = torch.cumsum(prob, dim=-1)
    drop = (cum <= (1.0 - top_p)[:, None]) & (top_p < 1)[:, None]
    drop[:, -1:].fill_(False)  # (fill_: no 0-d tensor made from a Python bool, a host-to-device copy on a GPU)
    kept_sorted = (srt > ninf) & ~drop
    return torch.zeros_like(keep).scatter_(1, idx, kept_sorted)


def kept_sets(logits3, rows_b, rows_t, y, tau, top_k=None, top_p=None, min_p=None, scale=1.0, softcap=None,
              block_rows=None):
    """The kept sets of the M counted tokens. tau, top_k, top_p, min_p: numbers or (M,) tensors (None:
    off); an invalid value (unvalidated input, flagged by core.sampling: its token NaN) is used as it is (a
    negative top_k as off).
    Returns token_ids (K,) int64, offsets (M + 1,) int64, restored (M,) bool (the sampled token was added
    back), nonfinite (M,) bool (the row holds NaN or +inf: its set means nothing, its outputs NaN) and
    kept_mass (M,) (the full softmax's mass on the set, for metrics["kept_mass"])."""
    M = y.numel()
    V = logits3.shape[-1]
    dev = logits3.device
    acc = float_dtype_for(logits3)
    step = block_rows or rows_per_block(V)
    ids, counts, restored, nonfinite, mass = [], [], [], [], []
    for r0 in range(0, M, step):
        sl = slice(r0, min(M, r0 + step))
        z = _transform(logits3[rows_b[sl], rows_t[sl]].detach().to(acc), scale, softcap)  # sets, masses: no gradient
        s = z * (1.0 / _param(tau, sl, 1.0, acc, dev))[:, None]
        nf = (torch.isnan(s) | (s == float("inf"))).any(-1)
        s = torch.where(torch.isnan(s), torch.full_like(s, float("-inf")), s)
        k = _param(top_k, sl, 0, torch.long, dev).clamp(min=0)
        # top_p, min_p as they are: a number's float rounding at its range's open end (top_p 1e-50 -> 0, min_p
        # 1 - 1e-9 -> 1) keeps what the rules keep there, and an invalid value's token is NaN (the caller's flags)
        tp = _param(top_p, sl, 1.0, acc, dev)
        mp = _param(min_p, sl, 0.0, acc, dev)
        keep = _block(s, k, tp, mp)
        yl = y[sl].long()[:, None]
        yc = yl.clamp(0, max(V - 1, 0))
        held, inr = keep.gather(1, yc), (yl >= 0) & (yl < V)  # (an id outside [0, V) is no column: its token NaN)
        rest = (~held & inr).squeeze(1)
        keep.scatter_(1, yc, held | inr)
        mass.append(torch.where(keep, torch.softmax(s, -1), torch.zeros_like(s)).sum(-1))
        nz = keep.nonzero()  # row-major: ids ascending within each row
        ids.append(nz[:, 1])
        counts.append(keep.sum(-1))
        restored.append(rest)
        nonfinite.append(nf)
        del z, s, keep
    if M == 0:
        e = torch.zeros(0, dtype=torch.long, device=dev)
        return e, torch.zeros(1, dtype=torch.long, device=dev), e.bool(), e.bool(), e.to(acc)
    counts = torch.cat(counts)
    offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    return torch.cat(ids), offsets, torch.cat(restored), torch.cat(nonfinite), torch.cat(mass)
