"""Replay over the kept sets (Triton): the math and the layout of replay_torch's docstring, one program
per counted token, reading only its kept logits.

Forward, token m: two passes over its kept ids in blocks of BLOCK_K (the second pass re-reads the same
few hundred entries, from cache): the maximum m_K of z' over the set, the flags and z'_y; then R, the
exponential sums and q as in replay_torch (one instance of the maximum left out, log S = log1p(R)).
Backward: the same blocks, dL/dz_v stored at the kept positions of a zero-initialized gradient (the ids
of a set are distinct, so no two lanes of a program write one address; tokens own distinct rows).
Row offsets are int64 element offsets computed by the launcher (any strides; B * T_l * V passes 2**31);
offsets into the kept ids are int64; no batch size is a compile-time constant.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .vocab_jit import (BAD_ID, BAD_NONFINITE, BAD_TARGET_NEG_INF, _inv_cap, _inv_tau, _log1p, _store_token,
                        _transform, _transform_grad)

BLOCK_K = 128  # kept ids per block: sets are tens to hundreds of ids (top_k 50 .. 512)
LOG_ZERO = tl.constexpr(-1.0e4)  # log p clamp where p underflows: keeps p * (log p + H) finite


@triton.jit
def _kept_block(ids_ptr, row, k, end, V, scale, softcap, inv_cap, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """A block of a token's kept set: (live lanes, the ids, the ids inside [0, V), their transformed logits)."""
    live = k < end
    v = tl.load(ids_ptr + k, mask=live, other=0).to(tl.int64)
    ok = live & (v >= 0) & (v < V)
    z = _transform(tl.load(row + v, mask=ok, other=0.0).to(tl.float32), scale, softcap, inv_cap, HAS_SCALE,
                   HAS_SOFTCAP)
    return live, v, ok, z


@triton.jit
def _row(x_ptr, rb_ptr, rt_ptr, tok, s0, s1):
    """Token tok's row of x: x + rows_b[tok] * s0 + rows_t[tok] * s1 (int64 element offsets; offsets formed
    ahead, as the logits path's are: the same array twice, s0 = 1 and s1 = 0)."""
    return x_ptr + tl.load(rb_ptr + tok).to(tl.int64) * s0 + tl.load(rt_ptr + tok).to(tl.int64) * s1


@triton.jit
def _inv_t(tau_ptr, tau_stride, tau_value, tok, TAU_PTR: tl.constexpr):
    """1 / tau of token tok: read (stride 0: one value for all) or, TAU_PTR off, tau_value; NaN where tau is
    not finite and > 0 (vocab_jit._inv_tau): the token's outputs NaN."""
    if TAU_PTR:
        return _inv_tau(tl.load(tau_ptr + tok * tau_stride).to(tl.float32))
    return _inv_tau(tau_value)


