"""The hot path never waits for the host: what one call converts from host data does not grow with its
tiles (spec 11: the O(N) work of a call does not grow with its number of tiles; no host-to-device copy
on the hot path).

A TorchDispatchMode sees every torch op of a forward + backward with backend='triton' (the kernels
under Triton's interpreter; the launches themselves are not counted: on a GPU they copy nothing) and
counts the conversions that would cross from the host to the device on a GPU: a `to` / `_to_copy` /
`copy_` that makes new data (on CUDA: from a CPU tensor to the device), and tensors made from Python
data (`lift_fresh`, what torch.tensor(...) runs). The count at 16 tiles must equal the one at 4 tiles,
for the logits path (16 completions against 4) and both head schedules; and every kernel launch of a
call reads the temperature from one device tensor, made once for the call.
"""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gtpo_kernels import gtpo_loss, linear_gtpo_loss
from gtpo_kernels.kernels import vocab_triton
from gtpo_kernels.pipeline.head import row_bytes

CONVERSIONS = {"to", "_to_copy", "copy_", "copy"}
CREATIONS = {"lift_fresh", "lift_fresh_copy"}


def _python_body(func):
    """The Python body of a torch.library.custom_op (the head's and the passes'), or None."""
    if func.namespace in ("aten", "prims", "prim"):
        return None
    from torch._library import custom_ops
    return getattr(custom_ops.OPDEFS.get(f"{func.namespace}::{func._opname}"), "_init_fn", None)


def _names_device(args, kwargs):
    """Whether an op is told a device (`to(device=...)` arrives with it among its arguments)."""
    return kwargs.get("device") is not None or any(isinstance(a, torch.device) for a in args)


