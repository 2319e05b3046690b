"""Which implementation runs each pass: the Triton kernels or the PyTorch path.

    vocab_fwd / vocab_bwd   vocab_triton (CUDA, or the interpreter) | vocab_torch (chunked rows)
                            (both apply the tile's transforms, scale and softcap, to the raw logits)
    raw_conflicts           conflict_triton                         | conflict_torch (sort-based)
"""
from __future__ import annotations

import math
import os

import torch

BACKENDS = ("auto", "triton", "torch", "reference")


def resolve_backend(backend, device, dtype=None):
    """'auto' -> 'triton' on CUDA, 'torch' elsewhere (and for float64 logits, which the Triton kernels
    do not accumulate in float64). Refuses what cannot run: an unknown name, 'triton' with float64
    logits, 'triton' on CPU tensors without Triton's interpreter."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and dtype != torch.float64 else "torch"
    if backend == "triton" and dtype == torch.float64:
        raise TypeError("backend='triton' accumulates in float32 and does not take float64 logits: use "
                        "backend='torch' (float64 accumulation) or 'auto', or cast the logits")
    if backend == "triton" and device.type == "cpu" and not interpreter_active():
        raise RuntimeError(
            "backend='triton' on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 in the "
            "environment before triton is first imported (or use backend='torch' on the CPU)")
    return backend


def triton_runs_on(device) -> bool:
    """Whether Triton kernels run on `device`: a GPU, or the CPU under Triton's interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and interpreter_active())


