"""The sampler's kept set rebuilt by its rules (spec 13) as one threshold per token, in one launch with no host
read: the kernel before the forward vocabulary kernel when top_k / top_p / min_p take the epilogue.

For a counted token with row s = z' / tau (s_v = z'_v * (1 / tau), as the vocabulary kernels form it), vLLM's
order (min-p on the full softmax, top-k with its ties kept, top-p on what remains sorted ascending with ties by
ascending id, the largest always kept) leaves a set that is an upper set of the order (s_v, v): every kept entry
is at or above the smallest kept one. So the set is written as that entry, (t_s, t_id), and the vocabulary
kernels keep

    v in K  <=>  s_v > t_s, or s_v == t_s and v >= t_id, or v == y     (vocab_jit._kept)

(the sampled token y added back where the rules left it out). No set is listed, so nothing of unknown size is
made. The threshold is found by bisection over the order-preserving integer key of s's float32 bits (_key):
top-k's k-th largest value by counting passes over the row, top-p's cut by passes of the masses at or below a
key, then, where several entries tie at the cut, by passes over their ids; each step halves the range left at
least (at most about 32 steps a search) and moves its ends onto the nearest entries (fewer where it holds few).
The row of one program is read again on each pass (from L2 at real sizes); every other output is O(1) per token.
Masses are e^(s_v - max s) in float32 summed in float64, compared as vLLM's cumulative sum is, so a cut that
lands within a rounding of 1 - top_p may differ from a sort's (the sampled token is restored either way).
Invalid rule values read per token (top_k < -1, top_p outside (0, 1], min_p outside [0, 1], NaN) give t_s =
NaN, which the forward kernel flags (BAD_RULE): that token's outputs NaN. A number was checked on the host, in
float64: one that float32 rounds to its range's open end keeps what the rules keep there.

Per token it also writes kst = (|K|, restored, the full softmax's mass on K) for spec 13's metrics, which the
epilogue sums (0 at uncounted tokens).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .vocab_status import _tau_at, _token
from .vocab_jit import _MAX, _MIN, _SUM

# a bound on any search's steps: each at least halves a range of at most 2^32 keys (or ids), so 33 suffice;
# the bound only guards the loops against what cannot happen
MAX_STEPS = tl.constexpr(64)


@triton.jit
def _key(s):
    """s's float32 bits b as an int64 in s's order: b ^ 0x7FFFFFFF where negative (-0 and +0 the same key, 0;
    NaN is never asked). _scan writes these lines out in its loop (the interpreter pays for each call)."""
    b = s.to(tl.int32, bitcast=True)
    return tl.where(s == 0.0, 0, tl.where(b < 0, b ^ 0x7FFFFFFF, b)).to(tl.int64)


@triton.jit
def _unkey(k):
    """The float32 value of a key."""
    b = k.to(tl.int32)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b).to(tl.float32, bitcast=True)


@triton.jit
def _scan(row, V, lanes, inv_temp, mx, mp, t_k, t, i, WHAT: tl.constexpr, BLOCK_V: tl.constexpr,
          MIN_P: tl.constexpr):
    """One pass over the row, s = z * (1 / tau), over the entries min-p keeps (finite, e^(s - max) >= min_p)
    with key >= t_k, in three forms (their values 0 / sentinels where nothing matches):
        WHAT 0   (how many have key >= t, the smallest such key, the largest key < t)
        WHAT 1   (the float64 sum of e^(s - max) of those with key <= t, the largest such key, the smallest
                 key > t)
        WHAT 2   of those at key t: (how many have id <= i, the largest such id (-1: none), the smallest id
                 > i (V: none))
    Written out, with no call inside the loop: Triton's interpreter pays for each.
    MIN_P 0 (min-p off): no exponential but for the masses."""
    if WHAT == 1:
        acc = tl.full((), 0, tl.float64)
        a = tl.full((), -2147483648, tl.int64)
        b = tl.full((), 2147483647, tl.int64)
    elif WHAT == 0:
        cnt = tl.full((), 0, tl.int64)
        a = tl.full((), 2147483647, tl.int64)
        b = tl.full((), -2147483648, tl.int64)
    else:
        cnt = tl.full((), 0, tl.int64)
        a = tl.full((), -1, tl.int64)
        b = tl.full((), 0, tl.int64) + V
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + lanes
        s = tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_temp
        bits = s.to(tl.int32, bitcast=True)  # _key(s), written out
        k = tl.where(s == 0.0, 0, tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)).to(tl.int64)
        keep = (s == s) & (s > float("-inf")) & (k >= t_k)
        if MIN_P != 0:
            keep = keep & (tl.exp(s - mx) >= mp)
        if WHAT == 0:
            up = keep & (k >= t)
            cnt += tl.reduce(up.to(tl.int64), 0, _SUM)
            a = tl.minimum(a, tl.reduce(tl.where(up, k, 2147483647), 0, _MIN))
            b = tl.maximum(b, tl.reduce(tl.where(keep & (k < t), k, -2147483648), 0, _MAX))
        elif WHAT == 1:
            down = keep & (k <= t)
            acc += tl.reduce(tl.where(down, tl.exp(s - mx), 0.0).to(tl.float64), 0, _SUM)
            a = tl.maximum(a, tl.reduce(tl.where(down, k, -2147483648), 0, _MAX))
            b = tl.minimum(b, tl.reduce(tl.where(keep & (k > t), k, 2147483647), 0, _MIN))
        else:
            tie = keep & (k == t)
            cnt += tl.reduce((tie & (offs <= i)).to(tl.int64), 0, _SUM)
            a = tl.maximum(a, tl.reduce(tl.where(tie & (offs <= i), offs, -1), 0, _MAX))
            b = tl.minimum(b, tl.reduce(tl.where(tie & (offs > i), offs, V), 0, _MIN))
    if WHAT == 1:
        out = acc
    else:
        out = cnt
    return out, a, b


@triton.jit
def _by_rule(s, v, t_s, t_id):
    """Whether the rules keep entry v of value s: finite, and at or above the threshold (t_s, t_id). The test
    a set's size is counted with here and its ids listed with (kept_set_triton)."""
    return (s == s) & (s > float("-inf")) & ((s > t_s) | ((s == t_s) & (v >= t_id)))


