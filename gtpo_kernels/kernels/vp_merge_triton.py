"""The vocabulary-parallel merge of spec 12 on the device, around the two all-reduces (vp_merge holds the
math and its torch twin): what the torch twin forms with about a hundred small ops.

    _live_max          this slice's row maximum, -inf where the slice adds nothing  -> M (all-reduce MAX),
                       stored by the forward kernel itself (vocab_fwd_triton, VP_MAX): no launch of its own
    _vp_sums_kernel    this slice's 7 numbers per token, scaled to the global M     -> vec (all-reduce SUM)
    _vp_finish_kernel  the merged sums -> logp, H, stats (M, log S, q) and flags per token (_finish_at; the
                       epilogue kernel does it itself where it follows: pipeline/epilogue_attached.py)

    M = vocab_triton.vocab_fwd(..., local_max=M) (vp_merge.local_max's values)
    vec = local_sums(logp_r, ent_r, stats_r, bad_r, ids_loc, counted, M, temperature, V_local)
    logp, ent, stats, bad = finish(vec, M, ids, counted, V)

A program per BLOCK tokens; int64 offsets; no host read. counted: the caller's mask as given (nonzero
counts) or None (every token counts).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .conflict_triton import _conflict_group
from .epilogue_terms import _expm1
from .vocab_jit import BAD_ID, BAD_NONFINITE, BAD_TARGET_NEG_INF, _inv_tau, _log1p
from .vocab_status import _seqs_of

BLOCK = 256


@triton.jit
def _live(m, ls, ent, bad, V_local):
    """(S_r, non-finite, live) of the slice's statistics (m_r, log S_r, H_r, flags): a slice all at -inf
    (S_r = 0), an empty one or a non-finite one adds nothing to the sums (live False)."""
    s = tl.exp(ls)
    nonfinite = ((bad & BAD_NONFINITE) != 0) | (ls != ls) | (m != m)
    live = (s > 0) & (ent == ent) & (nonfinite == 0) & (V_local > 0)
    return s, nonfinite, live


@triton.jit
def _live_max(m, ls, ent, bad, V_local):
    """The slice's row maximum where it adds to the merge, else -inf: the first all-reduce's input (the
    forward kernel stores it with VP_MAX)."""
    _, _, live = _live(m, ls, ent, bad, V_local)
    return tl.where(live, m, float("-inf"))


@triton.jit
def _slice(stats_ptr, ent_ptr, bad_ptr, o, inb, V_local):
    """The slice's (m_r, log S_r, H_r, S_r, non-finite, live) at tokens o (_live)."""
    m = tl.load(stats_ptr + 3 * o, mask=inb, other=0.0)
    ls = tl.load(stats_ptr + 3 * o + 1, mask=inb, other=0.0)
    ent = tl.load(ent_ptr + o, mask=inb, other=0.0)
    bad = tl.load(bad_ptr + o, mask=inb, other=0).to(tl.int32)
    s, nonfinite, live = _live(m, ls, ent, bad, V_local)
    return m, ls, ent, s, nonfinite, live


@triton.jit
def _counted(counted_ptr, o, inb, HAS_MASK: tl.constexpr):
    """Whether tokens o count: the caller's mask as given (nonzero counts), or every token without one."""
    if HAS_MASK:
        return inb & (tl.load(counted_ptr + o, mask=inb, other=0) != 0)
    return inb


@triton.jit
def _token_of(rows_ptr, o, inb, ROWS: tl.constexpr):
    """The token of positions o: rows_ptr[o] (ROWS: the LM head's tile, whose per-token inputs and outputs
    are the call's), else o."""
    if ROWS:
        return tl.load(rows_ptr + o, mask=inb, other=0).to(tl.int64)
    return o


@triton.jit(do_not_specialize=["n", "V_local", "tau_stride", "id_start", "row_length", "n_seq", "T", "logits_start",
                               "n_sums", "c_B", "c_T", "c_N", "c_G", "n_groups"])