@triton.jit(do_not_specialize=["V", "s0", "s1", "tau_stride", "tau_value"])
def _replay_fwd_kernel(
    # pointers
    logits_ptr, rb_ptr, rt_ptr, y_ptr, tau_ptr, ids_ptr, off_ptr,  # raw z; (M,) rows (b, t); (M,) ids; tau; CSR
    logp_ptr, ent_ptr, stats_ptr, bad_ptr,  # outputs (M,), (M,), (M, 3) = (m_K, log S, q), (M,) int8
    # sizes
    V, s0, s1, tau_stride,
    # scalars
    tau_value, scale, softcap,
    # meta
    TAU_PTR: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    row = _row(logits_ptr, rb_ptr, rt_ptr, tok, s0, s1)
    start = tl.load(off_ptr + tok).to(tl.int64)
    end = tl.load(off_ptr + tok + 1).to(tl.int64)
    y = tl.load(y_ptr + tok).to(tl.int64)
    inv_t = _inv_t(tau_ptr, tau_stride, tau_value, tok, TAU_PTR)
    inv_cap = _inv_cap(softcap, HAS_SOFTCAP)
    lanes = tl.arange(0, BLOCK_K)
    m_l = tl.full([BLOCK_K], float("-inf"), tl.float32)
    flag_l = tl.zeros([BLOCK_K], tl.int32)  # BAD_NONFINITE | BAD_ID bits seen by the lane
    found = tl.zeros([BLOCK_K], tl.int32)
    zy_l = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(start, end, BLOCK_K):  # pass 1: maximum, flags, target
        live, v, ok, z = _kept_block(ids_ptr, row, k0 + lanes, end, V, scale, softcap, inv_cap, HAS_SCALE, HAS_SOFTCAP)
        nf = ok & ((z != z) | (z == float("inf")))
        flag_l = flag_l | tl.where(nf, BAD_NONFINITE, 0) | tl.where(live & ~ok, BAD_ID, 0)
        hit = ok & (v == y)
        found += hit.to(tl.int32)
        zy_l += tl.where(hit, z, 0.0)
        m_l = tl.maximum(m_l, tl.where(ok & ~nf, z, float("-inf")))
    mx = tl.max(m_l, axis=0)
    m = tl.where(mx == float("-inf"), 0.0, mx)
    r_l = tl.zeros([BLOCK_K], tl.float32)
    u_l = tl.zeros([BLOCK_K], tl.float32)
    o_l = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(start, end, BLOCK_K):  # pass 2: the sums relative to the maximum
        live, v, ok, z = _kept_block(ids_ptr, row, k0 + lanes, end, V, scale, softcap, inv_cap, HAS_SCALE, HAS_SOFTCAP)
        use = ok & (z == z) & (z > float("-inf")) & (z < float("inf"))
        d = tl.maximum((z - m) * inv_t, LOG_ZERO)
        ex = tl.where(use, tl.exp(d), 0.0)
        top = use & (z == mx)
        r_l += tl.where(top, 1.0, 0.0) + tl.where(top, 0.0, ex)  # the maximum's instances as 1 exactly
        u_l += ex * d
        o_l += tl.where(ok & (v == y), 0.0, ex)
    r = tl.sum(r_l, axis=0) - 1.0  # S - 1: one instance of the maximum left out
    s_tot = 1.0 + r
    log_s = _log1p(r)
    ent = log_s - tl.sum(u_l, axis=0) / s_tot
    ent = tl.where(inv_t == inv_t, ent, float("nan"))  # (the clamp at LOG_ZERO would hide a NaN 1 / tau)
    z_y = tl.sum(zy_l, axis=0)
    logp = (z_y - m) * inv_t - log_s
    q = tl.sum(o_l, axis=0) / s_tot
    bad = tl.reduce_or(flag_l, axis=0) | tl.where(inv_t != inv_t, BAD_NONFINITE, 0)  # (a tau not > 0: _inv_tau)
    bad = tl.where(z_y == float("-inf"), bad | BAD_TARGET_NEG_INF, bad)
    bad = tl.where(tl.sum(found, axis=0) != 1, bad | BAD_ID, bad)
    _store_token(logp_ptr, ent_ptr, stats_ptr, bad_ptr, tok, logp, ent, m, log_s, q, bad)


@triton.jit(do_not_specialize=["V", "s0", "s1", "g0", "g1", "tau_stride", "tau_value"])
def _replay_bwd_kernel(
    # pointers
    logits_ptr, grad_ptr, rb_ptr, rt_ptr, grb_ptr, grt_ptr, y_ptr, tau_ptr, ids_ptr, off_ptr,  # as forward; grad rows
    stats_ptr, ent_ptr, c_ptr, e_ptr,  # forward's (M, 3) stats and H; c = dL/dlogp, e = dL/dH (M,)
    # sizes
    V, s0, s1, g0, g1, tau_stride,  # the logits' and the gradient's strides
    # scalars
    tau_value, scale, softcap,
    # meta
    TAU_PTR: tl.constexpr, HAS_E: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    c = tl.load(c_ptr + tok).to(tl.float32)
    e = 0.0
    if HAS_E:
        e = tl.load(e_ptr + tok).to(tl.float32)
    if (c != 0.0) | (e != 0.0):  # a token without gradient leaves its zeros
        row = _row(logits_ptr, rb_ptr, rt_ptr, tok, s0, s1)
        grow = _row(grad_ptr, grb_ptr, grt_ptr, tok, g0, g1)
        start = tl.load(off_ptr + tok).to(tl.int64)
        end = tl.load(off_ptr + tok + 1).to(tl.int64)
        y = tl.load(y_ptr + tok).to(tl.int64)
        inv_t = _inv_t(tau_ptr, tau_stride, tau_value, tok, TAU_PTR)
        inv_cap = _inv_cap(softcap, HAS_SOFTCAP)
        m = tl.load(stats_ptr + tok * 3)
        log_s = tl.load(stats_ptr + tok * 3 + 1)
        q = tl.load(stats_ptr + tok * 3 + 2)
        h = tl.load(ent_ptr + tok)
        lanes = tl.arange(0, BLOCK_K)
        for k0 in range(start, end, BLOCK_K):
            k = k0 + lanes
            live = k < end
            v = tl.load(ids_ptr + k, mask=live, other=0).to(tl.int64)
            ok = live & (v >= 0) & (v < V)
            z, dz = _transform_grad(tl.load(row + v, mask=ok, other=0.0).to(tl.float32), scale, softcap,
                                    inv_cap, HAS_SCALE, HAS_SOFTCAP)
            logq = tl.maximum((z - m) * inv_t - log_s, LOG_ZERO)
            p = tl.exp(logq)
            t_e = e * (logq + h)
            g = tl.where(ok & (v == y), c * q - p * t_e, -p * (c + t_e)) * inv_t * dz
            tl.store(grow + v, g.to(grad_ptr.dtype.element_ty), mask=ok)
        # a NaN coefficient (an invalid token, unvalidated) makes its row NaN at its sampled id, whatever its
        # set holds (an empty or malformed one writes nothing above)
        nan = (c != c) | (e != e)
        tl.store(grow + y, (c * 0.0 + float("nan")).to(grad_ptr.dtype.element_ty), mask=nan & (y >= 0) & (y < V))




def _transforms(scale, softcap):
    scale = float(scale)
    return scale, (1.0 if softcap is None else float(softcap)), dict(HAS_SCALE=scale != 1.0,
                                                                   HAS_SOFTCAP=softcap is not None)


def _tau(tau, like):
    """(pointer, stride, value, TAU_PTR) for the kernels: a tensor read where it is (float32, one value
    through a stride 0, or one per token); a number by value (no tensor made)."""
    if not isinstance(tau, torch.Tensor):
        return like, 0, float(tau), False
    t = tau.to(device=like.device, dtype=torch.float32).reshape(-1).contiguous()
    if t.numel() not in (1, like.shape[0]):
        raise ValueError(f"tau: one value or one per token ({like.shape[0]}), got {t.numel()}")
    return t, 0 if t.numel() == 1 else 1, 1.0, True


def replay_fwd(logits3, rows_b, rows_t, y, tau, token_ids, offsets, scale=1.0, softcap=None):
    """Same contract as replay_torch.replay_fwd (float32 outputs); logits3 with vocabulary stride 1."""
    M = y.numel()
    dev = logits3.device
    logp = torch.empty(M, device=dev, dtype=torch.float32)
    ent = torch.empty_like(logp)
    stats = torch.empty((M, 3), device=dev, dtype=torch.float32)
    bad = torch.empty(M, device=dev, dtype=torch.int8)
    if M == 0:
        return logp, ent, stats, bad
    scale, cap, has = _transforms(scale, softcap)
    t_ptr, t_stride, t_value, t_on = _tau(tau, logp)
    _replay_fwd_kernel[(M,)](
        logits3, rows_b.contiguous(), rows_t.contiguous(), y.contiguous(), t_ptr,
        token_ids.contiguous(), offsets.long().contiguous(), logp, ent, stats, bad,
        logits3.shape[-1], logits3.stride(0), logits3.stride(1), t_stride, t_value, scale, cap, TAU_PTR=t_on,
        **has, BLOCK_K=BLOCK_K)
    return logp, ent, stats, bad


def replay_bwd(logits3, grad3, rows_b, rows_t, y, tau, token_ids, offsets, stats, ent, c, e,
               scale=1.0, softcap=None):
    """Same contract as replay_torch.replay_bwd: grad3 zero-initialized, written at the kept positions."""
    M = y.numel()
    if M == 0:
        return grad3
    scale, cap, has = _transforms(scale, softcap)
    c = c.float().contiguous()
    t_ptr, t_stride, t_value, t_on = _tau(tau, c)
    rb, rt = rows_b.contiguous(), rows_t.contiguous()
    _replay_bwd_kernel[(M,)](
        logits3, grad3, rb, rt, rb, rt, y.contiguous(), t_ptr, token_ids.contiguous(),
        offsets.long().contiguous(), stats, ent, c, c if e is None else e.float().contiguous(),
        logits3.shape[-1], logits3.stride(0), logits3.stride(1), grad3.stride(0), grad3.stride(1), t_stride,
        t_value, scale, cap, TAU_PTR=t_on, HAS_E=e is not None, **has, BLOCK_K=BLOCK_K)
    return grad3
