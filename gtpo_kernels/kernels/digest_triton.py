"""The agreement's checksums (spec 12; distributed/agree.py holds their definition and torch twin) on the
device, one launch per field, written straight into the row that the ranks all-gather: what agree's
torch path forms with about twenty small ops a field.

    _terms_kernel   a tensor's values hashed with their positions: values_digest (the sum of the mixed
                    words, `where` selecting positions), or, FP, one option's word mix(W, pos) with W its
                    float bits (one element) or its values_digest; added to the row's slot mod 2**61
    _tokens_kernel  the tokens' (count, checksum, largest counted id) into three slots

One program each (a loop over BLOCK elements: the sum is formed in one order, no atomics); int64 words
wrap as the torch twin's do, so the two are bitwise equal.
"""
from __future__ import annotations

import triton
import triton.language as tl

BLOCK = 1024
MASK61 = tl.constexpr((1 << 61) - 1)
K1 = tl.constexpr(0x9E3779B97F4A7C15 - (1 << 64))
K2 = tl.constexpr(0x632BE59BD9B4E019)
K3 = tl.constexpr(0x2545F4914F6CDD1D)
K4 = tl.constexpr(0xBF58476D1CE4E5B9 - (1 << 64))
NAN_BITS = tl.constexpr(0x7FF8000000000000)


@triton.jit
def _mix(x, pos):
    x = x * K1 + pos.to(tl.int64) * K2
    x = (x ^ (x >> 31)) * K4
    return x ^ (x >> 29)


@triton.jit
def _float_word(x_ptr, o, inb):
    """The values at o as their float64 bits (-0.0 as 0.0, every NaN as one NaN)."""
    x = tl.load(x_ptr + o, mask=inb, other=0).to(tl.float64)
    x = tl.where(x == 0.0, 0.0, x)
    return tl.where(x != x, NAN_BITS, x.to(tl.int64, bitcast=True))


@triton.jit
def _word(x_ptr, o, inb, IS_FLOAT: tl.constexpr):
    """The values at o as int64 words: floats by their float64 bits, integers as they are."""
    if IS_FLOAT:
        return _float_word(x_ptr, o, inb)
    return tl.load(x_ptr + o, mask=inb, other=0).to(tl.int64)


@triton.jit(do_not_specialize=["n", "size_term", "pos"])
def _terms_kernel(x_ptr, where_ptr, out_ptr, n, size_term, pos, IS_FLOAT: tl.constexpr, HAS_WHERE: tl.constexpr,
                  FP: tl.constexpr, BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    acc = tl.zeros([BLOCK], tl.int64)
    for start in range(0, n, BLOCK):
        o = start + lanes
        inb = o < n
        h = _mix(_word(x_ptr, o, inb, IS_FLOAT), o)
        if HAS_WHERE:
            inb = inb & (tl.load(where_ptr + o, mask=inb, other=0) != 0)
        acc += tl.where(inb, h, 0)
    term = tl.sum(acc, axis=0)
    if FP:
        one = _float_word(x_ptr, lanes, lanes < tl.minimum(n, 1))  # one element: its float bits, whatever its dtype
        word = tl.where(n == 1, tl.sum(tl.where(lanes < 1, one, 0), axis=0), (term + size_term) & MASK61)
        term = _mix(word, pos)
    else:
        term = term + size_term
    tl.store(out_ptr, (tl.load(out_ptr) + term) & MASK61)


@triton.jit(do_not_specialize=["n", "T"])
def _tokens_kernel(ids_ptr, counted_ptr, seg_ptr, out_ptr, n, T, HAS_SEG: tl.constexpr, BLOCK: tl.constexpr,
                   HAS_MASK: tl.constexpr = True):
    """seg: the completion of each token, read (HAS_SEG: packed) or i // T (padded); counted: the caller's mask
    as given (nonzero counts; HAS_MASK False: every token)."""
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    count = tl.zeros([BLOCK], tl.int64)
    acc = tl.zeros([BLOCK], tl.int64)
    top = tl.full([BLOCK], -1, tl.int64)
    for start in range(0, n, BLOCK):
        o = start + lanes
        inb = o < n
        y = tl.load(ids_ptr + o, mask=inb, other=0).to(tl.int64)
        if HAS_SEG:
            seg = tl.load(seg_ptr + o, mask=inb, other=0).to(tl.int64)
        else:
            seg = o // T
        if HAS_MASK:
            c = inb & (tl.load(counted_ptr + o, mask=inb, other=0) != 0)
        else:
            c = inb
        count += c.to(tl.int64)
        acc += tl.where(c, _mix(y + seg * K3, o), 0)
        top = tl.maximum(top, tl.where(c, y, -1))
    tl.store(out_ptr, tl.sum(count, axis=0))
    tl.store(out_ptr + 1, tl.sum(acc, axis=0) & MASK61)
    tl.store(out_ptr + 2, tl.max(top, axis=0))


def terms(row, slot, x, where, size_term, pos):
    """row[slot] += x's term (values_digest's sum, `where`: only those positions; pos not None: the option
    word mix(W, pos)) mod 2**61, in one launch. size_term: values_digest's size word."""
    flat = x.detach().reshape(-1).contiguous()  # (a view's reshape keeps its strides: the kernel reads stride 1)
    w = flat if where is None else where.reshape(-1).contiguous()
    _terms_kernel[(1,)](flat, w, row[slot:], flat.numel(), size_term, 0 if pos is None else pos,
                        IS_FLOAT=flat.dtype.is_floating_point, HAS_WHERE=where is not None, FP=pos is not None,
                        BLOCK=BLOCK)


def tokens(row, slot, ids, counted, seg, T):
    """row[slot:slot + 3] = (counted tokens, their checksum, their largest id), in one launch; seg None:
    padded rows of T tokens; counted: the mask as given (nonzero counts), None: every token counts."""
    flat = ids.reshape(-1).contiguous()
    _tokens_kernel[(1,)](flat, flat if counted is None else counted.reshape(-1).contiguous(),
                         flat if seg is None else seg.reshape(-1).contiguous(), row[slot:],
                         flat.numel(), T, HAS_SEG=seg is not None, BLOCK=BLOCK, HAS_MASK=counted is not None)
