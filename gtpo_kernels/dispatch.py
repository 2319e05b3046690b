"""Which implementation runs the vocabulary passes: Triton kernels or the chunked PyTorch path."""
from __future__ import annotations

import os

BACKENDS = ("auto", "triton", "torch", "reference")


def resolve_backend(backend, device):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
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
    return type(vocab_triton._logprob_fwd_kernel).__name__ == "InterpretedFunction"


def _impl(backend):
    if backend == "triton":
        from . import vocab_triton as impl
    else:
        from . import vocab_torch as impl
    return impl


# temperature: a number, or a 0-d tensor read here (a CPU tensor: no device sync)

def logprob_fwd(backend, logits3, ids, counted, temperature, logits_start):
    return _impl(backend).logprob_fwd(logits3, ids, counted, float(temperature), logits_start)


def logprob_bwd(backend, logits3, grad3, ids, stats, ent, c, e, temperature, logits_start):
    return _impl(backend).logprob_bwd(logits3, grad3, ids, stats, ent, c, e, float(temperature), logits_start)
