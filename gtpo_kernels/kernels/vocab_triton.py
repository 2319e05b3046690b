"""The Triton vocabulary passes: their launchers, block sizes, and the kernels' names.

    vocab_fwd_triton._vocab_fwd_kernel   per counted token: logp, entropy, stats (m, log S, 1 - p_y), flags
    vocab_bwd_triton._vocab_bwd_kernel   per logits row: dL/dz written into the gradient (or over the logits)
    vocab_jit                            what both share: constants, log1p, the tile's transforms

The kernels are read here by name at launch (`_vocab_fwd_kernel`, `_vocab_bwd_kernel`, `MAX_BLOCK_V`,
`num_warps_for`: bench and tests replace them), and the layout is the one of vocab_fwd_triton's docstring.
The tile's transforms (spec 11): the kernels read the raw z and apply z' = z * scale, then
z' = softcap * tanh(z' / softcap), in registers; the statistics refer to z', the gradient to z.
"""
from __future__ import annotations

import torch
import triton

from .vocab_bwd_triton import _vocab_bwd_kernel
from ..core.vocab_block import VOCAB_BLOCK, n_blocks
from .vocab_fwd_triton import _vocab_fwd_kernel
from .vocab_merge_triton import _vocab_merge_kernel

__all__ = ["MAX_BLOCK_V", "block_v_for", "fwd_block_v", "num_warps_for", "interpreted", "temperature_arg",
           "vocab_fwd", "vocab_blocks", "vocab_merge", "vocab_bwd", "_vocab_fwd_kernel", "_vocab_merge_kernel",
           "_vocab_bwd_kernel"]

# Largest block over the vocabulary, and the warps of a block: the choice of the static model of
# `python -m bench.aot.tune` for all three kernels (bf16, sm_90, V = 151936: memory-bound by the roofline,
# 1.5x the bytes in flight Little's law asks at an H200's bandwidth, then the highest occupancy, then the
# smallest block): 2048 x 4 warps, 16 elements a thread per iteration. Not yet a GPU measurement:
# `bench/gpu_check.sh` times the candidate set on a GPU and records it.
MAX_BLOCK_V = 2048


def block_v_for(V: int) -> int:
    return min(MAX_BLOCK_V, triton.next_power_of_2(max(int(V), 16)))


def fwd_block_v(V: int) -> int:
    """The forward kernel's block for a vocabulary of V entries (the whole one, under a split): at most
    VOCAB_BLOCK, so that the vocabulary blocks are whole numbers of kernel blocks and every rank of a
    split reads its blocks with the very lanes of the single-process kernel."""
    return min(block_v_for(V), VOCAB_BLOCK)


def num_warps_for(block_v: int) -> int:
    return 4


def _transforms(scale, softcap):
    """The kernels' runtime (scale, softcap) floats and their compile-time switches (HAS_SCALE,
    HAS_SOFTCAP): scale == 1 and no soft-cap compile the plain kernel."""
    scale = float(scale)
    cap = 1.0 if softcap is None else float(softcap)
    return scale, cap, dict(HAS_SCALE=scale != 1.0, HAS_SOFTCAP=softcap is not None)


