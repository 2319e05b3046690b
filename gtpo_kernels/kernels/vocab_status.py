"""token_logprobs' status word (Triton), folded into the forward vocabulary kernel's launch
(vocab_fwd_triton._vocab_fwd_kernel, HAS_STATUS): validating costs no launch of its own.

Each program adds itself to a counter (one atomic: 1, plus 2**32 if its token fails a check); the program
that completes the count writes the failures (the high bits) to the status word and sets the counter back
to 0, so no zero-fill launch precedes it (the counter is kept per stream, whose launches are ordered:
kernels/loss_ops._counter). A token fails with its flags, or with MASK_VALUES a mask value other than 0 and 1
(NaN included; a counted token's tau read per token that is not finite and > 0 is flagged by the kernel
itself: its row is NaN); with CU_CHECK program 0
also fails when the packed form's cu_seqlens are malformed (not from 0 to N, or decreasing) or hold a
completion longer than max_seqlen (>= 0). The call then runs its host checks to raise the error that
names the argument.

Here too: a token's own inputs (_token: its 1 / tau and whether it counts) and, for a temperature per
completion in the packed form, its completion in cu_seqlens (_seq_of).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .vocab_jit import _inv_tau


@triton.jit
def _token(seq, temp_ptr, temp_stride, tok, mask_ptr, TEMP_BY_VALUE: tl.constexpr, HAS_MASK: tl.constexpr):
    """Token tok's 1 / tau (a number by value, or read at index seq: the token's own, or its completion's;
    NaN where not finite and > 0) and whether it counts (the caller's mask as given, any dtype: nonzero
    counts)."""
    if TEMP_BY_VALUE:
        inv_temp = _inv_tau(temp_ptr)
    else:
        inv_temp = _inv_tau(tl.load(temp_ptr + seq * temp_stride))
    if HAS_MASK:
        counted = tl.load(mask_ptr + tok) != 0
    else:
        counted = True
    return inv_temp, counted


@triton.jit
def _uncounted():
    """An uncounted token's outputs (logp, H, m, log S, q, flags)."""
    zero = tl.zeros((), tl.float32)
    return zero, zero, tl.full((), float("-inf"), tl.float32), zero, zero, tl.zeros((), tl.int32)


@triton.jit
def _seq_of(cu_ptr, n_seq, tok, BLOCK: tl.constexpr):
    """The completion of packed token tok: how many of cu_seqlens[1:] (n_seq of them) are <= tok, as
    torch.searchsorted(cu_seqlens[1:], tok, right=True), clamped into [0, n_seq - 1] so that a malformed
    cu_seqlens (flagged apart) still reads in bounds."""
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    seq = tl.zeros((), tl.int64)
    for j0 in range(1, n_seq + 1, BLOCK):
        j = j0 + lanes
        inb = j <= n_seq
        c = tl.load(cu_ptr + j, mask=inb, other=0).to(tl.int64)
        seq += tl.sum((inb & (c <= tok)).to(tl.int64), axis=0)
    return tl.maximum(tl.minimum(seq, n_seq - 1), 0)


@triton.jit
def _tau_at(pid, tok, T, cu_ptr, n_seq, TEMP_PER_SEQ: tl.constexpr):
    """Where a token's temperature is read: its completion (TEMP_PER_SEQ 1: the padded row pid // T of T
    tokens; 2: found in the packed form's cu_seqlens, _seq_of), else the token itself."""
    if TEMP_PER_SEQ == 1:
        return pid // T
    elif TEMP_PER_SEQ == 2:
        return _seq_of(cu_ptr, n_seq, tok, 1024)
    return tok


@triton.jit
def _seqs_of(cu_ptr, n_seq, tok):
    """_seq_of for a block of tokens tok (int64): a bisection over cu_seqlens[1:] per lane (log2(n_seq)
    dependent loads, where _seq_of reads all n_seq), the same value where cu_seqlens never decreases;
    clamped into [0, n_seq - 1] as _seq_of is (a malformed cu_seqlens, flagged apart, still reads in bounds)."""
    lo = tl.zeros_like(tok)  # how many of cu_seqlens[1:lo + 1] are <= tok
    hi = lo + n_seq
    while tl.max(hi - lo, axis=0) > 0:
        live = lo < hi
        mid = (lo + hi) // 2
        below = tl.load(cu_ptr + 1 + mid, mask=live, other=0).to(tl.int64) <= tok
        lo = tl.where(live & below, mid + 1, lo)
        hi = tl.where(live & (below == 0), mid, hi)
    return tl.maximum(tl.minimum(lo, n_seq - 1), 0)


@triton.jit
def _offsets_bad(off_ptr, n, total, max_len, BLOCK: tl.constexpr):
    """1 when offsets (n + 1,) (cu_seqlens, a sampling mask's) do not run from 0 to total without decreasing,
    or a span is longer than max_len (when >= 0)."""
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    bad = ((tl.load(off_ptr).to(tl.int64) != 0) | (tl.load(off_ptr + n).to(tl.int64) != total)).to(tl.int32)
    for i0 in range(0, n, BLOCK):
        i = i0 + lanes
        inb = i < n
        lo = tl.load(off_ptr + i, mask=inb, other=0).to(tl.int64)
        hi = tl.load(off_ptr + i + 1, mask=inb, other=0).to(tl.int64)
        bad = bad | tl.max((inb & ((hi < lo) | ((max_len >= 0) & (hi - lo > max_len)))).to(tl.int32), axis=0)
    return bad


@triton.jit
def _fold_status(status_ptr, work_ptr, bad, mask_ptr, tok, cu_ptr, n_seq, max_seqlen, MASK_VALUES: tl.constexpr,
                 CU_CHECK: tl.constexpr):
    """Token tok into the launch's status word (the module docstring)."""
    fail = (bad != 0).to(tl.int32)
    if MASK_VALUES:
        mv = tl.load(mask_ptr + tok)
        fail = fail | ((mv != 0) & (mv != 1)).to(tl.int32)
    if CU_CHECK:
        cu_fail = _offsets_bad(cu_ptr, n_seq, tl.num_programs(0).to(tl.int64), max_seqlen, 1024)
        fail = fail | (cu_fail * (tok == 0).to(tl.int32))
    inc = tl.where(fail != 0, tl.full((), 4294967297, tl.int64), tl.full((), 1, tl.int64))  # 2**32 + 1, or 1
    tot = tl.atomic_add(work_ptr, inc) + inc
    if (tot & 4294967295) == tl.num_programs(0):  # the last program of the grid
        tl.store(status_ptr, (tot >> 32).to(tl.int32))
        tl.store(work_ptr, tl.zeros((), tl.int64))
