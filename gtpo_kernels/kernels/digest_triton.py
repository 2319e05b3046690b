"""The agreement's checksums (spec 12; distributed/digest.py holds their definition and torch twin) on the
device, the whole row in one launch, written straight into the row that the ranks all-gather: what the
torch path forms with about twenty small ops a field.

    _terms_kernel   a tensor's values hashed with their positions: values_digest (the sum of the mixed
                    words, `where` selecting positions), or, FP, one option's word mix(W, pos) with W its
                    float bits (one element) or its values_digest; added to the row's slot mod 2**61 (a
                    fingerprint's tensor options after its first, which add into the same slot)
    _row_kernel     a row's terms (up to SLOTS) and the tokens' (count, checksum, largest counted id) into
                    three slots, in one launch (row_terms: the agreement's row)

One program each (a loop over BLOCK elements: the sum is formed in one order, no atomics); int64 words
wrap as the torch twin's do, so the two are bitwise equal.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .vocab_status import _seqs_of

BLOCK = 1024
MASK61 = tl.constexpr((1 << 61) - 1)
K1 = tl.constexpr(0x9E3779B97F4A7C15 - (1 << 64))
K2 = tl.constexpr(0x632BE59BD9B4E019)
K3 = tl.constexpr(0x2545F4914F6CDD1D)
K4 = tl.constexpr(0xBF58476D1CE4E5B9 - (1 << 64))
NAN_BITS = tl.constexpr(0x7FF8000000000000)
HEAD_SLOTS = tl.constexpr(64)  # a row written whole (_row_body's HEAD) has at most this many slots


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


@triton.jit
def _term(x_ptr, where_ptr, n, size_term, pos, IS_FLOAT: tl.constexpr, HAS_WHERE: tl.constexpr, FP: tl.constexpr,
          BLOCK: tl.constexpr, CHECK: tl.constexpr = 0, SUM: tl.constexpr = True, PER_ROW: tl.constexpr = False,
          cu_ptr=None, n_cu=0, PER_CU: tl.constexpr = False):
    """A tensor's term: values_digest's sum with its size word, or, FP, the option word mix(W, pos); and
    whether any selected value fails CHECK (0 none, 1 not finite, 2 neither 0 nor 1; then with size_term
    the check's bound and SUM off, no term: 3 outside [0, size_term), 4 cu_seqlens not from 0 to
    size_term = N or decreasing, 5 a completion of cu_seqlens longer than size_term = max_seqlen, 6 not
    finite or below size_term, 7 not finite and > 0 with 1 / x finite). PER_ROW (not FP): x holds one value
    per row of pos tokens, read at n tokens (where's), token o at x[o // pos], as its spread on them; PER_CU
    (not FP): x holds one value per completion of the packed form's cu_seqlens (n_cu completions), token o
    at its completion's (_seqs_of), as its spread (layout.spread_packed) on the n tokens."""
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    acc = tl.zeros([BLOCK], tl.int64)
    bad = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n, BLOCK):
        o = start + lanes
        inb = o < n
        if PER_CU:
            xo = _seqs_of(cu_ptr, n_cu, o)
        elif PER_ROW:
            xo = o // pos
        else:
            xo = o
        if SUM:
            h = _mix(_word(x_ptr, xo, inb, IS_FLOAT), o)
        if HAS_WHERE:
            inb = inb & (tl.load(where_ptr + o, mask=inb, other=0) != 0)
        if SUM:
            acc += tl.where(inb, h, 0)
        o = xo
        if CHECK == 1:
            v = tl.load(x_ptr + o, mask=inb, other=0).to(tl.float64)
            bad = bad | (inb & ((tl.abs(v) < float("inf")) == 0)).to(tl.int32)  # (NaN too)
        if CHECK == 2:
            v = tl.load(x_ptr + o, mask=inb, other=0)
            bad = bad | (inb & (v != 0) & (v != 1)).to(tl.int32)
        if CHECK == 3:
            v = tl.load(x_ptr + o, mask=inb, other=0).to(tl.int64)
            bad = bad | (inb & ((v < 0) | (v >= size_term))).to(tl.int32)
        if CHECK == 6:
            v = tl.load(x_ptr + o, mask=inb, other=0).to(tl.float64)
            bad = bad | (inb & (((tl.abs(v) < float("inf")) == 0) | (v < size_term.to(tl.float64)))).to(tl.int32)
        if CHECK == 7:  # (in x's own dtype: 1 / x as the kernels form it)
            v = tl.load(x_ptr + o, mask=inb, other=1.0)
            ok = (tl.abs(v) < float("inf")) & (v > 0) & (tl.abs(1.0 / v) < float("inf"))
            bad = bad | (inb & (ok == 0)).to(tl.int32)
        if (CHECK == 4) | (CHECK == 5):
            v = tl.load(x_ptr + o, mask=inb, other=0).to(tl.int64)
            prev = tl.load(x_ptr + o - 1, mask=inb & (o > 0), other=0).to(tl.int64)
            if CHECK == 4:
                fails = ((o == 0) & (v != 0)) | ((o == n - 1) & (v != size_term)) | ((o > 0) & (v < prev))
            else:
                fails = (o > 0) & (v - prev > size_term)
            bad = bad | (inb & fails).to(tl.int32)
    term = tl.sum(acc, axis=0)
    if FP:
        one = _float_word(x_ptr, lanes, lanes < tl.minimum(n, 1))  # one element: its float bits, whatever its dtype
        word = tl.where(n == 1, tl.sum(tl.where(lanes < 1, one, 0), axis=0), (term + size_term) & MASK61)
        term = _mix(word, pos)
    else:
        term = term + size_term
    return term, tl.max(bad, axis=0)


