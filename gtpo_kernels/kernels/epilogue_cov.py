"""verl's clip_cov and kl_cov on the epilogue kernel (objective/verl_modes.py is their eager twin): a token's
term depends on a choice over the whole batch, made in two launches of the epilogue around one sort.

    cov_t = (A_t - mean A) (logp_t - mean logp), the means over the counted tokens
    clip_cov   key_t = u_t where counted, not on the PPO clip and clip_cov_lb < cov_t < clip_cov_ub
               (u: the call's uniform draws, float64, as the eager path draws them), else 2; ascending
    kl_cov     key_t = cov_t where counted, else -inf; descending (NaN first, as torch's)

The first launch (PHASE 1) runs pass 1 (the means from its per-completion sums) and writes the keys
(_cov_keys); torch.sort(stable=True) orders them; the second launch (PHASE 0) reads the k-th key and its index
(_cov_kth: k = max(1, floor(ratio M)) in float64) and chooses a token when its (key, index) comes at or before
that pair in the stable order (_cov_sel): the first k of the order, ties by index, as verl_modes.first_k's
ranks, with no scatter. Every choice is a candidate's (clip_cov) or a counted token's (kl_cov).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .epilogue_policy import _ppo_parts
from .epilogue_terms import _counted, _span, _token_adv, _token_log_r


@triton.jit
def _cov_keys(key_ptr, draws_ptr, logp_out, old_ptr, mask_ptr, scratch_ptr, cu_fix, B, T, adv_ptr, malformed,
              mean_a, mean_lp, cov_lb, cov_ub, lo, hi, delta, dual_c, BLOCK: tl.constexpr, PACKED: tl.constexpr,
              HAS_MASK: tl.constexpr, HAS_OLD: tl.constexpr, CLIP: tl.constexpr, HAS_DELTA: tl.constexpr,
              HAS_DUAL: tl.constexpr, POLICY: tl.constexpr, TOK_ADV: tl.constexpr):
    """The sort keys (float64, (N,)) of clip_cov (POLICY 10) or kl_cov (11), from pass 1's logp (logp_out)
    and Ahat (scratch; TOK_ADV: each token's advantage, adv_ptr) and the batch's means (float32, as the eager
    covariance)."""
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    for i in range(B):
        start, end = _span(cu_fix, i, T, PACKED)
        a_i = tl.load(scratch_ptr + i)
        for t0 in range(start, end, BLOCK):
            o = t0 + lanes
            inb = o < end
            m = _counted(mask_ptr, o, inb, HAS_MASK)
            lp = tl.load(logp_out + o, mask=inb, other=0.0)
            a_t = _token_adv(adv_ptr, o, inb, m, malformed) if TOK_ADV else a_i
            cov = (a_t - mean_a) * (lp - mean_lp)
            if POLICY == 10:
                _, lr = _token_log_r(o, inb, m, lp, old_ptr, HAS_OLD)
                _, _, _, on_clip, _ = _ppo_parts(tl.exp(lr), a_t, lo, hi, delta, dual_c, CLIP, HAS_DELTA, HAS_DUAL)
                cand = m & (on_clip == 0) & (cov > cov_lb) & (cov < cov_ub)
                key = tl.where(cand, tl.load(draws_ptr + o, mask=inb, other=2.0), 2.0)
            else:
                key = tl.where(m, cov, float("-inf")).to(tl.float64)
            tl.store(key_ptr + o, key, mask=inb)


@triton.jit
def _cov_kth(val_ptr, idx_ptr, M, N, ratio_bits):
    """(the k-th smallest key in the sort's order, its token index), k = max(1, floor(ratio M)) in float64
    (ratio_bits: the ratio's float64 bits), past the last token the last one's; nothing is read with N = 0."""
    ratio = ratio_bits.to(tl.int64).to(tl.float64, bitcast=True)
    k = tl.maximum(tl.floor(ratio * M.to(tl.float64)), 1.0)
    j = tl.minimum(k, N * 1.0).to(tl.int64) - 1
    some = N > 0
    j = tl.maximum(j, 0)
    return tl.load(val_ptr + j, mask=some, other=0.0), tl.load(idx_ptr + j, mask=some, other=-1)


@triton.jit
def _cov_sel(key_ptr, o, inb, m, kv, ki, POLICY: tl.constexpr):
    """The block's chosen tokens: candidates (clip_cov: key < 2; kl_cov: counted) whose (key, index) is at
    or before (kv, ki) in the stable sort's order (ascending; kl_cov descending, NaN first); all False for
    the other terms."""
    if POLICY == 10:
        a = tl.load(key_ptr + o, mask=inb, other=2.0)
        return inb & (a < 2.0) & ((a < kv) | ((a == kv) & (o <= ki)))
    elif POLICY == 11:
        a = tl.load(key_ptr + o, mask=inb, other=0.0)
        tie = o <= ki
        return m & tl.where(kv != kv, (a != a) & tie, (a != a) | (a > kv) | ((a == kv) & tie))
    return o < 0
