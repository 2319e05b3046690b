"""The sampler's recorded kept sets (spec 13) checked on the device, unvalidated, in two launches: what
core.sampling.check_sampling_mask_flat(validate=False) forms with some fifty small ops (its twin in tests).

    _flat_offsets_kernel  (one program) each flat token's offsets into the kept ids, as the logits path forms
                          them (logps_triton._flat_offsets; an uncounted token's set is empty), and whether
                          the recorded offsets are malformed (not non-decreasing from 0 to len(token_ids)) or
                          not one set per counted token: then every set is empty and every token invalid
    _set_problems_kernel  (a program per flat token) a counted token whose set holds an id outside [0, V),
                          repeats an id or lacks its sampled id is invalid; CLAMP: the set's ids written
                          with an id outside [0, V) as 0 (the LM head's union reads only its weight's rows)

    flat, invalid, kept = flat_set_checks(token_ids, offsets, ids, counted, V, clamp)

No host read: the outputs stay on the device, an invalid token's outputs are the caller's to make NaN.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .logps_triton import BLOCK, DUP_BLOCK, _flat_offsets, _repeats


@triton.jit(do_not_specialize=["N", "M_rec", "K"])
def _flat_offsets_kernel(mask_ptr, off_ptr, flat_out, bad_out, N, M_rec, K, BLOCK: tl.constexpr):
    """flat_out (N + 1,): flat token j's set starts at the recorded offset of the counted tokens before it
    (0 everywhere when bad); bad_out (1,) int32: the offsets are malformed or not M + 1."""
    _, bad, _ = _flat_offsets(mask_ptr, off_ptr, flat_out, N, M_rec, K, True, BLOCK)
    tl.store(bad_out, bad)


@triton.jit(do_not_specialize=["V"])
def _set_problems_kernel(mask_ptr, flat_ptr, kept_ptr, y_ptr, bad_ptr, invalid_out, kept_out, V,
                         CLAMP: tl.constexpr, DUP_BLOCK: tl.constexpr):
    """Flat token `tok`: invalid_out[tok] = the offsets are bad, or it counts and its set holds an id outside
    [0, V), repeats one or lacks y; CLAMP: its set's ids into kept_out, an id outside [0, V) as 0."""
    tok = tl.program_id(0).to(tl.int64)
    m = tl.load(mask_ptr + tok) != 0
    start = tl.load(flat_ptr + tok)
    end = tl.load(flat_ptr + tok + 1)
    y = tl.load(y_ptr + tok).to(tl.int64)
    lanes = tl.arange(0, DUP_BLOCK).to(tl.int64)
    problem = tl.zeros((), tl.int32)
    hit = tl.zeros((), tl.int32)
    for a0 in range(start, end, DUP_BLOCK):
        ka = a0 + lanes
        ina = ka < end
        va = tl.load(kept_ptr + ka, mask=ina, other=0).to(tl.int64)
        outside = (va < 0) | (va >= V)
        problem = problem | tl.max((ina & outside).to(tl.int32), axis=0)
        hit = hit | tl.max((ina & (va == y)).to(tl.int32), axis=0)
        if CLAMP:
            tl.store(kept_out + ka, tl.where(outside, 0, va), mask=ina)
    problem = problem | _repeats(kept_ptr, start, end, DUP_BLOCK)
    invalid = (tl.load(bad_ptr) != 0) | (m & ((problem != 0) | (hit == 0)))
    tl.store(invalid_out + tok, invalid)


def flat_set_checks(token_ids, offsets, ids, counted, V, clamp):
    """(flat offsets (n + 1,) int64, invalid (n,) bool, kept ids (K,) int64) of the recorded sets
    `token_ids`, `offsets` (M + 1,) of the counted tokens (counted (n,) bool, their sampled ids (n,)):
    core.sampling.check_sampling_mask_flat(validate=False)'s, but malformed offsets give every token an empty
    set (and make it invalid); clamp: the kept ids with an id outside [0, V) as 0, else token_ids itself."""
    n, K, dev = counted.numel(), token_ids.numel(), counted.device
    flat = torch.empty(n + 1, dtype=torch.int64, device=dev)
    bad = torch.empty(1, dtype=torch.int32, device=dev)
    invalid = torch.empty(n, dtype=torch.bool, device=dev)
    kept = torch.empty_like(token_ids) if clamp else token_ids
    counted = counted.reshape(-1)
    _flat_offsets_kernel[(1,)](counted, offsets, flat, bad, n, offsets.numel() - 1, K, BLOCK=BLOCK, num_warps=4)
    if n:
        _set_problems_kernel[(n,)](counted, flat, token_ids if K else flat, ids.reshape(-1), bad, invalid, kept, V,
                                   CLAMP=bool(clamp and K), DUP_BLOCK=DUP_BLOCK)
    return flat, invalid, kept