@triton.jit
def _add_term(out_ptr, x_ptr, where_ptr, n, size_term, pos, F: tl.constexpr, BLOCK: tl.constexpr, cu_ptr, n_cu):
    """out += the term (mod 2**61) -> whether a selected value failed the check; F's bits: 1 IS_FLOAT,
    2 HAS_WHERE, 4 FP, 8 k the check (_term's CHECK k, 1 to 7), 64 no term (a check alone), 128 PER_ROW,
    256 PER_CU (cu_ptr, n_cu)."""
    term, bad = _term(x_ptr, where_ptr, n, size_term, pos, (F & 1) != 0, (F & 2) != 0, (F & 4) != 0, BLOCK,
                      (F // 8) % 8, (F & 64) == 0, (F & 128) != 0, cu_ptr, n_cu, (F & 256) != 0)
    if (F & 64) == 0:
        tl.store(out_ptr, (tl.load(out_ptr) + term) & MASK61)
    return bad


@triton.jit(do_not_specialize=["n", "size_term", "pos"])
def _terms_kernel(x_ptr, where_ptr, out_ptr, n, size_term, pos, IS_FLOAT: tl.constexpr, HAS_WHERE: tl.constexpr,
                  FP: tl.constexpr, BLOCK: tl.constexpr):
    term, _ = _term(x_ptr, where_ptr, n, size_term, pos, IS_FLOAT, HAS_WHERE, FP, BLOCK)
    tl.store(out_ptr, (tl.load(out_ptr) + term) & MASK61)


@triton.jit
def _tokens_into(ids_ptr, counted_ptr, out_ptr, n, T, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr):
    """out[0:3] = the tokens' (count, checksum, largest counted id); a token's row i // T (T: the padded
    rows' length; packed, digest.PACKED_T: row 0); counted: the caller's mask as given (nonzero counts;
    HAS_MASK False: every token)."""
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    count = tl.zeros([BLOCK], tl.int64)
    acc = tl.zeros([BLOCK], tl.int64)
    top = tl.full([BLOCK], -1, tl.int64)
    for start in range(0, n, BLOCK):
        o = start + lanes
        inb = o < n
        y = tl.load(ids_ptr + o, mask=inb, other=0).to(tl.int64)
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


@triton.jit
def _row_body(row_ptr, x0, w0, n0, s0, p0, o0, x1, w1, n1, s1, p1, o1, x2, w2, n2, s2, p2, o2,
              x3, w3, n3, s3, p3, o3, x4, w4, n4, s4, p4, o4, x5, w5, n5, s5, p5, o5,
              x6, w6, n6, s6, p6, o6, x7, w7, n7, s7, p7, o7,
              ids_ptr, counted_ptr, n_tok, T, o_tok, cu_ptr, n_cu, n_fields, raw0, key, F0: tl.constexpr,
              F1: tl.constexpr, F2: tl.constexpr, F3: tl.constexpr, F4: tl.constexpr, F5: tl.constexpr,
              F6: tl.constexpr, F7: tl.constexpr, N_TERMS: tl.constexpr, TOKENS: tl.constexpr, HAS_MASK: tl.constexpr,
              CHECKS: tl.constexpr, HEAD: tl.constexpr, BLOCK: tl.constexpr):
    """N_TERMS <= SLOTS terms (tensor i: x_i, where w_i, n_i elements, size word s_i, position p_i, F_i as
    _add_term's) added into row[o_i] (distinct slots) and, TOKENS, the tokens' three fields into
    row[o_tok:o_tok + 3]: a row's checksums in one program, one after the other. CHECKS: some term checks
    its values; a failure sets the row's error flag, row[0] = 1 (a ValueError, agree._kind). cu_ptr, n_cu:
    the packed form's cu_seqlens and its completions, read by the PER_CU terms. HEAD (1; 2 with raw0 in slot 1):
    first the whole row row[0:n_fields + 2] is written, 0 but for raw0 and the constants' `key` in the last slot
    (agree: the row's constants are not copied to the device). The program of _row_kernel, and the first
    program of the vocabulary-parallel forward's launch (vp_first_triton)."""
    if HEAD > 0:
        k = tl.arange(0, HEAD_SLOTS).to(tl.int64)
        head = tl.where(k == n_fields + 1, key, tl.where((k == 1) & (HEAD == 2), raw0, 0))
        tl.store(row_ptr + k, head, mask=k < n_fields + 2)
        tl.debug_barrier()  # (the terms below add into these slots)
    bad = 0
    if N_TERMS > 0:
        bad = bad | _add_term(row_ptr + o0, x0, w0, n0, s0, p0, F0, BLOCK, cu_ptr, n_cu)
    if N_TERMS > 1:
        bad = bad | _add_term(row_ptr + o1, x1, w1, n1, s1, p1, F1, BLOCK, cu_ptr, n_cu)
    if N_TERMS > 2:
        bad = bad | _add_term(row_ptr + o2, x2, w2, n2, s2, p2, F2, BLOCK, cu_ptr, n_cu)
    if N_TERMS > 3:
        bad = bad | _add_term(row_ptr + o3, x3, w3, n3, s3, p3, F3, BLOCK, cu_ptr, n_cu)
    if N_TERMS > 4:
        bad = bad | _add_term(row_ptr + o4, x4, w4, n4, s4, p4, F4, BLOCK, cu_ptr, n_cu)
    if N_TERMS > 5:
        bad = bad | _add_term(row_ptr + o5, x5, w5, n5, s5, p5, F5, BLOCK, cu_ptr, n_cu)
    if N_TERMS > 6:
        bad = bad | _add_term(row_ptr + o6, x6, w6, n6, s6, p6, F6, BLOCK, cu_ptr, n_cu)
    if N_TERMS > 7:
        bad = bad | _add_term(row_ptr + o7, x7, w7, n7, s7, p7, F7, BLOCK, cu_ptr, n_cu)
    if TOKENS:
        _tokens_into(ids_ptr, counted_ptr, row_ptr + o_tok, n_tok, T, BLOCK, HAS_MASK)
    if CHECKS:
        tl.store(row_ptr, tl.where(bad != 0, 1, tl.load(row_ptr)))


@triton.jit(do_not_specialize=["n0", "s0", "p0", "o0", "n1", "s1", "p1", "o1", "n2", "s2", "p2", "o2", "n3", "s3",
                               "p3", "o3", "n4", "s4", "p4", "o4", "n5", "s5", "p5", "o5", "n6", "s6", "p6", "o6",
                               "n7", "s7", "p7", "o7", "n_tok", "T", "o_tok", "n_cu", "n_fields", "raw0", "key"])
def _row_kernel(row_ptr, x0, w0, n0, s0, p0, o0, x1, w1, n1, s1, p1, o1, x2, w2, n2, s2, p2, o2,
                x3, w3, n3, s3, p3, o3, x4, w4, n4, s4, p4, o4, x5, w5, n5, s5, p5, o5,
                x6, w6, n6, s6, p6, o6, x7, w7, n7, s7, p7, o7,
                ids_ptr, counted_ptr, n_tok, T, o_tok, cu_ptr, n_cu, n_fields, raw0, key, F0: tl.constexpr,
                F1: tl.constexpr, F2: tl.constexpr, F3: tl.constexpr, F4: tl.constexpr, F5: tl.constexpr,
                F6: tl.constexpr, F7: tl.constexpr, N_TERMS: tl.constexpr, TOKENS: tl.constexpr,
                HAS_MASK: tl.constexpr, CHECKS: tl.constexpr, HEAD: tl.constexpr, BLOCK: tl.constexpr):
    """A row's checksums in one program (_row_body)."""
    _row_body(row_ptr, x0, w0, n0, s0, p0, o0, x1, w1, n1, s1, p1, o1, x2, w2, n2, s2, p2, o2,
              x3, w3, n3, s3, p3, o3, x4, w4, n4, s4, p4, o4, x5, w5, n5, s5, p5, o5,
              x6, w6, n6, s6, p6, o6, x7, w7, n7, s7, p7, o7,
              ids_ptr, counted_ptr, n_tok, T, o_tok, cu_ptr, n_cu, n_fields, raw0, key, F0, F1, F2, F3, F4, F5, F6,
              F7, N_TERMS, TOKENS, HAS_MASK, CHECKS, HEAD, BLOCK)


SLOTS = 8  # terms per launch of _row_kernel (a packed batch's validated row: cu_seqlens' two checks and the
# checksums of the advantages, log-probs and per-completion weights with the ids' range check fill eight)


def terms(row, slot, x, where, size_term, pos):
    """row[slot] += x's term (values_digest's sum, `where`: only those positions; pos not None: the option
    word mix(W, pos)) mod 2**61, in one launch. size_term: values_digest's size word."""
    flat, w = _flat_term(x, where)
    _terms_kernel[(1,)](flat, w, row[slot:], flat.numel(), size_term, 0 if pos is None else pos,
                        IS_FLOAT=flat.dtype.is_floating_point, HAS_WHERE=where is not None, FP=pos is not None,
                        BLOCK=BLOCK)


def _flat_term(x, where):
    flat = x.detach().reshape(-1).contiguous()  # (a view's reshape keeps its strides: the kernel reads stride 1)
    return flat, flat if where is None else where.reshape(-1).contiguous()


CHECK_BITS = {"finite": 8, "binary": 16, "range": 24, "cu": 32, "cu_max": 40, "atleast": 48,  # _add_term's F bits
              "positive": 56}
BOUNDED = ("range", "cu", "cu_max", "atleast")  # kinds whose bound V takes the term's size word: a check alone
V_LIMIT = 1 << 62  # a range check's V = inf, as an int64 bound no id reaches


def row_terms(row, jobs, tokens=None, head=None):
    """A row's checksums in one launch of _row_kernel per SLOTS terms (the tokens' with the first): jobs
    [(slot, x, where, size_term, pos, check[, T])] at distinct slots, as `terms` takes them, check None or a
    core.host_read.RowCheck of x at where (its kind; slot 0: the check alone, no term), T (or the check's
    row_length): x holds one value per row of T tokens, read at each token (_term's PER_ROW), or T = (cu_seqlens,
    N): one per completion of the packed form's N tokens (PER_CU; one cu_seqlens a launch); tokens None or
    (slot, ids, counted, T): the mask as given (nonzero counts; None: every token), T the rows' length
    (digest.token_row_length). head: row_launches'."""
    for args, meta in row_launches(row, jobs, tokens, head):
        _row_kernel[(1,)](row, *args, **meta)


def row_launches(row, jobs, tokens=None, head=None):
    """row_terms' launches of _row_kernel as [(args after row_ptr, constexpr switches)], one per SLOTS terms.
    head None, or (the fields' number, slot 1's raw value or None, the constants' key): the first launch
    writes the whole row first (_row_body's HEAD)."""
    if head is not None and head[0] + 2 > HEAD_SLOTS.value:
        raise ValueError(f"a row written whole holds at most {HEAD_SLOTS.value} slots")
    out = []
    for i in range(0, max(len(jobs), 1), SLOTS):
        part, args, flags, cu = jobs[i:i + SLOTS], [], {}, None
        for k in range(SLOTS):
            if k < len(part):
                slot, x, where, size_term, pos, check, *rows = part[k]
                flat, w = _flat_term(x, where)
                f = int(flat.dtype.is_floating_point) | 2 * (where is not None) | 4 * (pos is not None)
                n = flat.numel()
                if check is not None:
                    f |= CHECK_BITS[check.kind] | (64 if slot == 0 else 0)
                    if check.kind in BOUNDED:
                        size_term = V_LIMIT if check.V == float("inf") else int(check.V)
                    rows = rows or ([] if check.row_length is None else [check.row_length])
                if rows and isinstance(rows[0], tuple):  # (one per completion, read at the N packed tokens)
                    if cu is not None and cu is not rows[0][0]:
                        raise ValueError("the terms of one launch read one cu_seqlens")
                    (cu, n), f = rows[0], f | 256
                elif rows:  # (x one value per row of T tokens, read at n tokens)
                    f, pos, n = f | 128, rows[0], flat.numel() * rows[0]
                args += [flat, w, n, size_term, 0 if pos is None else pos, slot]
                flags[f"F{k}"] = f
            else:
                args += [row, row, 0, 0, 0, 0]
                flags[f"F{k}"] = 0
        tok = tokens if i == 0 else None
        if tok is not None:
            slot, ids, counted, T = tok
            flat = ids.reshape(-1).contiguous()
            args += [flat, flat if counted is None else counted.reshape(-1).contiguous(), flat.numel(), T, slot]
        else:
            args += [row, row, 0, 1, 0]
        args += [row, 0] if cu is None else [cu.reshape(-1).contiguous(), cu.numel() - 1]
        first = head if i == 0 else None
        args += [0, 0, 0] if first is None else [first[0], first[1] or 0, first[2]]
        out.append((args, dict(N_TERMS=len(part), TOKENS=tok is not None, HAS_MASK=tok is not None and tok[2] is not None,
                               CHECKS=any(f & 56 for f in flags.values()), BLOCK=BLOCK,
                               HEAD=0 if first is None else 1 + (first[1] is not None), **flags)))
    return out
