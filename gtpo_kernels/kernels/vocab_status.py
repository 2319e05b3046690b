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
"""
from __future__ import annotations

import triton
import triton.language as tl


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