def _vp_sums_kernel(logp_ptr, stats_ptr, ent_ptr, bad_ptr, ids_ptr, counted_ptr, M_ptr, tau_ptr, tau_stride,
                    vec_out, n, V_local, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr = True,
                    TEMP_BY_VALUE: tl.constexpr = False, id_start=0, rows_ptr=None, ROWS: tl.constexpr = False,
                    row_length=1, TEMP_PER_SEQ: tl.constexpr = 0, cu_ptr=None, n_seq=0, logits_ptr=None, stride_lb=0,
                    stride_lt=0, T=1, logits_start=0, TARGET_Z: tl.constexpr = False,
                    n_sums=0, CONFLICT: tl.constexpr = False, c_ids=None, c_mask=None, c_adv=None, c_cu=None,
                    c_lam=None, c_nconf=None, c_B=0, c_T=0, c_N=0, c_G=1, w_pos=1.0, w_neg=1.0, n_groups=1,
                    C_PACKED: tl.constexpr = False, C_HAS_MASK: tl.constexpr = False, BLOCK_G: tl.constexpr = 1,
                    BLOCK_T: tl.constexpr = 16):
    """ROWS: the slice's statistics, M and vec at position o, the ids, mask and tau at token rows_ptr[o].
    TEMP_PER_SEQ: tau holds one value per completion: 1, per row of row_length tokens (padded), token k's at
    k // row_length; 2, per completion of the packed form's cu_ptr (n_seq of them), found there (_seqs_of).
    TARGET_Z: the owner reads its target logit from the logits (token k's row: (k // T, logits_start + k % T),
    as the forward kernel's), (z_y - m_r) / tau, where the forward kernel ran before the slice's first id was
    known (vp_first_triton); else from the forward's logp (logp_r + log S_r). CONFLICT: programs n_sums and
    after compute the call's conflict weights, a group each (conflict_triton._conflict_group, the c_ arguments
    as its own launch's), so that they take no launch of their own (spec 8)."""
    pid = tl.program_id(0).to(tl.int64)
    sums = True
    if CONFLICT:
        sums = pid < n_sums
        if pid >= n_sums:
            _conflict_group(pid - n_sums, n_groups, c_ids, c_mask, c_adv, c_cu, c_lam, c_nconf, c_B, c_T, c_N, c_G,
                            w_pos, w_neg, C_PACKED, C_HAS_MASK, BLOCK_G, BLOCK_T)
    if sums:
        _sums(pid, logp_ptr, stats_ptr, ent_ptr, bad_ptr, ids_ptr, counted_ptr, M_ptr, tau_ptr, tau_stride,
              vec_out, n, V_local, BLOCK, HAS_MASK, TEMP_BY_VALUE, id_start, rows_ptr, ROWS, row_length,
              TEMP_PER_SEQ, cu_ptr, n_seq, logits_ptr, stride_lb, stride_lt, T, logits_start, TARGET_Z)


@triton.jit
def _sums(pid, logp_ptr, stats_ptr, ent_ptr, bad_ptr, ids_ptr, counted_ptr, M_ptr, tau_ptr, tau_stride, vec_out, n,
          V_local, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr, TEMP_BY_VALUE: tl.constexpr, id_start, rows_ptr,
          ROWS: tl.constexpr, row_length, TEMP_PER_SEQ: tl.constexpr, cu_ptr, n_seq, logits_ptr, stride_lb,
          stride_lt, T, logits_start, TARGET_Z: tl.constexpr):
    """_vp_sums_kernel's BLOCK tokens of program pid."""
    o = pid * BLOCK + tl.arange(0, BLOCK)
    inb = o < n
    tok = _token_of(rows_ptr, o, inb, ROWS)
    m, ls, ent, s, nonfinite, live = _slice(stats_ptr, ent_ptr, bad_ptr, o, inb, V_local)
    M = tl.load(M_ptr + o, mask=inb, other=0.0)
    if TEMP_BY_VALUE:  # tau_ptr is tau itself
        inv_t = _inv_tau(tau_ptr)
    else:
        if TEMP_PER_SEQ == 2:
            at = _seqs_of(cu_ptr, n_seq, tok)
        elif TEMP_PER_SEQ == 1:
            at = tok // row_length
        else:
            at = tok
        inv_t = 1.0 / tl.load(tau_ptr + at * tau_stride, mask=inb, other=1.0)
    counted = _counted(counted_ptr, tok, inb, HAS_MASK)
    y = tl.load(ids_ptr + tok, mask=inb, other=-1).to(tl.int64) - id_start  # this slice's id
    m_eff = tl.where(live, m, float("-inf"))
    M_safe = tl.where(tl.abs(M) < float("inf"), M, 0.0)
    delta = tl.where(live, (m_eff - M_safe) * inv_t, 0.0)
    w = tl.where(live, tl.exp(delta), 0.0)
    at_max = live & (m_eff == M)
    ws = tl.where(live, w * s, 0.0)
    r_r = _expm1(ls)
    u_r = tl.where(live, (ls - ent) * s, 0.0)
    owned = counted & (y >= 0) & (y < V_local)
    if TARGET_Z:
        i = tok // T
        z_y = tl.load(logits_ptr + i * stride_lb + (tok - i * T + logits_start) * stride_lt + y, mask=owned,
                      other=0.0).to(tl.float32)
        t_r = (z_y - m) * inv_t  # (m: the slice's maximum as stored, 0 where it has no finite entry)
    else:
        t_r = tl.load(logp_ptr + o, mask=inb, other=0.0) + ls  # (z_y - m_r) / tau on the owner
    v = vec_out + 7 * o
    tl.store(v, ws, mask=inb)                                          # S
    tl.store(v + 1, tl.where(live, w * (u_r + s * delta), 0.0), mask=inb)  # U
    tl.store(v + 2, tl.where(at_max, r_r, ws), mask=inb)               # R, less (slices at the max - 1)
    tl.store(v + 3, tl.where(owned, t_r + delta, 0.0), mask=inb)       # (z_y - M) / tau
    tl.store(v + 4, at_max.to(tl.float32), mask=inb)                   # slices at the maximum
    tl.store(v + 5, (owned & at_max & (t_r == 0)).to(tl.float32), mask=inb)  # the target at the maximum
    tl.store(v + 6, (nonfinite & counted).to(tl.float32), mask=inb)