class HostConversions(TorchDispatchMode):
    """Counts, per op name, the conversions of host data a call makes (see the module docstring).

    On a CPU-only run every tensor is on the host, so host data is followed by provenance: a tensor made
    from Python data (lift_fresh, scalar_tensor) is host data, and so is what an op makes from host data
    alone. A conversion crosses to the device when it moves host data with an explicit device (`to` /
    `_to_copy` with `device=`) or copies it into a tensor that is not host data (`copy_`); on CUDA, also
    any conversion from a CPU tensor to the GPU."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.suspended = 0
        self.host = {}  # storage address -> a tensor holding host data (kept alive: the address stays its own)

    @staticmethod
    def _key(t):
        return t.untyped_storage().data_ptr() if t.numel() else None

    def _is_host(self, t):
        return self._key(t) in self.host

    def _mark(self, out):
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.numel():
                self.host[self._key(t)] = t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        body = _python_body(func)
        if body is not None:  # a custom op: count what its body runs
            with self:
                return body(*args, **kwargs)
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if self.suspended:
            return out
        if name in CREATIONS:
            self.counts[name] += 1
            self._mark(out)
        elif name in CONVERSIONS and self._crosses(name, args, kwargs, out):
            self.counts[name] += 1
        elif name == "scalar_tensor" or (tensors and not _names_device(args, kwargs)
                                         and all(map(self._is_host, tensors))
                                         and not (name in ("copy_", "copy") and not self._is_host(args[0]))):
            self._mark(out)
        return out

    def _crosses(self, name, args, kwargs, out):
        copy = name in ("copy_", "copy")
        src, dst = (args[1], args[0]) if copy else (args[0], out)
        if not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor) or dst is src:
            return False
        if src.device.type == "cpu" and dst.device.type != "cpu":
            return True
        return self._is_host(src) and (not self._is_host(dst) if copy else _names_device(args, kwargs))

    def total(self):
        return sum(self.counts.values())


class _Launch:
    """A kernel whose launches run outside the count (the interpreter's own copies are not the hot
    path's) and record the temperature tensor each one reads."""

    def __init__(self, kernel, mode, taus):
        self.kernel, self.mode, self.taus = kernel, mode, taus
        self.at = kernel.arg_names.index("temp_ptr")

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            tau = args[self.at]  # a tensor, or a Python float passed by value (TEMP_BY_VALUE: nothing in memory)
            self.taus.append((tau.data_ptr(), tau.device.type, tau.dtype) if isinstance(tau, torch.Tensor)
                             else ("value", float(tau)))
            self.mode.suspended += 1
            try:
                return launch(*args, **kwargs)
            finally:
                self.mode.suspended -= 1
        return run


def _count(monkeypatch, call):
    """(conversions by op, distinct temperature tensors read, launches) of one forward + backward."""
    mode, taus = HostConversions(), []
    monkeypatch.setattr(vocab_triton, "interpreted", lambda: True)  # the wrapped kernels are still interpreted
    for name in ("_vocab_fwd_kernel", "_vocab_bwd_kernel"):
        monkeypatch.setattr(vocab_triton, name, _Launch(getattr(vocab_triton, name), mode, taus))
    with mode:
        call()
    monkeypatch.undo()
    return dict(mode.counts), len(set(taus)), len(taus)


def _head_call(tiles, schedule):
    g = torch.Generator().manual_seed(0)
    B, T, D, V = 8, 4, 8, 32
    h = torch.randn(B, T, D, generator=g, requires_grad=True)
    w = torch.randn(V, D, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, generator=g)
    budget = (B * T // tiles) * row_bytes(V, torch.float32, h.device)

    def call():
        out = linear_gtpo_loss(h, w, ids, adv, group_size=2, config="grpo", validate=False, backend="triton",
                               memory_budget=budget, schedule=schedule)
        out.loss.backward()
        assert float(out.metrics["grad_in_forward"]) == (1.0 if schedule == "fused" else 0.0)
    return call


def _logits_call(B):
    g = torch.Generator().manual_seed(1)
    T, V = 3, 32
    x = torch.randn(B, T, V, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, generator=g)

    def call():
        gtpo_loss(x, ids, adv, group_size=2, config="grpo", validate=False, backend="triton").loss.backward()
    return call


@pytest.mark.parametrize("path", ["logits", "fused", "recompute"])
def test_host_conversions_do_not_grow_with_tiles(monkeypatch, path):
    runs = {}
    for n in (4, 16):  # tiles of the head; completions of the logits path (one launch a pass either way)
        runs[n] = _count(monkeypatch, _logits_call(n) if path == "logits" else _head_call(n, path))
    (c4, taus4, launches4), (c16, taus16, launches16) = runs[4], runs[16]
    assert launches16 > launches4 if path != "logits" else launches16 == launches4
    print(f"{path}: host conversions per call at 4 / 16: {sum(c4.values())} / {sum(c16.values())} {c16}; "
          f"kernel launches {launches4} / {launches16}")
    assert c16 == c4, f"{path}: conversions of host data grow with the tiles: 4 -> {c4}, 16 -> {c16}"
    moved = {k: v for k, v in c16.items() if k in CONVERSIONS}
    assert not moved, f"{path}: host data moved to the device during the call: {moved}"
    assert taus4 == taus16 == 1, f"{path}: the launches read {taus4} / {taus16} temperature tensors, not one per call"


class _Ops(TorchDispatchMode):
    """The aten ops a call runs (custom ops' bodies included), by name."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        body = _python_body(func)
        if body is not None:
            with self:
                return body(*args, **kwargs)
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("schedule", ["fused", "recompute"])
def test_gradient_rows_written_in_place(schedule):
    """Every token counted: each tile's dL/dh rows are consecutive and written by the GEMM itself
    (mm(out=)), no temporary copied in (index_copy_); with masked-out tokens the rows are gathered and
    copied. The gradient is the same either way (a mask of ones against no mask)."""
    g = torch.Generator().manual_seed(2)
    B, T, D, V = 4, 6, 8, 32
    h, w = torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g)
    ids, adv = torch.randint(0, V, (B, T), generator=g), torch.randn(B, generator=g)
    budget = 5 * row_bytes(V, torch.float32, h.device)  # 5 rows a tile
    grads, copies = [], []
    for mask in (None, torch.ones(B, T, dtype=torch.bool), torch.arange(T)[None].expand(B, T) < 5):
        hh = h.clone().requires_grad_()
        mode = _Ops()
        with mode:
            out = linear_gtpo_loss(hh, w, ids, adv, mask, group_size=2, config="grpo", memory_budget=budget,
                                   schedule=schedule, backend="torch")
            out.loss.backward()
        grads.append(hh.grad)
        copies.append(mode.counts["index_copy_"])
    assert copies[0] == copies[1] == 0 and copies[2] > 0, copies
    assert torch.equal(grads[0], grads[1])
