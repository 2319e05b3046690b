"""Bytes each Triton kernel moves, counted in Triton's interpreter (the device-free measure).

A memory-bound kernel is as fast as the bytes it moves allow. Running the kernels in Triton's
interpreter (TRITON_INTERPRET=1, CPU tensors) we hook its masked loads and stores (every `tl.load` and
`tl.store` goes through them) and count every masked-in lane at its element size. Each launch names its
tensor arguments (`logits_ptr`, `grad_ptr`, ...); a lane is attributed to an argument when its address
falls in that tensor's storage. The ratio to spec section 8's ideal is then exact and independent of any
GPU:

    forward read   N  * V * e      (N counted tokens; masked-out rows are never read)
    backward read  Ng * V * e      (Ng counted tokens that carry a gradient; Ng = N unless a token's
                                    coefficient is 0: filtered completion, lambda = 0)
    backward write B * T_l * V * e (every row of the gradient, zeros included)

What the count does not see: caches (a lane read twice costs twice here, maybe once on a GPU) and
sectors (a lane is counted at its size, not at the 32-byte sector it pulls in). The self-test runs a toy
kernel that reads its input twice.

    python -m bench.timing.traffic --tokens 128 --vocab 5000     # JSON on stdout (sets TRITON_INTERPRET=1)
"""
from __future__ import annotations

import collections
import inspect
import json
import os
import sys

import numpy as np
import torch

from ..common.record import ROOT