@triton.jit
def _finish_at(vec_ptr, M_ptr, ids_ptr, stats_out, bad_out, o, tok, inb, counted, V):
    """Positions o's merged sums (vec, M) -> (logp, H, flags) of tokens tok (o itself but in the LM head's
    tile), 0 where not `counted`; stores the flags and the backward's stats (M, log S, q) at tok (the
    epilogue kernel calls it too, in place of this kernel's launch)."""
    v = vec_ptr + 7 * o
    s = tl.load(v, mask=inb, other=1.0)
    u = tl.load(v + 1, mask=inb, other=0.0)
    at_max = tl.load(v + 4, mask=inb, other=1.0)
    r = tl.load(v + 2, mask=inb, other=0.0) + tl.maximum(at_max - 1.0, 0.0)
    log_s = _log1p(r)
    ent = log_s - u / s
    logp = tl.load(v + 3, mask=inb, other=0.0) - log_s
    top = tl.load(v + 5, mask=inb, other=0.0) > 0
    q = tl.where(top, r / s, -_expm1(tl.where(top, 0.0, logp)))
    M = tl.load(M_ptr + o, mask=inb, other=0.0)
    y = tl.load(ids_ptr + tok, mask=inb, other=0).to(tl.int64)
    bad = tl.where((tl.load(v + 6, mask=inb, other=0.0) > 0) | (M == float("inf")), BAD_NONFINITE, 0)
    bad = bad | tl.where(logp == float("-inf"), BAD_TARGET_NEG_INF, 0)
    bad = tl.where(counted, bad | tl.where((y < 0) | (y >= V), BAD_ID, 0), 0)
    tl.store(bad_out + tok, bad.to(tl.int8), mask=inb)
    tl.store(stats_out + 3 * tok, tl.where(tl.abs(M) < float("inf"), M, 0.0), mask=inb)
    tl.store(stats_out + 3 * tok + 1, tl.where(counted, log_s, 0.0), mask=inb)
    tl.store(stats_out + 3 * tok + 2, tl.where(counted, q, 0.0), mask=inb)
    return tl.where(counted, logp, 0.0), tl.where(counted, ent, 0.0), bad


@triton.jit(do_not_specialize=["n", "V"])
def _vp_finish_kernel(vec_ptr, M_ptr, ids_ptr, counted_ptr, logp_out, ent_out, stats_out, bad_out, n, V,
                      BLOCK: tl.constexpr, HAS_MASK: tl.constexpr = True, NAN_FLAGGED: tl.constexpr = False,
                      rows_ptr=None, ROWS: tl.constexpr = False):
    """_finish_at for BLOCK tokens a program; NAN_FLAGGED: logp and H NaN at a flagged (counted) token.
    ROWS: vec and M at position o, the ids, the mask and the outputs at token rows_ptr[o]."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = o < n
    tok = _token_of(rows_ptr, o, inb, ROWS)
    logp, ent, bad = _finish_at(vec_ptr, M_ptr, ids_ptr, stats_out, bad_out, o, tok, inb,
                                _counted(counted_ptr, tok, inb, HAS_MASK), V)
    if NAN_FLAGGED:
        logp = tl.where(bad != 0, float("nan"), logp)
        ent = tl.where(bad != 0, float("nan"), ent)
    tl.store(logp_out + tok, logp, mask=inb)
    tl.store(ent_out + tok, ent, mask=inb)


def _grid(n):
    return (max(triton.cdiv(n, BLOCK), 1),)


def _flat(x):
    return x.reshape(-1).contiguous()


def _mask(counted, other):
    """The mask's pointer: counted as given (any dtype, flat), or any tensor when None (not read)."""
    return other if counted is None else _flat(counted)


