"""The vocabulary-parallel block merge (spec 14; launched by vocab_triton.vocab_merge): every rank's vocabulary
blocks' statistics folded in global block order with the very merge and finalize of the single-process forward
kernel (vocab_fwd_triton._merge_block, _finalize), so that a split at multiples of VOCAB_BLOCK gives its bits."""
from __future__ import annotations

import triton
import triton.language as tl

from .vocab_fwd_triton import _finalize, _merge_block
from .vocab_jit import LOG2E, NEG_SENTINEL, _store_token
from .vocab_status import _token, _uncounted


@triton.jit(do_not_specialize=["NB", "V", "temp_stride"])
def _vocab_merge_kernel(
    blocks_ptr, zy_ptr, ids_ptr, mask_ptr,  # (n, NB, 3) block statistics in global block order; (n,) z_y; ids; mask
    logp_ptr, ent_ptr, stats_ptr, bad_ptr,  # outputs as _vocab_fwd_kernel's
    NB, V,  # blocks per token; the whole vocabulary's size (the ids' range)
    temp_ptr, temp_stride,
    state_ptr=None,  # (n, 3) the running (m, r, u): read first with HAS_INIT, written instead of outputs with FOLD
    HAS_MASK: tl.constexpr = True,
    TEMP_BY_VALUE: tl.constexpr = False,
    NAN_FLAGGED: tl.constexpr = False,
    HAS_INIT: tl.constexpr = False,
    FOLD: tl.constexpr = False,
):
    """The vocabulary-parallel merge: per counted token, blocks' statistics folded in global block order by
    _merge_block into the running row statistics (from the empty row, or with HAS_INIT from state_ptr), then
    _finalize: the very code of _vocab_fwd_kernel, so that with slice boundaries at multiples of VOCAB_BLOCK
    the outputs are bitwise the single-process ones. FOLD: the folded statistics written to state_ptr (the
    next rank folds its blocks into them); NB = 0 with HAS_INIT: the finalize of statistics folded before."""
    tok = tl.program_id(0).to(tl.int64)
    inv_temp, counted = _token(tok, temp_ptr, temp_stride, tok, mask_ptr, TEMP_BY_VALUE, HAS_MASK)
    logp, ent, m, log_s, q, bad = _uncounted()
    m_r = NEG_SENTINEL * 1.0
    r_r = 0.0
    u_r = 0.0
    if counted:
        if HAS_INIT:
            m_r = tl.load(state_ptr + tok * 3)
            r_r = tl.load(state_ptr + tok * 3 + 1)
            u_r = tl.load(state_ptr + tok * 3 + 2)
        c2 = inv_temp * LOG2E
        for b in range(0, NB):
            blk = blocks_ptr + (tok * NB + b) * 3
            m_r, r_r, u_r = _merge_block(m_r, r_r, u_r, tl.load(blk), tl.load(blk + 1), tl.load(blk + 2), c2)
        if not FOLD:
            y = tl.load(ids_ptr + tok).to(tl.int64)
            z_y = tl.load(zy_ptr + tok)
            logp, ent, m, log_s, q, bad = _finalize(m_r, r_r, u_r, z_y, (y >= 0) & (y < V), inv_temp)
    if FOLD:
        tl.store(state_ptr + tok * 3, m_r)
        tl.store(state_ptr + tok * 3 + 1, r_r)
        tl.store(state_ptr + tok * 3 + 2, u_r)
    else:
        if NAN_FLAGGED:
            logp = tl.where(bad != 0, float("nan"), logp)
            ent = tl.where(bad != 0, float("nan"), ent)
        _store_token(logp_ptr, ent_ptr, stats_ptr, bad_ptr, tok, logp, ent, m, log_s, q, bad)
