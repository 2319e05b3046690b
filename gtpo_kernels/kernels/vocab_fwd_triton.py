"""The forward statistics pass over the vocabulary (Triton); launched by vocab_triton.vocab_fwd.

Layout shared by both kernels (vocab_bwd_triton too). `logits` is viewed as (B, T_l, V) with any row strides and vocabulary
stride 1; token (i, t) of the completions (B, T) is predicted by logits row (i, logits_start + t). The
packed form is the same with B = 1. Per-token tensors (ids, mask, outputs) are contiguous (B*T,).

Forward, per counted token, with s = z / tau over the row (spec section 1):
    lse = log sum_v exp(s_v)        logp = s_y - lse        H = lse - sum_v p_v s_v
in one streaming pass over blocks of the row with no reduction across lanes inside the loop: every lane
(BLOCK_V / 2 of them; lane l takes entries v0 + l and v0 + BLOCK_V / 2 + l of the block at v0, two
coalesced loads) keeps its own running maximum m_l of the raw logits and
its sums over d = (z - m_l) / tau (computed as a difference first, so its accuracy does not depend on the
size of z / tau), with exp(d) = exp2(t), t = (z - m_l) * c2, c2 = log2(e) / tau folded into one scale:
    r_l = (sum e^d) - 1 (one instance of m_l left out, ties inside the lane included),   u_l = sum e^d t <= 0.
One exp2 per element (the pass must stay under the special-function units' rate to stay memory-bound):
x = exp2(-|t|) is e^d when z <= m_l, and the rescale of the lane's sums when z raises m_l (then z itself
contributes 1 and is the instance left out). The row is read in vocabulary blocks of VOCAB_BLOCK entries
(gtpo_kernels.VOCAB_BLOCK, a multiple of BLOCK_V; spec 14), each with fresh lanes; at the end of a block
(_block_stats), its maximum m = max m_l, the lanes re-based on it with alpha_l = exp2((m_l - m) c2), and
    R = S - 1 = sum alpha_l r_l + sum_{m_l < m} alpha_l + (number of lanes with m_l = m) - 1,
    U = sum alpha_l (u_l + (1 + r_l) (m_l - m) c2)   (U ln 2 = sum e^d d),
all sums of non-negative (U: non-positive) terms, so nothing cancels and the count of entries tied at the
maximum comes out of the last term instead of being summed every block. The blocks' (m, R, U) are folded
into the row's in block order by _merge_block (the same sums across blocks: nothing cancels), S = 1 + R;
the vocabulary-parallel merge kernel folds every rank's blocks with the same function, so that a split at
multiples of VOCAB_BLOCK gives the same bits. Then H = log S - U / S, and
log S = log1p(R): a confident row (p_max ~ 1) keeps its digits, where float32 S - 1 would lose them. For
the target, logp = (z_y - m) / tau - log1p(R), and q = 1 - p_y is R / S when y holds the maximum (the one
case where 1 - p_y cancels), 1 - exp(logp) otherwise (then p_y < 1/2). A lane starts at m_l = -FLT_MAX
(a row whose entries are all -inf has no finite maximum and gives S = 0, as before) and |t| is clamped at
1e30 so that -inf entries give x = 0 and x |t| = 0; the clamp keeps NaN (propagate_nan), so a NaN entry
makes its lane's r_l, hence R and S, NaN; +inf shows as m = +inf. The whole blocks are read without a
mask, the partial last block with one.
Per token, backward gets stats = (m, log S, q): lse = m / tau + log S is never formed, so that
log p_v = (z_v - m) / tau - log S stays exact at any magnitude.

z here is the transformed logit z' of vocab_jit (scale, soft-cap, applied on load); m, the flags and the
statistics refer to it.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..core.vocab_block import VOCAB_BLOCK as _VOCAB_BLOCK
from .vocab_status import _fold_status, _offsets_bad, _tau_at, _token, _uncounted
from .vp_merge_triton import _live_max
from .vocab_jit import (_MAX, _SUM, BAD_ID, BAD_NONFINITE, BAD_RULE, BAD_TARGET_NEG_INF, BIG, LN2, LOG2E,
                        NEG_SENTINEL, _inv_cap, _kept, _log1p, _store_token, _transform)


@triton.jit
def _fwd_update(z, m_l, r_l, u_l, c2):
    """One block of the row into the per-lane state (m_l, r_l, u_l); see _vocab_fwd_kernel."""
    tt = (z - m_l) * c2  # the difference first, then the scale
    # one exp2 per element: e^d below the lane maximum, or the rescale when z raises it; a NaN z stays
    # NaN (and so does the lane's r_l), -inf gives x = 0 and, with the clamp, x * a = 0
    a = tl.minimum(tl.abs(tt), BIG, propagate_nan=tl.PropagateNan.ALL)
    x = tl.exp2(a * -1.0)  # not -a: Triton 3.6 writes that as 0 - a, an instruction (signed zero)
    grew = z > m_l
    k = tl.where(grew, x, 1.0)
    # grew: r = x (r + 1) (the old maximum joins the sum, the new one is left out), u = x (u - (r + 1) a)
    # else: r = r + x, u = u - x a
    r_new = k * r_l + x
    u_l = k * u_l - tl.where(grew, r_new, x) * a
    return tl.maximum(m_l, z), r_new, u_l


@triton.jit
def _block_stats(row, s0, V, lanes, scale, softcap, inv_cap, c2, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 BLOCK_V: tl.constexpr, VOCAB_BLOCK: tl.constexpr, k_tau=1.0, k_s=0.0, k_id=0, k_y=0,
                 KEEP: tl.constexpr = False):
    """The statistics of the vocabulary block [s0, min(s0 + VOCAB_BLOCK, V)) of `row`, relative to its own
    maximum: (m_b, r_b = S_b - 1, u_b = sum e^d t), m_b = NEG_SENTINEL and r_b = u_b = 0 for a block with
    no finite entry. Lanes as in the module docstring, reduced across lanes once per block; a block's bits
    depend only on its entries (and BLOCK_V), never on where the row or the slice around it ends. KEEP: the
    entries outside the token's kept set are -inf (k_tau = 1 / tau, k_s = t_s, k_id = t_id, k_y = y:
    vocab_jit._kept)."""
    HALF: tl.constexpr = BLOCK_V // 2
    m_l = tl.full([HALF], NEG_SENTINEL, tl.float32)
    # r_l = S - 1 = -1: no mass yet, so that the start maximum adds none when a finite entry raises it
    # (x (r_l + 1) = 0, even where a huge tau brings -FLT_MAX within reach: x > 0)
    r_l = tl.full([HALF], -1.0, tl.float32)
    u_l = tl.zeros([HALF], tl.float32)
    s_end = tl.minimum(s0 + VOCAB_BLOCK, V)
    v_full = s0 + ((s_end - s0) // BLOCK_V) * BLOCK_V
    for v0 in range(s0, v_full, BLOCK_V):  # whole blocks: no mask
        z0 = _transform(tl.load(row + v0 + lanes).to(tl.float32), scale, softcap, inv_cap, HAS_SCALE, HAS_SOFTCAP)
        z1 = _transform(tl.load(row + v0 + HALF + lanes).to(tl.float32), scale, softcap, inv_cap, HAS_SCALE,
                        HAS_SOFTCAP)
        if KEEP:
            z0 = _kept(z0, v0 + lanes, k_tau, k_s, k_id, k_y)
            z1 = _kept(z1, v0 + HALF + lanes, k_tau, k_s, k_id, k_y)
        m_l, r_l, u_l = _fwd_update(z0, m_l, r_l, u_l, c2)
        m_l, r_l, u_l = _fwd_update(z1, m_l, r_l, u_l, c2)
    if v_full < s_end:  # the partial last block of the row (an entry past V adds exactly nothing)
        offs = v_full + lanes
        # the entries past V are -inf after the transform too (a soft-cap would make them -cap)
        z0 = tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        z1 = tl.load(row + offs + HALF, mask=offs + HALF < V, other=float("-inf")).to(tl.float32)
        z0 = tl.where(offs < V, _transform(z0, scale, softcap, inv_cap, HAS_SCALE, HAS_SOFTCAP), float("-inf"))
        z1 = tl.where(offs + HALF < V, _transform(z1, scale, softcap, inv_cap, HAS_SCALE, HAS_SOFTCAP),
                      float("-inf"))
        if KEEP:
            z0 = _kept(z0, offs, k_tau, k_s, k_id, k_y)
            z1 = _kept(z1, offs + HALF, k_tau, k_s, k_id, k_y)
        m_l, r_l, u_l = _fwd_update(z0, m_l, r_l, u_l, c2)
        m_l, r_l, u_l = _fwd_update(z1, m_l, r_l, u_l, c2)
    # re-base the lanes on the block's maximum and reduce
    mx = tl.reduce(m_l, 0, _MAX)  # (tl.max's own reduction, float32 throughout: vocab_jit._MAX)
    empty = mx == NEG_SENTINEL  # no finite entry: every entry -inf (or NaN)
    live = m_l != NEG_SENTINEL
    sh = (m_l - mx) * c2
    alpha = tl.exp2(sh)
    # R = S - 1 without cancellation: the lanes' own sums, the maxima of lanes below the block maximum,
    # and the extra lanes at it (ties across lanes; ties inside a lane are already in r_l)
    # (a lane without a finite entry: its mass alpha (r_l + 1), 0 from its start r_l = -1, NaN after a NaN)
    r_raw = tl.reduce(tl.where(live, alpha * r_l, alpha * (r_l + 1.0)), 0, _SUM) \
        + tl.reduce(tl.where(live & (m_l < mx), alpha, 0.0), 0, _SUM) \
        + (tl.reduce((live & (m_l == mx)).to(tl.float32), 0, _SUM) - 1.0)
    r_b = tl.where(empty, 0.0 * r_raw, r_raw)  # keeps a NaN
    u_b = tl.reduce(tl.where(alpha > 0, alpha * (u_l + (1.0 + r_l) * sh), 0.0), 0, _SUM)
    return mx, r_b, u_b


@triton.jit
def _merge_block(m, r, u, m_b, r_b, u_b, c2):
    """The row's running statistics (m, r = S - 1, u) with the next block's (m_b, r_b, u_b) folded in,
    each relative to its own maximum. With a = |m_b - m| c2 and x = exp2(-a), one exp2: the block rises
    above the row (m_b > m): r = x (r + 1) + r_b, u = x (u - (r + 1) a) + u_b; else r = r + x (r_b + 1),
    u = u + x (u_b - (r_b + 1) a) (m_b = m: x = 1, the block's maximum counts as one more tie). Sums of
    non-negative terms (u: non-positive): nothing cancels. The one merge of the single-process kernel and
    of the vocabulary-parallel merge kernel; explicit fma, so that no compiler contracts them differently.
    The start state (NEG_SENTINEL, 0, 0) and blocks without a finite entry move no mass (their maximum is
    none: s_move 0, whatever x, which a huge tau may leave above 0)."""
    a = tl.minimum(tl.abs((m_b - m) * c2), BIG, propagate_nan=tl.PropagateNan.ALL)
    x = tl.exp2(a * -1.0)
    grew = m_b > m
    r_keep = tl.where(grew, r_b, r)
    u_keep = tl.where(grew, u_b, u)
    s_move = tl.where(grew, r + tl.where(m != NEG_SENTINEL, 1.0, 0.0), r_b + tl.where(m_b != NEG_SENTINEL, 1.0, 0.0))
    u_move = tl.where(grew, u, u_b)
    r_new = tl.fma(x, s_move, r_keep)
    u_new = tl.fma(x, tl.fma(s_move, a * -1.0, u_move), u_keep)
    return tl.maximum(m, m_b), r_new, u_new


@triton.jit
def _row_stats(row, V, scale, softcap, inv_cap, c2, inv_temp, k_s, k_id, y, stats_ptr, tok, NB,
               HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr, VOCAB_BLOCK: tl.constexpr,
               KEEP: tl.constexpr, BLOCKS_OUT: tl.constexpr):
    """A row's statistics (m, r = S - 1, u): each block of VOCAB_BLOCK entries in order, its own statistics
    (lane-wise, reduced across lanes at its end), folded into the row's by the one merge (_merge_block); with
    BLOCKS_OUT each block's stored at stats_ptr (token tok's NB blocks) instead."""
    HALF: tl.constexpr = BLOCK_V // 2
    lanes = tl.arange(0, HALF)
    m_r = NEG_SENTINEL * 1.0
    r_r = 0.0
    u_r = 0.0
    for s0 in range(0, V, VOCAB_BLOCK):
        m_b, r_b, u_b = _block_stats(row, s0, V, lanes, scale, softcap, inv_cap, c2, HAS_SCALE, HAS_SOFTCAP,
                                     BLOCK_V, VOCAB_BLOCK, inv_temp, k_s, k_id, y, KEEP)
        if BLOCKS_OUT:
            blk = stats_ptr + (tok * NB + s0 // VOCAB_BLOCK) * 3
            tl.store(blk, m_b)
            tl.store(blk + 1, r_b)
            tl.store(blk + 2, u_b)
        else:
            m_r, r_r, u_r = _merge_block(m_r, r_r, u_r, m_b, r_b, u_b, c2)
    return m_r, r_r, u_r


@triton.jit
def _finalize(m, r, u, z_y, y_ok, inv_temp):
    """Per token from the row's merged statistics (m, r, u) and its transformed target logit z_y:
    (logp, H, m as stored, log S, q = 1 - p_y, flags); see the module docstring."""
    empty = m == NEG_SENTINEL  # no finite entry: every entry -inf (or NaN)
    r_tot = tl.where(empty, 0.0 * r, r)  # keeps a NaN
    s_tot = tl.where(empty, 0.0, 1.0 + r_tot)
    m_out = tl.where(empty, float("-inf"), m)
    m_safe = tl.where(empty, 0.0, m)
    log_s = tl.where(empty, float("-inf"), _log1p(r_tot))  # S = 0: a row (or slice) all at -inf
    ent = log_s - (u * LN2) / s_tot
    logp = (z_y - m_safe) * inv_temp - log_s
    top = z_y == m_out
    q = tl.where(top, r_tot / s_tot, 1.0 - tl.exp(tl.where(top, 0.0, logp)))
    # flags (core/flags.py): a non-finite row (a NaN entry makes R NaN; +inf is the maximum), the
    # target logit -inf, the id outside [0, V)
    bad = tl.where((r != r) | (m_out == float("inf")), BAD_NONFINITE, 0)
    bad = tl.where(z_y == float("-inf"), bad | BAD_TARGET_NEG_INF, bad)
    bad = tl.where(y_ok, bad, bad | BAD_ID)
    return logp, ent, m_safe, log_s, q, bad


@triton.jit(do_not_specialize=["T", "logits_start", "temp_stride", "n_seq", "max_seqlen", "id_start"])
def _vocab_fwd_kernel(
    # pointers
    logits_ptr, ids_ptr, mask_ptr,  # inputs: (B, T_l, V) strided rows; (B*T,) ids; (B*T,) counted flag
    logp_ptr, ent_ptr, stats_ptr, bad_ptr,  # outputs: (B*T,), (B*T,), (B*T, 3) = (m, log S, q), (B*T,)
    # strides (elements)
    stride_lb, stride_lt,
    # sizes
    T, V, logits_start,
    # scalars
    temp_ptr, temp_stride,  # tau of token k at temp_ptr + k * temp_stride (0: one tau for every row), float32
    # in device memory, read here, never on the host
    scale, softcap,  # the tile's transforms (vocab_jit): runtime floats, used only under HAS_*
    # meta
    HAS_SCALE: tl.constexpr,  # scale != 1
    HAS_SOFTCAP: tl.constexpr,  # a soft-cap is given
    BLOCK_V: tl.constexpr,
    HAS_MASK: tl.constexpr = True,  # False: every token counts (mask_ptr is not read)
    TEMP_BY_VALUE: tl.constexpr = False,  # True: temp_ptr is tau itself, a float argument (no memory read)
    NAN_FLAGGED: tl.constexpr = False,  # True: a flagged token's logp and H are stored as NaN (token_logprobs)
    VOCAB_BLOCK: tl.constexpr = _VOCAB_BLOCK,  # gtpo_kernels.VOCAB_BLOCK: a multiple of BLOCK_V, fixed per process
    BLOCKS_OUT: tl.constexpr = False,  # True: store each block's (m_b, r_b, u_b) at stats_ptr (n, NB, 3) and
    # the transformed target logit at logp_ptr (NaN where the id is not in [0, V)), nothing else (the
    # vocabulary-parallel path merges the blocks of every rank with _vocab_merge_kernel)
    NB=1,  # BLOCKS_OUT: blocks per token in stats_ptr (the slice's own)
    rows_ptr=None,  # ROWS: the token of each logits row, int64 (the LM head's tile of gathered rows)
    ROWS: tl.constexpr = False,  # True: program p reads logits row p (B = 1, T = the tile's rows) and the
    # per-token tensors (ids, tau, mask, outputs) at token rows_ptr[p]; no gather or scatter around it
    status_ptr=None, work_ptr=None,  # HAS_STATUS: (1,) int32 the tokens that failed; (1,) int64 counter, 0
    cu_ptr=None, n_seq=0, max_seqlen=-1,  # CU_CHECK: the packed form's cu_seqlens, completions, max_seqlen or -1
    HAS_STATUS: tl.constexpr = False,  # True: the status word is written (vocab_status; not with ROWS)
    MASK_VALUES: tl.constexpr = False,  # HAS_STATUS: a mask value other than 0 and 1 fails too
    CU_CHECK: tl.constexpr = False,  # HAS_STATUS: malformed cu_seqlens (or longer than max_seqlen) fail
    keep_s_ptr=None, keep_id_ptr=None,  # KEEP: each token's kept set as (t_s, t_id) (kept_rule_triton), (B*T,)
    KEEP: tl.constexpr = False,  # True: the statistics over the kept set; t_s NaN (invalid rules): flagged
    TEMP_PER_SEQ: tl.constexpr = 0,  # 1: tau per completion, of token k at temp_ptr + (k // T) * temp_stride
    # (padded); 2: at its completion in cu_ptr (packed, _seq_of; not with ROWS). 0: per token or one tau
    CU_NAN: tl.constexpr = False,  # unvalidated: malformed cu_ptr flags every counted token (NaN outputs)
    max_ptr=None,  # VP_MAX: (n,) float32, the slice's row maximum where it adds to the merge, else -inf
    VP_MAX: tl.constexpr = False,  # vocabulary-parallel: store it (vp_merge_triton._live_max: no launch of its own)
    id_start=0,  # the vocabulary entry of the slice's column 0: the token's target is ids[tok] - id_start
    OUT_AT_ROW: tl.constexpr = False,  # ROWS: the outputs (and max_ptr) at row p, the tile's own buffers (a
    # vocabulary slice's statistics, merged over the ranks tile by tile), the inputs still at token rows_ptr[p]
):
    pid = tl.program_id(0).to(tl.int64)  # int64: B*T*V passes 2**31 at real sizes
    if ROWS:
        tok = tl.load(rows_ptr + pid).to(tl.int64)
    else:
        tok = pid
    at = pid if OUT_AT_ROW else tok  # where the outputs go
    seq = _tau_at(pid, tok, T, cu_ptr, n_seq, TEMP_PER_SEQ)
    inv_temp, counted = _token(seq, temp_ptr, temp_stride, tok, mask_ptr, TEMP_BY_VALUE, HAS_MASK)
    inv_cap = _inv_cap(softcap, HAS_SOFTCAP)
    logp, ent, m, log_s, q, bad = _uncounted()
    if counted:
        i = pid // T
        t = pid - i * T
        row = logits_ptr + i * stride_lb + (t + logits_start) * stride_lt
        y = tl.load(ids_ptr + tok).to(tl.int64) - id_start
        y_ok = (y >= 0) & (y < V)
        c2 = inv_temp * LOG2E  # d / ln 2: exp(d) = exp2((z - m) * c2)
        if KEEP:
            k_s = tl.load(keep_s_ptr + tok)
            k_id = tl.load(keep_id_ptr + tok)
        else:
            k_s = 0.0
            k_id = 0
        m_r, r_r, u_r = _row_stats(row, V, scale, softcap, inv_cap, c2, inv_temp, k_s, k_id, y, stats_ptr, tok, NB,
                                   HAS_SCALE, HAS_SOFTCAP, BLOCK_V, VOCAB_BLOCK, KEEP, BLOCKS_OUT)
        z_y = tl.load(row + y, mask=y_ok, other=float("nan")).to(tl.float32)
        z_y = _transform(z_y, scale, softcap, inv_cap, HAS_SCALE, HAS_SOFTCAP)
        if BLOCKS_OUT:
            logp = z_y
        else:
            logp, ent, m, log_s, q, bad = _finalize(m_r, r_r, u_r, z_y, y_ok, inv_temp)
            if KEEP:
                bad = tl.where(k_s != k_s, bad | BAD_RULE, bad)
            if CU_NAN:  # as the eager path's ids of a malformed cu_seqlens: -1, out of range
                bad = tl.where(_offsets_bad(cu_ptr, n_seq, tl.num_programs(0).to(tl.int64), -1, 1024) != 0,
                               bad | BAD_ID, bad)
    if BLOCKS_OUT:
        tl.store(logp_ptr + tok, logp)
    else:
        if NAN_FLAGGED:
            logp = tl.where(bad != 0, float("nan"), logp)
            ent = tl.where(bad != 0, float("nan"), ent)
        _store_token(logp_ptr, ent_ptr, stats_ptr, bad_ptr, at, logp, ent, m, log_s, q, bad)
        if VP_MAX:
            tl.store(max_ptr + at, _live_max(m, log_s, ent, bad, V))
        if HAS_STATUS:
            _fold_status(status_ptr, work_ptr, bad, mask_ptr, tok, cu_ptr, n_seq, max_seqlen, MASK_VALUES, CU_CHECK)