def _interp():
    """Triton's interpreter module; the caller must have set TRITON_INTERPRET=1 before importing triton."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise RuntimeError("the traffic counter needs TRITON_INTERPRET=1 set before triton is imported")
    from triton.runtime import interpreter
    return interpreter


def _storage_range(t: torch.Tensor):
    st = t.untyped_storage()
    return st.data_ptr(), st.data_ptr() + st.nbytes()


class TrafficCounter:
    """Context manager: counts bytes read and written by the given interpreted kernels.

    `bytes[(kernel_name, arg_name, "read" | "write")]`: bytes of masked-in lanes whose address lies in
    the storage of tensor argument `arg_name` of the launch that issued them."""

    def __init__(self, *kernels):
        self.kernels = kernels
        self.bytes = collections.Counter()
        self._regions = []  # [(arg_name, lo, hi)] of the current launch
        self._kernel = None

    def _on_launch(self, kernel):
        sig = inspect.signature(kernel.fn)

        def hook(*args, **kwargs):
            bound = sig.bind_partial(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
            self._kernel = kernel.fn.__name__
            self._regions = [(name, *_storage_range(v)) for name, v in bound.arguments.items()
                             if isinstance(v, torch.Tensor)]
        return hook

    def _count(self, kind, ptrs, mask):
        addr = np.asarray(ptrs.data)
        m = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)
        addr = np.broadcast_to(addr, m.shape)[m].astype(np.uint64)
        if addr.size == 0:
            return
        size = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        hit = np.zeros(addr.shape, dtype=bool)
        for name, lo, hi in self._regions:
            inside = (addr >= lo) & (addr < hi)
            n = int(inside.sum())
            if n:
                self.bytes[(self._kernel, name, kind)] += n * size
            hit |= inside
        rest = int((~hit).sum())
        if rest:
            self.bytes[(self._kernel, "<other>", kind)] += rest * size

    def __enter__(self):
        interp = _interp()
        b = interp.interpreter_builder
        load, store = b.create_masked_load, b.create_masked_store

        def masked_load(ptrs, mask, other, *a, **k):
            self._count("read", ptrs, mask)
            return load(ptrs, mask, other, *a, **k)

        def masked_store(ptrs, value, mask, *a, **k):
            self._count("write", ptrs, mask)
            return store(ptrs, value, mask, *a, **k)

        b.create_masked_load, b.create_masked_store = masked_load, masked_store  # instance attributes
        self._hooks = []
        for kern in self.kernels:
            h = self._on_launch(kern)
            kern.add_pre_run_hook(h)
            self._hooks.append((kern, h))
        return self

    def __exit__(self, *exc):
        b = _interp().interpreter_builder
        del b.create_masked_load, b.create_masked_store  # back to the class's methods
        for kern, h in self._hooks:
            kern.pre_run_hooks.remove(h)
        return False

    def get(self, kernel, arg, kind) -> int:
        return self.bytes[(kernel, arg, kind)]


# ---- self-test: a toy kernel that reads its input twice ------------------------------------------

def _toy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def toy_read_twice(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        a = tl.load(x_ptr + offs, mask=offs < n)
        b = tl.load(x_ptr + offs, mask=offs < n)  # the same bytes again
        tl.store(y_ptr + offs, a + b, mask=offs < n)
    return toy_read_twice


def self_test(n=1000, block=256):
    """Counts the toy kernel: x read twice (2 n e bytes), y written once (n e). Returns a dict with the
    counts and `ok`. n is not a multiple of the block, so the masked tail is exercised."""
    _interp()
    kern = _toy_kernel()
    x = torch.randn(n)
    y = torch.empty(n + 7)  # larger storage: lanes beyond n must not be counted
    with TrafficCounter(kern) as c:
        kern[(triton_cdiv(n, block),)](x, y, n, BLOCK=block)
    read, write = c.get("toy_read_twice", "x_ptr", "read"), c.get("toy_read_twice", "y_ptr", "write")
    ok = (read == 2 * n * 4 and write == n * 4 and torch.equal(y[:n], x + x)
          and c.get("toy_read_twice", "<other>", "read") == 0)
    return dict(read_ratio=read / (n * 4), write_ratio=write / (n * 4), ok=ok)


def triton_cdiv(a, b):
    return (a + b - 1) // b


# ---- our kernels ----------------------------------------------------------------------------------

def measure_ours(inp, cfg, keep=None):
    """Runs gtpo_loss(backend='triton') forward and backward on `inp` (CPU tensors) under the counter.
    Returns the three ratios to the ideal of spec section 8, with the raw byte counts. `keep`, a dict,
    receives the outputs ((loss, logps, entropy) and the gradient) for a correctness check."""
    from gtpo_kernels import gtpo_loss
    from gtpo_kernels.kernels import vocab_triton as vt

    e = inp.logits.element_size()
    B, T_l, V = inp.logits.shape
    with TrafficCounter(vt._vocab_fwd_kernel) as fwd:
        out = gtpo_loss(inp.logits, inp.ids, inp.adv, inp.mask, lam=inp.lam, n_conf=inp.n_conf, config=cfg,
                        logits_start=0, backend="triton")
    with TrafficCounter(vt._vocab_bwd_kernel) as bwd:
        grad, = torch.autograd.grad(out.loss, inp.logits)
    if keep is not None:
        keep.update(result=(out.loss, out.logps, out.entropy), grad=grad)
    # tokens that carry a gradient: nonzero somewhere in their row
    n_grad = int((grad[:, :inp.T] != 0).any(-1).logical_and(inp.mask).sum())
    N = inp.counted
    ideal = dict(fwd_read=N * V * e, bwd_read=n_grad * V * e, bwd_write=B * T_l * V * e)
    got = dict(fwd_read=fwd.get("_vocab_fwd_kernel", "logits_ptr", "read"),
               bwd_read=bwd.get("_vocab_bwd_kernel", "logits_ptr", "read"),
               bwd_write=bwd.get("_vocab_bwd_kernel", "grad_ptr", "write"))
    other = dict(fwd_write_logits=fwd.get("_vocab_fwd_kernel", "logits_ptr", "write"),
                 bwd_read_grad=bwd.get("_vocab_bwd_kernel", "grad_ptr", "read"))
    ratios = {k: (got[k] / ideal[k] if ideal[k] else float("nan")) for k in ideal}
    return dict(ratios=ratios, bytes=got, ideal=ideal, stray=other, counted_tokens=N, grad_tokens=n_grad,
                shape=[B, T_l, V], dtype=str(inp.logits.dtype).replace("torch.", ""))


def run(tokens, V, dtype, preset, seed=0, keep=None):
    """Self-test, then our kernels on the benchmark's inputs at this size. `keep`: see measure_ours
    (it also receives the inputs)."""
    from gtpo_kernels import GTPOConfig
    from .inputs import make_inputs
    cfg = GTPOConfig.preset(preset)
    inp = make_inputs(tokens, V, dtype=dtype, device="cpu", seed=seed, config=cfg)
    res = measure_ours(inp, cfg, keep)
    if keep is not None:
        keep["inputs"] = inp
    res.update(tokens=tokens, V=V, preset=preset, self_test=self_test())
    return res


def run_in_subprocess(tokens, V, dtype, preset, seed=0, timeout=600):
    """The same in a child process with the interpreter on (when this process runs Triton natively)."""
    import subprocess
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "bench.timing.traffic", "--tokens", str(tokens), "--vocab", str(V), "--dtype",
           str(dtype).replace("torch.", ""), "--preset", preset, "--seed", str(seed)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                       cwd=ROOT)
    if p.returncode:
        raise RuntimeError(f"traffic child failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=5000)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--preset", default="gtpo")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(json.dumps(run(a.tokens, a.vocab, getattr(torch, a.dtype), a.preset, a.seed)))


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    main()
