"""The kept sets of the rules (spec 13) listed on the Triton backend, for the rows of one tile of logits (the LM
head's forward): kept_set.kept_sets's outputs from kept_rule_triton's thresholds in two launches, where the
torch rebuild sorts each block with some seventy small ops.

    t_s, t_id, kst = kept_thresholds(tile, ...)      each row's set as a threshold, its size |K| and metrics
    offsets = 0, cumsum(|K|)                         (one host read: the sets' total size)
    _kept_ids_kernel                                 each row's kept ids, ascending, at its offset, and whether
                                                     the row holds NaN or +inf

A row keeps v when s_v > t_s, or s_v == t_s and v >= t_id (s_v = z'_v / tau finite), or v = y: the test the
threshold kernel counts |K| with, so each row writes exactly its |K| ids. A cut that lands within a rounding of
1 - top_p may differ from the torch rebuild's sort (kept_rule_triton's docstring); the sampled token is
restored either way.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kept_rule_triton import _by_rule, kept_thresholds
from .vocab_status import _token
from .vocab_jit import _MAX, _SUM
from .vocab_torch import _transform
from .vocab_triton import block_v_for, temperature_arg


@triton.jit(do_not_specialize=["V", "stride_z", "temp_stride"])
def _kept_ids_kernel(z_ptr, stride_z, y_ptr, ts_ptr, tid_ptr, temp_ptr, temp_stride, off_ptr, ids_out, nf_out, V,
                     TEMP_BY_VALUE: tl.constexpr, BLOCK_V: tl.constexpr):
    """Row r of z (the transformed logits): its kept ids written ascending from ids_out + off[r]; nf_out[r]: the
    row holds NaN or +inf (of s = z / tau)."""
    r = tl.program_id(0).to(tl.int64)
    inv_temp, _ = _token(r, temp_ptr, temp_stride, r, z_ptr, TEMP_BY_VALUE, False)
    row = z_ptr + r * stride_z
    t_s = tl.load(ts_ptr + r)
    t_id = tl.load(tid_ptr + r)
    y = tl.load(y_ptr + r).to(tl.int64)
    at = tl.load(off_ptr + r)
    lanes = tl.arange(0, BLOCK_V)
    nf = tl.full((), 0, tl.int32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + lanes
        inb = offs < V
        s = tl.load(row + offs, mask=inb, other=float("-inf")).to(tl.float32) * inv_temp
        inside = inb & (_by_rule(s, offs, t_s, t_id) | (offs == y))  # (the count's test: exactly |K| ids)
        nf = tl.maximum(nf, tl.reduce((inb & ((s != s) | (s == float("inf")))).to(tl.int32), 0, _MAX))
        k = inside.to(tl.int64)
        tl.store(ids_out + at + tl.cumsum(k, 0) - 1, offs.to(tl.int64), mask=inside)
        at += tl.reduce(k, 0, _SUM)
    tl.store(nf_out + r, nf != 0)


def kept_sets_tile(z, y, tau, top_k=None, top_p=None, min_p=None, scale=1.0, softcap=None):
    """kept_set.kept_sets's (token_ids, offsets, restored, nonfinite, kept_mass) for the rows of a tile z (n, V)
    of raw 16- or 32-bit logits (row r: the token with sampled id y[r]); tau and the rules numbers or (n,)
    tensors (None: off). One host read (the sets' total size)."""
    n, V = z.shape
    dev = z.device
    zt = z.detach() if scale == 1.0 and softcap is None else _transform(  # (in place: on a copy)
        z.detach().to(torch.float32, copy=True), scale, softcap)
    zt = zt.contiguous()
    tau = float(tau) if not isinstance(tau, torch.Tensor) else tau
    y = y.long()  # (as kept_sets: an id outside the vocabulary is no column of the set, nor restored)
    # (an invalid rule value: its threshold as found, so that the count and the listing agree; the caller's
    # flags make that token NaN, as with the torch rebuild)
    t_s, t_id, kst = kept_thresholds(zt.unsqueeze(0), y, None, tau, 0, top_k, top_p, min_p, nan_bad=False)
    counts = kst[:, 0].long()
    offsets = torch.zeros(n + 1, dtype=torch.long, device=dev)
    torch.cumsum(counts, 0, out=offsets[1:])
    ids = torch.zeros(int(offsets[-1]), dtype=torch.long, device=dev)  # sync: the sets' total size (zeros: a
    # row whose listing fell short would still index the weight in bounds)
    nonfinite = torch.empty(n, dtype=torch.bool, device=dev)
    if n:
        t, t_stride = temperature_arg(tau, dev, n)
        _kept_ids_kernel[(n,)](zt, zt.stride(0), y, t_s, t_id, t, t_stride, offsets, ids, nonfinite, V,
                               TEMP_BY_VALUE=isinstance(t, float), BLOCK_V=block_v_for(V), num_warps=4)
    return ids, offsets, kst[:, 1] > 0, nonfinite, kst[:, 2]
