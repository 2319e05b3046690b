"""Spec 9's top-entropy mask on the epilogue path (objective/surrogate.top_entropy_mask is its eager twin):
only counted tokens whose entropy is >= the (1 - rho) quantile of the counted tokens' entropies keep their
policy term and their entropy bonus.

Between the forward pass and the epilogue, two launches: _entropy_key_kernel writes the sort key (a counted
token's entropy as the epilogue reads it, NaN where flagged; +inf where not counted, so that uncounted
tokens sort last), and torch.sort sorts it. The epilogue (epilogue_triton.py, TOP_ENT) then forms the
threshold from the sorted keys and its own count M after its pass 1 (_top_entropy_thr) and multiplies the
policy term and the bonus of each token by the mask (_top_entropy_w) in pass 2. The mask is a constant
multiplier (no gradient through the quantile), as on the eager path.

The threshold is the eager float32 computation step for step: pos = (max(M, 1) - 1) * (1 - rho) in float32,
lo = floor(pos), hi = min(lo + 1, max(M, 1) - 1), thr = v_lo + (v_hi - v_lo) * (pos - lo), v_lo where
v_hi == v_lo (inf - inf). Each product must be rounded before it is added: the epilogue is compiled without
fp fusion when TOP_ENT (loss_ops.epilogue), since an FMA would keep pos - lo = (M - 1) q - lo unrounded
(rho = 0.2, M = 11: 1.2e-7 instead of 0, which moves the threshold off the tokens tied at v_lo).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .epilogue_terms import _counted

KEY_BLOCK = 1024  # tokens per program of _entropy_key_kernel


@triton.jit(do_not_specialize=["N"])
def _entropy_key_kernel(ent_ptr, bad_ptr, mask_ptr, key_ptr, N, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """key[k] = H[k] where counted (NaN where flagged: bad[k] != 0), +inf elsewhere; float32 (N,)."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inb = o < N
    m = _counted(mask_ptr, o, inb, HAS_MASK)
    bad = tl.load(bad_ptr + o, mask=inb, other=0) != 0
    en = tl.load(ent_ptr + o, mask=inb, other=0.0).to(tl.float32)
    tl.store(key_ptr + o, tl.where(m, tl.where(bad, float("nan"), en), float("inf")), mask=inb)


def sorted_key(ent, bad, mask):
    """The counted entropies sorted ascending, uncounted tokens (+inf) after them and flagged ones (NaN)
    last: (n,) float32, two launches (none for n = 0: the epilogue then reads nothing)."""
    n = ent.numel()
    if n == 0:
        return ent
    key = torch.empty(n, device=ent.device, dtype=torch.float32)
    _entropy_key_kernel[(triton.cdiv(n, KEY_BLOCK),)](ent, bad, bad if mask is None else mask, key, n,
                                                       HAS_MASK=mask is not None, BLOCK=KEY_BLOCK, num_warps=4)
    return torch.sort(key).values


@triton.jit
def _top_entropy_thr(srt_ptr, M, N, q, DESCENDING: tl.constexpr):
    """The (1 - rho) = q quantile of the M counted entropies from the sorted keys (float32, as the eager
    top_entropy_mask; +inf with no token). The keys may be float64 (sorted with clip_cov's, kl_cov's in one
    launch; each a float32 value); DESCENDING: sorted descending (with kl_cov's), the exact reverse of the
    ascending order, so the j-th smallest is read at N - 1 - j."""
    last = tl.maximum(M.to(tl.float32), 1.0) - 1.0  # max(M, 1) - 1, in float32 as the eager M
    pos = last * q
    lo = tl.floor(pos).to(tl.int64)
    hi = tl.minimum(lo + 1, last.to(tl.int64))
    some = N > 0
    if DESCENDING:
        v_lo = tl.load(srt_ptr + (N - 1 - lo), mask=some, other=float("inf")).to(tl.float32)
        v_hi = tl.load(srt_ptr + (N - 1 - hi), mask=some, other=float("inf")).to(tl.float32)
    else:
        v_lo = tl.load(srt_ptr + lo, mask=some, other=float("inf")).to(tl.float32)
        v_hi = tl.load(srt_ptr + hi, mask=some, other=float("inf")).to(tl.float32)
    frac = pos - lo.to(tl.float32)
    thr = v_lo + (v_hi - v_lo) * frac
    thr = tl.where(v_hi == v_lo, v_lo, thr)
    # a NaN counted entropy (flagged or not; sorted last, first when descending) makes the quantile NaN
    if DESCENDING:
        edge = tl.load(srt_ptr, mask=some, other=0.0).to(tl.float32)
    else:
        edge = tl.load(srt_ptr + (N - 1), mask=some, other=0.0).to(tl.float32)
    return tl.where(edge != edge, float("nan"), thr)


@triton.jit
def _top_entropy_w(ent_out, o, inb, m, thr, M, BLOCK: tl.constexpr, TOP_ENT: tl.constexpr):
    """Per token of a block: 1.0 where the mask keeps it (counted, entropy >= thr, M > 0), else 0.0; all 1.0
    without the mask."""
    if TOP_ENT:
        en = tl.load(ent_out + o, mask=inb, other=0.0)
        keep = (m & (en >= thr) & (M > 0)).to(tl.float32)
        return tl.where(m, tl.where(thr != thr, float("nan"), keep), keep)  # (a NaN quantile: counted NaN)
    return tl.full([BLOCK], 1.0, tl.float32)
