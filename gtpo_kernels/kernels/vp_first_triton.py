"""A vocabulary-parallel call's first launch (spec 8, 12): this rank's forward pass over its slice and the
agreement's row in one launch, before the agreement's collective.

    _vp_first_kernel   programs 1 .. n: token k - 1's statistics over the slice (vocab_fwd_triton's, with the
                       slice's maximum stored for the first all-reduce, VP_MAX), without its target logit: the
                       slice's first id is known only after the agreement, so the merge's sums kernel reads it
                       (vp_merge_triton, TARGET_Z); program 0: the agreement's row (digest_triton._row_body)

Neither reads what the other writes. Without it the row's kernel and the forward kernel were two launches
around the agreement; the forward reads only this rank's own tensors, so it may run before the ranks agree
(a rank that failed its checks does not run it). int64 offsets; the temperature as vocab_fwd_triton reads it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.vocab_block import VOCAB_BLOCK
from .digest_triton import _row_body
from .vocab_fwd_triton import _finalize, _row_stats
from .vocab_jit import LOG2E, _store_token
from .vocab_status import _tau_at, _token, _uncounted
from .vp_merge_triton import _live_max


@triton.jit(do_not_specialize=["T", "logits_start", "n_tok_f", "temp_stride", "n_seq", "n0", "s0", "p0", "o0", "n1",
                               "s1", "p1", "o1", "n2", "s2", "p2", "o2", "n3", "s3", "p3", "o3", "n4", "s4", "p4", "o4",
                               "n5", "s5", "p5", "o5", "n6", "s6", "p6", "o6", "n7", "s7", "p7", "o7", "n_tok", "T_tok",
                               "o_tok", "n_cu", "n_fields", "raw0", "key"])
def _vp_first_kernel(logits_ptr, mask_ptr, logp_ptr, ent_ptr, stats_ptr, bad_ptr, max_ptr, stride_lb, stride_lt,
                     T, V, logits_start, n_tok_f, temp_ptr, temp_stride, seq_cu_ptr, n_seq,
                     row_ptr, x0, w0, n0, s0, p0, o0, x1, w1, n1, s1, p1, o1, x2, w2, n2, s2, p2, o2,
                     x3, w3, n3, s3, p3, o3, x4, w4, n4, s4, p4, o4, x5, w5, n5, s5, p5, o5,
                     x6, w6, n6, s6, p6, o6, x7, w7, n7, s7, p7, o7,
                     ids_ptr, counted_ptr, n_tok, T_tok, o_tok, cu_ptr, n_cu, n_fields, raw0, key,
                     F0: tl.constexpr, F1: tl.constexpr, F2: tl.constexpr, F3: tl.constexpr, F4: tl.constexpr,
                     F5: tl.constexpr, F6: tl.constexpr, F7: tl.constexpr, N_TERMS: tl.constexpr,
                     TOKENS: tl.constexpr, ROW_MASK: tl.constexpr, CHECKS: tl.constexpr, HEAD: tl.constexpr,
                     BLOCK: tl.constexpr,
                     BLOCK_V: tl.constexpr, HAS_MASK: tl.constexpr, TEMP_BY_VALUE: tl.constexpr,
                     TEMP_PER_SEQ: tl.constexpr, VOCAB_BLOCK: tl.constexpr):
    """Program 0: _row_body's (the row's arguments as digest_triton.row_launches makes them; first, so that its
    loop over the tokens overlaps the others); programs 1 .. n_tok_f: token p - 1's, vocab_fwd_triton.
    _vocab_fwd_kernel's (mask as given, tau by value or read per token / per completion (TEMP_PER_SEQ 1 padded,
    2 packed: seq_cu_ptr), VP_MAX) with no target (its flags BAD_ID, its logp NaN: the sums kernel reads the
    target)."""
    pid = tl.program_id(0).to(tl.int64) - 1  # (the token; -1: the row)
    if pid < 0:
        _row_body(row_ptr, x0, w0, n0, s0, p0, o0, x1, w1, n1, s1, p1, o1, x2, w2, n2, s2, p2, o2,
                  x3, w3, n3, s3, p3, o3, x4, w4, n4, s4, p4, o4, x5, w5, n5, s5, p5, o5,
                  x6, w6, n6, s6, p6, o6, x7, w7, n7, s7, p7, o7,
                  ids_ptr, counted_ptr, n_tok, T_tok, o_tok, cu_ptr, n_cu, n_fields, raw0, key, F0, F1, F2, F3,
                  F4, F5, F6, F7, N_TERMS, TOKENS, ROW_MASK, CHECKS, HEAD, BLOCK)
    else:
        inv_temp, counted = _token(_tau_at(pid, pid, T, seq_cu_ptr, n_seq, TEMP_PER_SEQ), temp_ptr, temp_stride, pid,
                                   mask_ptr, TEMP_BY_VALUE, HAS_MASK)
        logp, ent, m, log_s, q, bad = _uncounted()
        if counted:
            i = pid // T
            row = logits_ptr + i * stride_lb + (pid - i * T + logits_start) * stride_lt
            m_r, r_r, u_r = _row_stats(row, V, 1.0, 1.0, 1.0, inv_temp * LOG2E, inv_temp, 0.0, 0, 0, stats_ptr, pid,
                                       1, False, False, BLOCK_V, VOCAB_BLOCK, False, False)
            logp, ent, m, log_s, q, bad = _finalize(m_r, r_r, u_r, float("nan"), pid < 0, inv_temp)
        _store_token(logp_ptr, ent_ptr, stats_ptr, bad_ptr, pid, logp, ent, m, log_s, q, bad)
        tl.store(max_ptr + pid, _live_max(m, log_s, ent, bad, V))


ROW_BLOCK = 256


def vp_first(logits3, counted, temperature, logits_start, local_max, row, row_launch, tau_seq=0, cu=None):
    """The slice's (logp (NaN: no target), H, stats, flags) per token and its row maxima into `local_max` (n,),
    and the agreement's `row` formed by `row_launch` (agree.row_to_fold's), in one launch. logits3 (B, T_l, V)
    raw (no transform); counted: the caller's mask as given, or None; temperature: a float (by value) or a
    float32 tensor per token, or per completion with tau_seq 1 (padded) / 2 (packed, `cu` its cu_seqlens)."""
    from .vocab_triton import _per_seq, fwd_block_v, num_warps_for, temperature_arg
    B, _, V = logits3.shape
    n = local_max.numel()
    dev = logits3.device
    outs = (torch.empty(n, device=dev, dtype=torch.float32), torch.empty(n, device=dev, dtype=torch.float32),
            torch.empty((n, 3), device=dev, dtype=torch.float32), torch.empty(n, device=dev, dtype=torch.int8))
    seq = _per_seq(tau_seq, cu, temperature)
    tau, tau_stride = temperature_arg(temperature, dev, seq.get("tau_len", n))
    args, meta = row_launch
    # (the row's loops over ROW_BLOCK elements, not digest_triton.BLOCK: the sums and checks are the same, and the
    # kernel's registers stay the forward kernel's, 64 where BLOCK's 1024 made them 128 for every program, sm_90)
    meta = {**{k: v for k, v in meta.items() if k != "HAS_MASK"}, "ROW_MASK": meta["HAS_MASK"], "BLOCK": ROW_BLOCK}
    bv = fwd_block_v(V)
    _vp_first_kernel[(n + 1,)](logits3, counted if counted is not None else local_max, *outs, local_max,
                               logits3.stride(0), logits3.stride(1), n // B if B else 0, V, logits_start, n, tau,
                               tau_stride, seq.get("cu_ptr", local_max), seq.get("n_seq", 0), row, *args, **meta,
                               BLOCK_V=bv, num_warps=num_warps_for(bv), HAS_MASK=counted is not None,
                               TEMP_BY_VALUE=isinstance(tau, float), TEMP_PER_SEQ=seq.get("TEMP_PER_SEQ", 0),
                               VOCAB_BLOCK=VOCAB_BLOCK)
    return outs