def local_sums(logp_r, ent_r, stats_r, bad_r, ids_loc, counted, M, temperature, V_local, id_start=0, rows=None,
               row_length=None, cu=None, target=None, conflicts=None):
    """rows: the token of each position (the LM head's tile): ids_loc, counted and a per-token temperature are
    the call's, read there. row_length T: the temperature holds one tau per row of T tokens (padded); cu: one
    per completion of the packed form's cu_seqlens (as given), found there. target: (logits3, logits_start), the
    slice's raw logits (no transform), where the owner reads its target logit (TARGET_Z; not with rows).
    conflicts: a conflict_triton.Deferred, whose groups run as more programs of this launch."""
    n = ent_r.numel()
    grid, more = _grid(n), {}
    if conflicts is not None and not conflicts.done:
        n_groups, more = conflicts.fold(grid[0])
        grid = (grid[0] + n_groups,)
    by_value = not isinstance(temperature, torch.Tensor)  # a number: a launch argument
    tau = float(temperature) if by_value else temperature.to(device=ent_r.device, dtype=torch.float32).reshape(-1)
    vec = torch.empty((n, 7), dtype=torch.float32, device=ent_r.device)
    ids_loc = _flat(ids_loc)
    _vp_sums_kernel[grid](logp_r, stats_r.contiguous(), ent_r, bad_r, ids_loc, _mask(counted, ids_loc), M, tau,
                              0 if by_value else tau.stride(0) if tau.numel() > 1 else 0, vec, n, V_local,
                              BLOCK=BLOCK, HAS_MASK=counted is not None, TEMP_BY_VALUE=by_value, id_start=id_start,
                              **({} if rows is None else dict(rows_ptr=rows, ROWS=True)),
                              **({} if by_value else _per_seq(row_length, cu)), **_target(target, n), **more)
    return vec


def _target(target, n):
    """_vp_sums_kernel's arguments for TARGET_Z (target: (logits3, logits_start)), or none."""
    if target is None:
        return {}
    logits3, start = target
    B = logits3.shape[0]
    return dict(logits_ptr=logits3, stride_lb=logits3.stride(0), stride_lt=logits3.stride(1), T=n // B if B else 1,
                logits_start=start, TARGET_Z=True)


def _per_seq(row_length, cu):
    """_vp_sums_kernel's arguments for a temperature per completion: per row of row_length tokens, or per
    completion of cu_seqlens (cu); neither: none."""
    if cu is not None:
        return dict(TEMP_PER_SEQ=2, cu_ptr=cu.reshape(-1).contiguous(), n_seq=cu.numel() - 1)
    return {} if row_length is None else dict(row_length=max(row_length, 1), TEMP_PER_SEQ=1)


def finish(vec, M, ids, counted, V, nan_flagged=False, outs=None, rows=None):
    """(logp, H, stats, flags) from the merged sums (_vp_finish_kernel); outs: written into these (contiguous,
    float32 and int8 flags), else new tensors. rows: the token of each position (the LM head's tile): ids,
    counted and `outs` are the call's, read and written there."""
    n = M.numel()
    dev = M.device
    if outs is not None:
        logp, ent, stats, bad = outs
    else:
        logp, ent = torch.empty(n, dtype=torch.float32, device=dev), torch.empty(n, dtype=torch.float32, device=dev)
        stats, bad = torch.empty((n, 3), dtype=torch.float32, device=dev), torch.empty(n, dtype=torch.int8, device=dev)
    ids = _flat(ids)
    _vp_finish_kernel[_grid(n)](vec, M, ids, _mask(counted, ids), logp, ent, stats, bad, n, V, BLOCK=BLOCK,
                                HAS_MASK=counted is not None, NAN_FLAGGED=nan_flagged,
                                **({} if rows is None else dict(rows_ptr=rows, ROWS=True)))
    return logp, ent, stats, bad