def interpreter_active() -> bool:
    """True when our kernels were built by Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return False
    from . import vocab_triton
    return vocab_triton.interpreted()


def _resolved(backend, logits3):
    """'auto' (the custom ops' default) as resolve_backend chooses it; a resolved name as it is."""
    return resolve_backend(backend, logits3.device, logits3.dtype) if backend == "auto" else backend


def _vocab_impl(backend):
    if backend == "triton":
        from . import vocab_triton as impl
    else:
        from . import vocab_torch as impl
    return impl


def _temperature(backend, temperature):
    """The Triton kernels read tau from device memory (a tensor is passed through, never read here);
    the torch path takes a number (a one-element CPU tensor is read without a device sync), a device
    tensor, or a per-token (n,) tensor."""
    if backend == "triton" or not isinstance(temperature, torch.Tensor) or temperature.device.type != "cpu" \
            or temperature.numel() != 1:
        return temperature  # per token (n,): read by row
    return float(temperature)


def check_transforms(scale, softcap):
    """The tile's transforms as the kernels take them (spec 11): scale a finite number, softcap None or
    a finite number > 0. Python numbers: no device read."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale (logit_scale) must be a finite Python number, got {scale!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"softcap (logit_softcap) must be None or a finite number > 0, got {softcap!r}")


def vocab_fwd(backend, logits3, ids, counted, temperature, logits_start, scale=1.0, softcap=None, id_start=0,
              local_max=None, tau_seq=0, cu=None):
    """Per token (logp, H, stats, flags) of z' = softcap * tanh(z * scale / softcap) (or z * scale). id_start:
    the vocabulary entry of logits3's column 0 (a slice of the vocabulary): each target is ids - id_start.
    local_max: (n,) float32 the Triton kernel writes the slice's maximum into (vp_merge.local_max's values).
    tau_seq 1 (Triton, padded) or 2 (packed, cu: its cu_seqlens): temperature holds one tau per completion."""
    check_transforms(scale, softcap)
    backend = _resolved(backend, logits3)
    if (local_max is not None or tau_seq) and backend != "triton":
        raise ValueError("the slice's maximum stored by the forward pass, and a tau per completion read at each "
                         "token's row, are the Triton backend's")
    return _vocab_impl(backend).vocab_fwd(logits3, ids, counted, _temperature(backend, temperature), logits_start,
                                          scale, softcap, id_start=id_start,
                                          **({} if local_max is None else dict(local_max=local_max)),
                                          **({} if not tau_seq else dict(tau_seq=tau_seq, cu=cu)))


def vocab_blocks(backend, logits3, ids, counted, temperature, logits_start, V_whole, scale=1.0, softcap=None,
                 id_start=0):
    """A vocabulary slice's per-block statistics for the block merge (spec 14): (blocks (n, NB, 3), z'_y (n,),
    non-finite (n,) bool: the torch path's; the Triton kernel's flags come from the merged statistics).
    V_whole: the whole vocabulary's size (the Triton kernel's block is chosen from it, as on one process)."""
    check_transforms(scale, softcap)
    backend = _resolved(backend, logits3)
    if backend == "triton":
        from . import vocab_triton
        blocks, zy = vocab_triton.vocab_blocks(logits3, ids, counted, _temperature(backend, temperature),
                                               logits_start, V_whole, scale, softcap, id_start)
        return blocks, zy, torch.zeros(zy.shape, dtype=torch.bool, device=zy.device)
    from . import vocab_torch
    return vocab_torch.vocab_blocks(logits3, ids, counted, _temperature(backend, temperature), logits_start,
                                    scale, softcap, id_start)


def vocab_merge(backend, blocks, z_y, nonfinite, ids, counted, temperature, V_whole, state=None, fold=False):
    """Blocks (n, NB, 3) of consecutive ranks in global block order -> (logp, H, stats, flags) by the
    single-process pass's own merge and finish; state: (n, 3) row statistics the earlier blocks were
    folded into (None: the empty row); fold: the folded (n, 3) statistics instead (the next rank's state)."""
    if backend == "triton":
        from . import vocab_triton
        return vocab_triton.vocab_merge(blocks, z_y, ids, counted, _temperature(backend, temperature), V_whole,
                                        state=state, fold=fold)
    from . import vocab_torch
    return vocab_torch.vocab_merge(blocks, z_y, nonfinite, ids, counted, _temperature(backend, temperature),
                                   V_whole, state=state, fold=fold)


def scale_by(coef, g):
    """coef * g, and exactly 0 where coef is 0 (an uncounted token: an inf or NaN upstream gradient
    there is ignored, never 0 * inf = NaN); None stays None."""
    return None if coef is None else torch.where(coef == 0, torch.zeros_like(coef), coef * g)


def vocab_bwd(backend, logits3, grad3, ids, stats, ent, c, e, temperature, logits_start, scale=1.0, softcap=None,
              g=None, keep=None, id_start=0, tau_seq=0, cu=None):
    """dL/dz of the raw logits into grad3 (stats from vocab_fwd with the same scale and softcap). An
    empty vocabulary (a rank's empty slice, spec 12) has no entry to write. g: the upstream gradient
    (one element, or one per token) that c and e are multiplied by (the Triton kernel reads it itself).
    keep: each token's kept set as (t_s, t_id) (the Triton kernel's only)."""
    check_transforms(scale, softcap)
    if logits3.shape[-1] == 0:
        return grad3
    backend = _resolved(backend, logits3)
    if g is not None and backend != "triton":  # the torch path takes c and e already multiplied
        g = g.to(c.dtype)
        c, e, g = scale_by(c, g), scale_by(e, g), None
    if (keep is not None or tau_seq) and backend != "triton":
        raise ValueError("kept sets as thresholds, and a temperature per completion, are the Triton backend's")
    return _vocab_impl(backend).vocab_bwd(logits3, grad3, ids, stats, ent, c, e, _temperature(backend, temperature),
                                          logits_start, scale, softcap, id_start=id_start,
                                          **({} if g is None else dict(g=g)), **({} if keep is None else dict(keep=keep)),
                                          **({} if not tau_seq else dict(tau_seq=tau_seq, cu=cu)))


def raw_conflicts(backend, ids, m, pos, neg, group_size):
    if backend == "triton":
        from .conflict_triton import raw_conflicts as impl
    else:
        from .conflict_torch import raw_conflicts as impl
    return impl(ids, m, pos, neg, group_size)
