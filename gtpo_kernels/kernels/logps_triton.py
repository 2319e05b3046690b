"""The small kernels around the epilogue (epilogue_triton.py) when the per-token log-probs and entropies
come from elsewhere: gtpo_loss_from_logps (the caller's log-probs) and gtpo_loss over the sampler's kept
sets (the replay kernels, replay_triton.py). loss_ops.logps_epilogue / replay_epilogue run them.

    _prep_kernel       (one program) the caller's log-probs and entropies as float32 (0 without entropies),
                       the flags (0), and the cu_seqlens the epilogue reads
    _flat_sets_kernel  (one program) the recorded kept sets in the flat layout: each flat token's offsets
                       (an uncounted token's set is empty), its logits row and tau, the metrics of spec 13,
                       and the cu_seqlens the epilogue reads
    _set_check_kernel  (a program per token, after the replay) a kept set repeating an id, and the replay's
                       flags: 0 where not counted
    _scale_kernel      (backward) c g and e g, exactly 0 where c (e) is 0 (dispatch.scale_by)

The epilogue always runs in the packed form here, on cu_seqlens written by these kernels (the padded form's
are i T): an unvalidated invalid input that must make every output NaN (spec 6: a non-finite entropy at a
counted token, an invalid kept set or row) is told to it by a cu_seqlens ending past N, which it reads as
malformed (every counted token's outputs NaN), with the completions' spans unchanged.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .epilogue_terms import _counted, _finite_or_nan
from .vocab_jit import BAD_ID, BAD_NONFINITE
from .vocab_status import _offsets_bad

BLOCK = 1024  # tokens per step of the one-program kernels and per program of _scale_kernel
DUP_BLOCK = 64  # kept ids per block of the repeated-id test (a DUP_BLOCK x DUP_BLOCK comparison)


@triton.jit
def _cu_out(cu_ptr, cu_out, B, T, N, poison, BLOCK: tl.constexpr, PACKED: tl.constexpr):
    """cu_seqlens for the epilogue: the caller's (packed) or i T (padded); poison: the last entry N + 1."""
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    for i0 in range(0, B + 1, BLOCK):
        i = i0 + lanes
        inb = i <= B
        if PACKED:
            c = tl.load(cu_ptr + i, mask=inb, other=0).to(tl.int64)
        else:
            c = i * T
        c = tl.where((i == B) & (poison != 0), N + 1, c)
        tl.store(cu_out + i, c, mask=inb)


@triton.jit(do_not_specialize=["B", "T", "N"])
def _prep_kernel(logp_ptr, ent_ptr, mask_ptr, cu_ptr, ids_ptr,  # the caller's (N,) log-probs, entropies, mask,
                 logp_out, ent_out, bad_out, cu_out,  # ids; cu_seqlens. Out: (N,) float32, float32, int8; (B + 1,)
                 B, T, N,  # completions, tokens per completion (padded form), tokens
                 HAS_ENT: tl.constexpr, HAS_MASK: tl.constexpr, PACKED: tl.constexpr, CHECK: tl.constexpr,
                 BLOCK: tl.constexpr, VALIDATE: tl.constexpr = False):
    """CHECK (unvalidated, entropies given): a non-finite entropy at a counted token poisons cu_out.
    VALIDATE: a counted token whose log-prob or entropy is not finite (BAD_NONFINITE) or whose id is outside
    [0, 2**31) (BAD_ID: the conflict weights' range) is flagged, for the epilogue's status word."""
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    poison = tl.zeros((), tl.int32)
    for t0 in range(0, N, BLOCK):
        o = t0 + lanes
        inb = o < N
        # a log-prob that is not finite (-inf: the token had no mass) is NaN, as its eager twin makes it
        raw = tl.load(logp_ptr + o, mask=inb, other=0.0).to(tl.float32)
        tl.store(logp_out + o, _finite_or_nan(raw), mask=inb)
        if HAS_ENT:
            en = tl.load(ent_ptr + o, mask=inb, other=0.0).to(tl.float32)
        else:
            en = tl.zeros([BLOCK], tl.float32)
        tl.store(ent_out + o, en, mask=inb)
        flag = tl.zeros([BLOCK], tl.int32)
        if VALIDATE:
            m = _counted(mask_ptr, o, inb, HAS_MASK)
            y = tl.load(ids_ptr + o, mask=inb, other=0).to(tl.int64)
            flag = tl.where(m & ((y < 0) | (y >= 2147483648)), BAD_ID, flag)
            if HAS_ENT:
                flag = tl.where(m & ((tl.abs(en) < float("inf")) == 0), flag | BAD_NONFINITE, flag)
            flag = tl.where(m & ((tl.abs(raw) < float("inf")) == 0), flag | BAD_NONFINITE, flag)
        tl.store(bad_out + o, flag.to(tl.int8), mask=inb)
        if CHECK:
            m = _counted(mask_ptr, o, inb, HAS_MASK)
            poison = poison | tl.max((m & ((tl.abs(en) < float("inf")) == 0)).to(tl.int32), axis=0)
    _cu_out(cu_ptr, cu_out, B, T, N, poison, BLOCK, PACKED)


