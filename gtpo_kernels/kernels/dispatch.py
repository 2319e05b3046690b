"""Which implementation runs each pass: the Triton kernels or the PyTorch path.

    vocab_fwd / vocab_bwd   vocab_triton (CUDA, or the interpreter) | vocab_torch (chunked rows)
    raw_conflicts           conflict_triton                         | conflict_torch (sort-based)
"""
from __future__ import annotations

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


def interpreter_active() -> bool:
    """True when our kernels were built by Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return False
    from . import vocab_triton
    return vocab_triton.interpreted()


def _vocab_impl(backend):
    if backend == "triton":
        from . import vocab_triton as impl
    else:
        from . import vocab_torch as impl
    return impl


def _temperature(backend, temperature):
    """The Triton kernels read tau from device memory (a tensor is passed through, never read here);
    the torch path takes a number (a CPU tensor is read without a device sync) or a device tensor."""
    if backend == "triton" or not isinstance(temperature, torch.Tensor) or temperature.device.type != "cpu":
        return temperature
    return float(temperature)


def vocab_fwd(backend, logits3, ids, counted, temperature, logits_start):
    return _vocab_impl(backend).vocab_fwd(logits3, ids, counted, _temperature(backend, temperature), logits_start)


def vocab_bwd(backend, logits3, grad3, ids, stats, ent, c, e, temperature, logits_start):
    return _vocab_impl(backend).vocab_bwd(logits3, grad3, ids, stats, ent, c, e, _temperature(backend, temperature),
                                          logits_start)


def raw_conflicts(backend, ids, m, pos, neg, group_size):
    if backend == "triton":
        from .conflict_triton import raw_conflicts as impl
    else:
        from .conflict_torch import raw_conflicts as impl
    return impl(ids, m, pos, neg, group_size)