@triton.jit
def _rule(ptr, stride, value, tok, MODE: tl.constexpr, off, dtype: tl.constexpr):
    """A rule's value for token tok in `dtype`: MODE 0 off (`off`), 1 by value, 2 read at ptr + tok * stride."""
    if MODE == 2:
        x = tl.load(ptr + tok * stride).to(dtype)
    elif MODE == 1:
        x = tl.full((), 0, dtype) + value
    else:
        x = tl.full((), 0, dtype) + off
    return x


@triton.jit(do_not_specialize=["T", "V", "logits_start", "temp_stride", "k_stride", "k_val", "p_stride",
                               "mp_stride", "n_seq"])
def _kept_rule_kernel(
    logits_ptr, ids_ptr, mask_ptr,  # (B, T_l, V) rows (vocabulary stride 1); (B*T,) ids; (B*T,) counted flag
    ts_ptr, tid_ptr, kst_ptr,  # outputs: (B*T,) float32 t_s, int64 t_id; (B*T, 3) float32 (|K|, restored, mass)
    stride_lb, stride_lt, T, V, logits_start,
    temp_ptr, temp_stride, seq_cu_ptr, n_seq,  # tau as the forward kernel reads it (TEMP_PER_SEQ: its _tau_at)
    k_ptr, k_stride, k_val,  # top_k: int64 per token (MODE 2), or by value (1)
    p_ptr, p_stride, p_val,  # top_p
    mp_ptr, mp_stride, mp_val,  # min_p
    TOP_K: tl.constexpr, TOP_P: tl.constexpr, MIN_P: tl.constexpr,  # 0 off, 1 by value, 2 per token
    HAS_MASK: tl.constexpr, TEMP_BY_VALUE: tl.constexpr, BLOCK_V: tl.constexpr,
    STATS: tl.constexpr = True,  # False: kst is not written (token_logprobs: no metrics), one pass fewer
    NAN_BAD: tl.constexpr = True,  # False: an invalid rule value's threshold is left as found (listed sets)
    TEMP_PER_SEQ: tl.constexpr = 0,  # tau one per completion: 1 padded (a row of T tokens), 2 packed (seq_cu_ptr)
):
    pid = tl.program_id(0).to(tl.int64)
    inv_temp, counted = _token(_tau_at(pid, pid, T, seq_cu_ptr, n_seq, TEMP_PER_SEQ), temp_ptr, temp_stride, pid,
                               mask_ptr, TEMP_BY_VALUE, HAS_MASK)
    t_s = tl.full((), 0, tl.float32)
    t_id = tl.full((), 0, tl.int64)
    size = tl.full((), 0, tl.float32)
    restored = tl.full((), 0, tl.float32)
    mass = tl.full((), 0, tl.float32)
    if counted:
        i = pid // T
        row = logits_ptr + i * stride_lb + (pid - i * T + logits_start) * stride_lt
        y = tl.load(ids_ptr + pid).to(tl.int64)
        lanes = tl.arange(0, BLOCK_V)
        k = _rule(k_ptr, k_stride, k_val, pid, TOP_K, 0, tl.int64)
        p = _rule(p_ptr, p_stride, p_val, pid, TOP_P, 1.0, tl.float32)
        mp = _rule(mp_ptr, mp_stride, mp_val, pid, MIN_P, 0.0, tl.float32)
        # a value read per token out of its range (a number was checked on the host, in float64: one that
        # float32 rounds to the range's open end, top_p 1e-50 -> 0 or min_p 1 - 1e-9 -> 1, keeps what the
        # rules keep there, the largest entry or the entries tied at the maximum)
        bad = ((k < -1) & (TOP_K == 2)) | (~((p > 0.0) & (p <= 1.0)) & (TOP_P == 2)) \
            | (~((mp >= 0.0) & (mp <= 1.0)) & (MIN_P == 2))
        # pass: the row's maximum (NaN left out), then what min-p keeps: its count and keys' range
        mx = tl.full((), float("-inf"), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + lanes
            s = tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_temp
            mx = tl.maximum(mx, tl.reduce(tl.where(s == s, s, float("-inf")), 0, _MAX))
        mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
        lowest = tl.full((), -2147483648, tl.int64)
        n1, lo_k, _b = _scan(row, V, lanes, inv_temp, mx_safe, mp, lowest, lowest, 0, 0, BLOCK_V, MIN_P)
        # the largest key min-p keeps: the maximum's (e^0 = 1 >= min_p), as a key
        hi_k = _key(mx_safe)
        # top-k: the largest key t with at least k kept entries at or above it (ties at it kept); each step
        # halves the keys' range at least, and lands on the entries nearest its midpoint
        t_k = lo_k
        if TOP_K != 0:
            if (k > 0) & (k < V) & (n1 > k):
                lo = lo_k
                hi = hi_k
                it = 0
                while (lo < hi) & (it < MAX_STEPS):
                    mid = lo + (hi - lo + 1) // 2
                    cnt, a, b = _scan(row, V, lanes, inv_temp, mx_safe, mp, lowest, mid, 0, 0, BLOCK_V, MIN_P)
                    if cnt >= k:
                        lo = a
                    else:
                        hi = b
                    it += 1
                t_k = lo
        t = t_k
        tid = tl.full((), 0, tl.int64)
        if TOP_P != 0:
            if (p < 1.0) & (n1 > 0):
                cut = 1.0 - p  # vLLM drops the ascending prefix whose cumulative mass is <= 1 - top_p
                z2, _a, _b = _scan(row, V, lanes, inv_temp, mx_safe, mp, t_k, hi_k, 0, 1, BLOCK_V, MIN_P)
                # the smallest key whose mass at or below it exceeds the cut (none: the largest alone is kept)
                found = z2 / z2 > cut
                lo = t_k
                hi = tl.where(found, hi_k, t_k)
                it = 0
                while (lo < hi) & (it < MAX_STEPS):
                    acc, a, b = _scan(row, V, lanes, inv_temp, mx_safe, mp, t_k, lo + (hi - lo) // 2, 0, 1, BLOCK_V,
                                      MIN_P)
                    if acc / z2 > cut:
                        hi = a
                    else:
                        lo = b
                    it += 1
                t = tl.where(found, lo, hi_k)
                # the entries tied at t by ascending id: the first whose cumulative mass exceeds the cut, or
                # (none does, by rounding) the last
                below, _a, _b = _scan(row, V, lanes, inv_temp, mx_safe, mp, t_k, t - 1, 0, 1, BLOCK_V, MIN_P)
                e_t = tl.exp(_unkey(t) - mx_safe).to(tl.float64)
                n_t, last, _b = _scan(row, V, lanes, inv_temp, mx_safe, mp, t_k, t, V, 2, BLOCK_V, MIN_P)
                if n_t > 1:
                    tid = last
                    if (below + n_t.to(tl.float64) * e_t) / z2 > cut:
                        _c, _a, lo = _scan(row, V, lanes, inv_temp, mx_safe, mp, t_k, t, -1, 2, BLOCK_V, MIN_P)
                        hi = last
                        it = 0
                        while (lo < hi) & (it < MAX_STEPS):
                            cnt, a, b = _scan(row, V, lanes, inv_temp, mx_safe, mp, t_k, t, lo + (hi - lo) // 2, 2,
                                              BLOCK_V, MIN_P)
                            if (below + cnt.to(tl.float64) * e_t) / z2 > cut:
                                hi = a
                            else:
                                lo = b
                            it += 1
                        tid = lo
        # nothing kept by the rules (no finite entry): only the sampled token
        empty = n1 == 0
        t_s = tl.where(empty, float("inf"), _unkey(t))
        t_id = tl.where(empty, V, tid)
        if STATS:  # the set's size, the sampled token restored, the full softmax's mass on the set
            y_in = tl.full((), 0, tl.int32)
            m_set = tl.full((), 0, tl.float64)
            m_all = tl.full((), 0, tl.float64)
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + lanes
                s = tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv_temp
                # (the vocabulary kernels' test, vocab_jit._kept: every entry at or above the threshold is min-p's)
                rule = _by_rule(s, offs, t_s, t_id)
                inside = rule | ((offs == y) & (offs < V))  # (an id past V: no entry, as a masked lane is none)
                e = tl.where(s == s, tl.exp(s - mx_safe), 0.0).to(tl.float64)
                size += tl.reduce(inside.to(tl.float32), 0, _SUM)
                y_in += tl.reduce((rule & (offs == y)).to(tl.int32), 0, _SUM)
                m_set += tl.reduce(tl.where(inside, e, 0.0), 0, _SUM)
                m_all += tl.reduce(e, 0, _SUM)
            restored = tl.where((y >= 0) & (y < V) & (y_in == 0), 1.0, 0.0)
            mass = (m_set / m_all).to(tl.float32)
        if NAN_BAD:
            t_s = tl.where(bad, float("nan"), t_s)
    tl.store(ts_ptr + pid, t_s)
    tl.store(tid_ptr + pid, t_id)
    if STATS:
        tl.store(kst_ptr + pid * 3, size)
        tl.store(kst_ptr + pid * 3 + 1, restored)
        tl.store(kst_ptr + pid * 3 + 2, mass)


def _rule_arg(x, like, dtype):
    """(MODE, pointer, stride, value) of a rule: None off; a number by value; a 0-d or (n,) tensor read."""
    import torch
    if x is None:
        return 0, like, 0, 0
    if isinstance(x, torch.Tensor):
        x = x.reshape(-1)
        if x.dtype != dtype:
            x = x.to(dtype)
        return 2, x, 0 if x.numel() == 1 else x.stride(0), 0
    return 1, like, 0, x


def kept_thresholds(logits3, ids, counted, temperature, logits_start, top_k=None, top_p=None, min_p=None,
                    outs=None, stats=True, nan_bad=True, tau_seq=0, cu=None):
    """The kept sets of the rules as thresholds (module docstring), one launch: (t_s (n,) float32, t_id (n,)
    int64, kst (n, 3) float32). logits3 (B, T_l, V) with vocabulary stride 1; ids (B*T,); counted (B*T,) of
    any dtype (nonzero counts) or None; temperature as vocab_triton.temperature_arg takes it; each rule None,
    a number, or a 0-d or (n,) tensor (top_k integer, top_p and min_p float32). outs: (t_s, t_id) to write.
    stats=False: kst is left unset (one pass fewer). nan_bad=False: a token's invalid rule value leaves its
    threshold as found (the value used as it is, a negative top_k as off; the caller flags the token), not NaN.
    tau_seq: the temperature one per completion (B,), read at each token's (1 padded, 2 packed: `cu`)."""
    import torch
    from .vocab_triton import _per_seq, block_v_for, num_warps_for, temperature_arg
    B, _T_l, V = logits3.shape
    n = ids.numel()
    dev = logits3.device
    t_s, t_id = outs if outs is not None else (torch.empty(n, device=dev, dtype=torch.float32),
                                               torch.empty(n, device=dev, dtype=torch.int64))
    kst = torch.empty((n, 3), device=dev, dtype=torch.float32)
    if n == 0:
        return t_s, t_id, kst
    seq = _per_seq(tau_seq, cu, temperature)
    tau, tau_stride = temperature_arg(temperature, dev, seq.get("tau_len", n))
    km, kp, ks, kv = _rule_arg(top_k, ids, torch.int64)
    pm, pp, ps, pv = _rule_arg(top_p, t_s, torch.float32)
    mm, mpp, ms, mv = _rule_arg(min_p, t_s, torch.float32)
    bv = block_v_for(V)
    _kept_rule_kernel[(n,)](logits3, ids, ids if counted is None else counted, t_s, t_id, kst,
                            logits3.stride(0), logits3.stride(1), n // B, V, logits_start, tau, tau_stride,
                            seq.get("cu_ptr", t_id), seq.get("n_seq", 0),
                            kp, ks, int(kv), pp, ps, float(pv), mpp, ms, float(mv), TOP_K=km, TOP_P=pm, MIN_P=mm,
                            HAS_MASK=counted is not None, TEMP_BY_VALUE=isinstance(tau, float), BLOCK_V=bv,
                            STATS=stats, NAN_BAD=nan_bad, TEMP_PER_SEQ=seq.get("TEMP_PER_SEQ", 0),
                            num_warps=num_warps_for(bv))
    return t_s, t_id, kst