@triton.jit
def _flat_offsets(mask_ptr, off_ptr, flat_out, N, M_rec, K, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """The recorded kept sets' offsets (M_rec + 1,) over K kept ids, in the flat layout of the N tokens:
    flat_out (N + 1,), token j's set the recorded set of the counted tokens before it (empty if uncounted),
    every set empty when the offsets are malformed (not non-decreasing from 0 to K) or not M + 1. Returns
    (M, bad, end): the counted tokens, 1 for such offsets, the recorded offset of the counted tokens' end."""
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    M = tl.zeros((), tl.int64)
    for t0 in range(0, N, BLOCK):
        o = t0 + lanes
        M += tl.sum(_counted(mask_ptr, o, o < N, HAS_MASK).to(tl.int64), axis=0)
    bad = _offsets_bad(off_ptr, M_rec, K, -1, BLOCK) | (M != M_rec).to(tl.int32)
    tl.debug_barrier()
    before = tl.zeros((), tl.int64)  # counted tokens before the block
    for t0 in range(0, N, BLOCK):
        o = t0 + lanes
        inb = o < N
        c = _counted(mask_ptr, o, inb, HAS_MASK).to(tl.int64)
        rank = before + tl.cumsum(c, axis=0) - c
        start = tl.load(off_ptr + tl.minimum(rank, M_rec), mask=inb, other=0).to(tl.int64)
        tl.store(flat_out + o, tl.where(bad != 0, 0, start), mask=inb)
        before += tl.sum(c, axis=0)
    end = tl.load(off_ptr + tl.minimum(M, M_rec)).to(tl.int64)
    tl.store(flat_out + N, tl.where(bad != 0, 0, end))
    return M, bad, end


@triton.jit
def _repeats(ids_ptr, start, end, DUP_BLOCK: tl.constexpr):
    """1 when the kept ids [start, end) repeat one (a DUP_BLOCK x DUP_BLOCK comparison a pair of blocks)."""
    lanes = tl.arange(0, DUP_BLOCK).to(tl.int64)
    dup = tl.zeros((), tl.int32)
    for a0 in range(start, end, DUP_BLOCK):
        ka = a0 + lanes
        va = tl.load(ids_ptr + ka, mask=ka < end, other=0).to(tl.int64)
        for b0 in range(a0, end, DUP_BLOCK):
            kb = b0 + lanes
            vb = tl.load(ids_ptr + kb, mask=kb < end, other=0).to(tl.int64)
            same = (va[:, None] == vb[None, :]) & (ka[:, None] < kb[None, :]) & (kb[None, :] < end)
            dup = dup | tl.max(tl.max(same.to(tl.int32), axis=1), axis=0)
    return dup


@triton.jit(do_not_specialize=["B", "T", "N", "M_rec", "K", "logits_start", "s0", "s1", "g0", "g1"])
def _flat_sets_kernel(mask_ptr, off_ptr, cu_ptr, tau_ptr,  # the caller's mask, recorded offsets, cu_seqlens; tau
                      flat_out, row_out, grow_out, tau_out,  # (N + 1,), (N,), (N,) int64, (N,) float32
                      cu_out, met_out,  # (B + 1,) int64, (2,) float32
                      B, T, N, M_rec, K,  # completions, T (padded), tokens, recorded sets, kept ids
                      logits_start, s0, s1, g0, g1, tau_value,  # rows: the strides of logits3, of its gradient
                      HAS_MASK: tl.constexpr, PACKED: tl.constexpr, TAU_MODE: tl.constexpr, BLOCK: tl.constexpr,
                      VALIDATE: tl.constexpr = False):
    """Pass 1: the counted tokens M and whether the recorded offsets are malformed (not non-decreasing from
    0 to K) or not M + 1: then every set is empty here and the epilogue's outputs NaN (when M > 0).
    Pass 2: flat token j's set is the recorded set of the counted tokens before it (empty if uncounted).
    TAU_MODE: 0 tau_value, 1 per token (N,), 2 one element. VALIDATE: malformed offsets poison the
    cu_seqlens even without a counted token (the status word then makes the call check them on the host)."""
    M, bad, end = _flat_offsets(mask_ptr, off_ptr, flat_out, N, M_rec, K, HAS_MASK, BLOCK)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    for t0 in range(0, N, BLOCK):
        o = t0 + lanes
        inb = o < N
        if PACKED:
            rb = o * 0
            rt = logits_start + o
        else:
            rb = o // T
            rt = logits_start + o % T
        tl.store(row_out + o, rb * s0 + rt * s1, mask=inb)
        tl.store(grow_out + o, rb * g0 + rt * g1, mask=inb)
        if TAU_MODE == 1:
            tau = tl.load(tau_ptr + o, mask=inb, other=1.0).to(tl.float32)
        elif TAU_MODE == 2:
            tau = tl.zeros([BLOCK], tl.float32) + tl.load(tau_ptr).to(tl.float32)
        else:
            tau = tl.zeros([BLOCK], tl.float32) + tau_value
        tl.store(tau_out + o, tau, mask=inb)
    first = tl.load(off_ptr).to(tl.int64)
    # spec 13's metrics as replay_metrics gives them (from the offsets as recorded, malformed or not); NaN where
    # the caller's cu_seqlens is malformed (no completion is known: every metric NaN, as the epilogue's)
    nan_met = 0.0
    if PACKED:
        nan_met = tl.where(_offsets_bad(cu_ptr, B, N, -1, BLOCK) != 0, float("nan"), 0.0)
    tl.store(met_out, ((end - first).to(tl.float64) / tl.maximum(M, 1).to(tl.float64)).to(tl.float32) + nan_met)
    tl.store(met_out + 1, 0.0 + nan_met)  # replay_restored_frac: a recorded set restores nothing
    # malformed offsets poison the epilogue where a token counts; validating, always (the call raises)
    _cu_out(cu_ptr, cu_out, B, T, N, bad * ((M > 0) | VALIDATE).to(tl.int32), BLOCK, PACKED)


@triton.jit
def _set_check_kernel(mask_ptr, flat_ptr, ids_ptr, flags_ptr, ent_ptr, met_ptr, HAS_MASK: tl.constexpr,
                      DUP_BLOCK: tl.constexpr):
    """Token `tok` after the replay: its flags kept where counted (0 elsewhere, BAD_ID added when its set
    repeats an id); a flagged counted token or a non-finite entropy there makes the sets' metrics
    (met[0:2], _flat_sets_kernel's) NaN, a set that means nothing averaged in; the epilogue NaNs what reads
    that token (its flag, spec 13: the affected token's outputs)."""
    tok = tl.program_id(0).to(tl.int64)
    if HAS_MASK:
        m = tl.load(mask_ptr + tok) != 0
    else:
        m = tok >= 0
    flag = tl.load(flags_ptr + tok).to(tl.int32)
    start = tl.load(flat_ptr + tok)
    end = tl.load(flat_ptr + tok + 1)
    dup = tl.zeros((), tl.int32)
    if m:
        dup = _repeats(ids_ptr, start, end, DUP_BLOCK)
    flag = tl.where(dup != 0, flag | BAD_ID, flag)
    flag = tl.where(m, flag, 0)
    tl.store(flags_ptr + tok, flag.to(tl.int8))
    en = tl.load(ent_ptr + tok)
    if m & ((flag != 0) | ((tl.abs(en) < float("inf")) == 0)):
        tl.store(met_ptr + tl.arange(0, 2), tl.full([2], float("nan"), tl.float32))


@triton.jit(do_not_specialize=["N"])
def _scale_kernel(g_ptr, c_ptr, e_ptr, gc_ptr, ge_ptr, N, PER_TOKEN: tl.constexpr, HAS_E: tl.constexpr,
                  BLOCK: tl.constexpr):
    """gc = c g, ge = e g in the outputs' dtypes, exactly 0 where c (e) is 0: an uncounted token's inf or
    NaN upstream gradient is ignored (loss_agg='none'), never 0 * inf = NaN."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = o < N
    if PER_TOKEN:
        g = tl.load(g_ptr + o, mask=inb, other=0.0).to(tl.float32)
    else:
        g = tl.load(g_ptr).to(tl.float32)
    c = tl.load(c_ptr + o, mask=inb, other=0.0)
    tl.store(gc_ptr + o, tl.where(c == 0.0, 0.0, c * g).to(gc_ptr.dtype.element_ty), mask=inb)
    if HAS_E:
        e = tl.load(e_ptr + o, mask=inb, other=0.0)
        tl.store(ge_ptr + o, tl.where(e == 0.0, 0.0, e * g).to(ge_ptr.dtype.element_ty), mask=inb)