def interpreted() -> bool:
    """True when these kernels were built by Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return type(_vocab_fwd_kernel).__name__ == "InterpretedFunction"


def temperature_arg(temperature, device, n):
    """(tau, stride): what the kernels read the temperature through, tau of token k at tau[k * stride].
    A float32 tensor on `device` with one element (stride 0: one tau for every row) or one per token
    (`n`, its own stride; or one per completion, n of them, read at a token's completion) is passed as it is: the pipeline makes it once per call
    (ops.temperature_param), and a trainer's schedule updated in place is seen by a replayed CUDA graph.
    Anything else (a number, a tensor elsewhere or of another dtype) is converted here, for direct
    callers of the launchers: on a GPU a tensor from the host is then a host-to-device copy per launch,
    which the hot path never makes. Never a device-to-host read."""
    if isinstance(temperature, float):  # by value: a launch argument, nothing in memory
        return temperature, 0
    if isinstance(temperature, torch.Tensor) and temperature.device == device and temperature.dtype == torch.float32:
        tau = temperature
    elif isinstance(temperature, torch.Tensor):
        tau = temperature.detach().to(device=device, dtype=torch.float32)
    else:
        tau = torch.full((1,), float(temperature), dtype=torch.float32, device=device)
    if tau.numel() == 1:
        return tau.reshape(1), 0
    if tau.dim() != 1 or tau.numel() != n:
        raise ValueError(f"temperature: one value, or one per token ({n}), got shape {tuple(tau.shape)}")
    return tau, tau.stride(0)


def vocab_fwd(logits3, ids, counted, temperature, logits_start, scale=1.0, softcap=None, outs=None,
              nan_flagged=False, rows=None, keep=None, local_max=None, id_start=0, tau_seq=0, cu=None,
              out_at_row=False):
    """logits3 (B, T_l, V) with stride(2) == 1, the raw z; ids (B*T,) int; counted (B*T,) bool.
    Returns float32 logp, entropy (B*T,), stats (B*T, 3) = (row max m, log S, q = 1 - p_y) for the
    backward, and int8 flags (0 = fine), all of the transformed z' (scale, softcap: see vocab_jit).
    counted may be None (every token counts) or the caller's mask of any dtype (nonzero counts);
    temperature a Python float (passed by value) or a tensor (temperature_arg); outs: the four outputs,
    allocated by the caller; nan_flagged: a flagged token's logp and H are NaN. rows: (n_rows,) int64, the
    token of each row of logits3 = (1, n_rows, V) (the LM head's tile): only those tokens are written.
    keep: (t_s, t_id) (n,), each token's kept set (kept_rule_triton): the statistics over it. local_max: (n,)
    float32, written with the slice's row maximum for the vocabulary-parallel merge (vp_merge.local_max).
    id_start: the vocabulary entry of logits3's column 0 (a slice): each target is ids - id_start. tau_seq:
    temperature holds one tau per completion, read at the token's (1: padded) or found in cu (2: packed).
    out_at_row: with rows, the outputs and local_max are the tile's own (n_rows,): row p's at p."""
    B, T_l, V = logits3.shape
    n = ids.numel()
    T = n // B if B else 0
    dev = logits3.device
    if outs is None:
        k = rows.numel() if out_at_row else n
        outs = (torch.empty(k, device=dev, dtype=torch.float32), torch.empty(k, device=dev, dtype=torch.float32),
                torch.empty((k, 3), device=dev, dtype=torch.float32), torch.empty(k, device=dev, dtype=torch.int8))
    logp, ent, stats, bad = outs
    if n == 0 or (rows is not None and rows.numel() == 0):
        return logp, ent, stats, bad
    meta = {} if rows is None else dict(rows_ptr=rows, ROWS=True, OUT_AT_ROW=bool(out_at_row))
    if keep is not None:
        meta.update(keep_s_ptr=keep[0], keep_id_ptr=keep[1], KEEP=True)
    if local_max is not None:
        meta.update(max_ptr=local_max, VP_MAX=True)
    if id_start:
        meta["id_start"] = id_start
    meta.update(_per_seq(tau_seq, cu, temperature, rows))
    _launch(logits3, ids, counted, (logp, ent, stats, bad), T if rows is None else T_l, V, logits_start, temperature,
            scale, softcap, fwd_block_v(V), grid=n if rows is None else rows.numel(), NAN_FLAGGED=nan_flagged, **meta)
    return logp, ent, stats, bad


def _launch(logits3, ids, counted, outs, T, V, logits_start, temperature, scale, softcap, bv, grid=None,
            tau_len=None, **meta):
    """_vocab_fwd_kernel over the n tokens (or `grid` rows), one program each, writing `outs` (logp, H,
    stats, flags pointers); bv: its block of entries; tau_len: a tensor temperature's length when not n
    (one per completion: meta's TEMP_PER_SEQ); meta: its other switches."""
    n = ids.numel()
    scale, cap, has = _transforms(scale, softcap)
    tau, tau_stride = temperature_arg(temperature, logits3.device, n if tau_len is None else tau_len)
    _vocab_fwd_kernel[(n if grid is None else grid,)](
        logits3, ids, ids if counted is None else counted, *outs, logits3.stride(0), logits3.stride(1),
        T, V, logits_start, tau, tau_stride, scale, cap,
        **has, BLOCK_V=bv, num_warps=num_warps_for(bv), HAS_MASK=counted is not None,
        TEMP_BY_VALUE=isinstance(tau, float), VOCAB_BLOCK=VOCAB_BLOCK, **meta,
    )


def _per_seq(tau_seq, cu, temperature, rows=None):
    """The kernels' switches for a temperature per completion (tau_seq 1 padded, 2 packed: cu_seqlens)."""
    if not tau_seq:
        return {}
    if rows is not None or (tau_seq == 2) != (cu is not None):
        raise ValueError("a temperature per completion: padded (tau_seq 1), or packed with cu_seqlens (2), no rows")
    return dict(TEMP_PER_SEQ=tau_seq, tau_len=temperature.numel(),
                **({} if cu is None else dict(cu_ptr=cu.reshape(-1).contiguous(), n_seq=cu.numel() - 1)))
    # (the kernels read cu_seqlens at stride 1: a strided view of it is copied)


def vocab_blocks(logits3, ids, counted, temperature, logits_start, V_whole, scale=1.0, softcap=None, id_start=0):
    """The per-block statistics of a vocabulary slice (spec 14): float32 (n, n_blocks(V), 3), block b
    = entries [b VOCAB_BLOCK, (b + 1) VOCAB_BLOCK) of the slice, (m_b, r_b, u_b) as _vocab_fwd_kernel folds
    them; and the transformed target logit z'_y (n,) where the (local) id lies in the slice, NaN elsewhere.
    V_whole: the whole vocabulary's size, which sets the kernel's block as on one process. Uncounted
    tokens' entries are left unset."""
    B, T_l, V = logits3.shape
    n = ids.numel()
    T = n // B if B else 0
    dev = logits3.device
    nb = n_blocks(V)
    blocks = torch.empty((n, nb, 3), device=dev, dtype=torch.float32)
    zy = torch.zeros(n, device=dev, dtype=torch.float32)
    if n == 0 or nb == 0:
        return blocks, zy.fill_(float("nan"))
    _launch(logits3, ids, counted, (zy, zy, blocks, zy), T, V, logits_start, temperature, scale, softcap,
            fwd_block_v(V_whole), BLOCKS_OUT=True, NB=nb, id_start=id_start)
    return blocks, zy


def vocab_merge(blocks, zy, ids, counted, temperature, V_whole, nan_flagged=False, state=None, fold=False):
    """The vocabulary-parallel merge: blocks (n, NB, 3) of consecutive ranks in global block order and the
    owner's z'_y (n,) -> logp, entropy, stats (m, log S, q), flags as vocab_fwd returns them for the whole
    vocabulary, by the very merge and finish of the single-process kernel. ids: global ids. state: (n, 3)
    float32 row statistics the earlier blocks folded into (None: the empty row); fold: only fold the
    blocks into them and return the statistics (a new (n, 3) tensor, `state` left as it is)."""
    n, nb = blocks.shape[0], blocks.shape[1]
    dev = blocks.device
    out = torch.empty((n, 3), device=dev, dtype=torch.float32) if fold else None
    if fold and state is not None:
        out.copy_(state)
    logp, ent = torch.empty(n, device=dev, dtype=torch.float32), torch.empty(n, device=dev, dtype=torch.float32)
    stats, bad = torch.empty((n, 3), device=dev, dtype=torch.float32), torch.empty(n, device=dev, dtype=torch.int8)
    if n == 0:
        return out if fold else (logp, ent, stats, bad)
    tau, tau_stride = temperature_arg(temperature, dev, n)
    _vocab_merge_kernel[(n,)](
        blocks.contiguous(), zy.contiguous(), ids, ids if counted is None else counted, logp, ent, stats, bad,
        nb, V_whole, tau, tau_stride, out if fold else state, HAS_MASK=counted is not None,
        TEMP_BY_VALUE=isinstance(tau, float), NAN_FLAGGED=nan_flagged, HAS_INIT=state is not None, FOLD=fold,
        num_warps=1,
    )
    return out if fold else (logp, ent, stats, bad)


def vocab_bwd(logits3, grad3, ids, stats, ent, c, e, temperature, logits_start, scale=1.0, softcap=None, g=None,
              rows=None, id_start=0, keep=None, tau_seq=0, cu=None):
    """Writes dL/dz of the raw logits into grad3 (B, T_l, V), every row (zeros where no gradient);
    grad3 may be logits3 itself. c, e: float32 (B*T,) coefficients; e may be None (no entropy term);
    stats from vocab_fwd with the same scale and softcap. g: the loss's upstream gradient (float32, one
    element, or one per token), read by the kernel, which multiplies c and e by it; None: c and e are
    already multiplied. rows: (n_rows,) int64, the token of each row of logits3 = (1, n_rows, V) (the LM
    head's tile): the per-token tensors are read there. id_start: the vocabulary entry of logits3's column 0
    (a block of the vocabulary: the target is written where ids - id_start lies in [0, V)). keep: vocab_fwd's
    (t_s, t_id): the gradient exactly 0 outside each token's kept set. tau_seq, cu: as vocab_fwd's."""
    B, T_l, V = logits3.shape
    n = ids.numel()
    T = n // B if B else 0
    if rows is not None:
        T = T_l
    if B * T_l == 0:
        return grad3
    bv = block_v_for(V)
    scale, cap, has = _transforms(scale, softcap)
    seq = _per_seq(tau_seq, cu, temperature, rows)
    tau, tau_stride = temperature_arg(temperature, logits3.device, seq.pop("tau_len", n))
    _vocab_bwd_kernel[(B * T_l,)](
        logits3, grad3, ids, stats, ent, c, c if e is None else e,
        logits3.stride(0), logits3.stride(1), grad3.stride(0), grad3.stride(1),
        T, T_l, V, logits_start, tau, tau_stride, scale, cap,
        HAS_E=e is not None, **has, BLOCK_V=bv, num_warps=num_warps_for(bv), TEMP_BY_VALUE=isinstance(tau, float),
        HAS_G=g is not None, g_ptr=c if g is None else g, g_stride=0 if g is None or g.numel() == 1 else g.stride(0),
        **({} if rows is None else dict(rows_ptr=rows, ROWS=True)), id_start=int(id_start),
        **({} if keep is None else dict(keep_s_ptr=keep[0], keep_id_ptr=keep[1], KEEP=True)), **seq,
    )
    return grad3

