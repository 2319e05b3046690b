"""The counter behind bench.head_accounting: a TorchDispatchMode that sees every torch op of a call and
tallies tile passes, host syncs, allocations over the budget, V x D allocations, GEMM FLOPs, the rows of
D-wide tensors (weight, hidden, their gradients) gathered and scattered by index, and the tile loop's own
per-tile work (the definitions are in measure.py's docstring), with the vocabulary kernels' own work
suspended (`counting(counter, kernels)`). `peak_bytes` measures the allocator's high-water mark of a call
(the profiler's allocation events)."""
from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter as Tally

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique2", "aten.unique_dim",
            "aten.unique_consecutive", "aten.bincount", "aten.is_nonzero", "aten.equal", "aten.histc"}
INDEX_OPS = {"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"}
NO_PASS = {"aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
           "aten.lift_fresh", "aten.detach", "aten.alias"}  # besides views: ops that touch no element
GATHER = {"aten.index_select", "aten.index", "aten.gather"}  # rows read by index: counted when the output is D wide
SCATTER = {"aten.index_add", "aten.index_add_", "aten.index_copy", "aten.index_copy_", "aten.index_put",
           "aten.index_put_", "aten._index_put_impl_"}  # rows written by index into a D-wide tensor
SPARSE = {"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_", "aten.gather", "aten.scatter",
          "aten.scatter_", "aten.index_select", "aten.select"}  # touch only the indexed elements of their 1st argument
PROVIDERS = ("fused", "recompute", "trl", "liger")
TRL_TOKEN_CHUNK = 4096  # trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE
LIGER_TILE = (2048, 4096)  # liger_kernel's _SELECTIVE_LOGPROB_SEQ_CHUNK_SIZE, _VOCAB_CHUNK_SIZE
G = 4  # completions per group (the conflict weights, computed once per batch as a trainer does)


@dataclasses.dataclass
class Geometry:
    """What the counter calls a tile, an N-sized tensor, the weight and hidden."""
    V: int
    D: int
    widths: tuple  # vocabulary columns of a tile (the last one may be narrower)
    tile_elems: int
    budget: int  # bytes
    tok_shape: tuple  # (B, T)
    n_counted: int
    pinned: tuple = ()  # storage pointers of hidden and weight (views of them are never tiles)
    shapes: tuple = ()  # (rows, columns) of tiles whose width varies (the replay head's unions)

    def is_tile(self, t):
        s = tuple(t.shape)
        if not s or s[-1] == self.D or _ptr(t) in self.pinned:
            return False
        if len(s) >= 2 and (s[-2:] in self.shapes or s[-2:][::-1] in self.shapes):
            return True
        return t.numel() >= self.tile_elems or (len(s) >= 2 and any(w in s[-2:] for w in self.widths))

    def is_n(self, t):
        s = tuple(t.shape)
        n = self.tok_shape[0] * self.tok_shape[1]
        return bool(s) and s[-1] != self.D and (n in s or self.n_counted in s or s[:2] == self.tok_shape)


def _ptr(t):
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - sparse or meta tensors have no storage
        return None


def _python_impl(func):
    """The Python body of a torch.library.custom_op (None for aten ops and other registrations)."""
    if func.namespace in ("aten", "prims", "prim"):
        return None
    from torch._library import custom_ops
    opdef = getattr(custom_ops, "OPDEFS", {}).get(f"{func.namespace}::{func._opname}")
    return getattr(opdef, "_init_fn", None)


def gemm_flops(name, args):
    """2 M N K of one GEMM (aten.mm / addmm / bmm / baddbmm / mv / addmv, and aten.matmul of two matrices, which
    a custom op's body, running below autograd, meets before it decomposes into mm), else 0."""
    name = name.rstrip("_")
    if name in ("aten.addmm", "aten.baddbmm", "aten.addmv"):
        args = args[1:]
    if name == "aten.matmul" and args[0].dim() == 2 and args[1].dim() == 2:
        name = "aten.mm"
    if name in ("aten.mm", "aten.addmm"):
        (m, k), n = args[0].shape, args[1].shape[1]
        return 2 * m * n * k
    if name in ("aten.bmm", "aten.baddbmm"):
        (b, m, k), n = args[0].shape, args[1].shape[2]
        return 2 * b * m * n * k
    if name in ("aten.mv", "aten.addmv"):
        return 2 * args[0].numel()
    return 0


def is_sync(name, args, kwargs):
    if name in SYNC_OPS:
        return True
    if name in INDEX_OPS:  # a boolean mask as an index is a nonzero on the device
        idx = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx or ())
    if name == "aten.repeat_interleave":
        return kwargs.get("output_size") is None and (len(args) < 3 or args[-1] is None)
    return False


class HeadCounter(TorchDispatchMode):
    """Counts the torch ops of one call (see the module's docstring); `phase` tags forward / backward."""

    def __init__(self, geo: Geometry):
        super().__init__()
        self.geo, self.phase, self.suspended = geo, "forward", 0
        self.events = []  # (phase, kind) in order: kind in proj, n_alloc, n_op, sync
        self.by_op, self.by_size, self.syncs = Tally(), Tally(), Tally()
        self.reads = self.writes = self.flops_fwd = self.flops_bwd = 0
        self.over_budget, self.over_share, self.vd_allocs, self.largest = [], 0, 0, 0
        self.kernel_calls = self.kernel_ops = 0
        self.custom_ops = Tally()
        self.rows_gathered, self.rows_scattered = Tally(), Tally()  # phase -> rows of D-wide tensors

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        impl = None if self.suspended else _python_impl(func)
        if impl is not None:  # a torch.library.custom_op: count what its Python body runs
            self.custom_ops[name] += 1
            with self:
                return impl(*args, **kwargs)
        out = func(*args, **kwargs)
        if self.suspended:
            self.kernel_ops += 1
            return out
        ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not (func.is_view or name in NO_PASS):
            self._tiles(name, args, ins, outs)
        self._allocs(name, ins, outs)
        if is_sync(name, args, kwargs):
            self.sync(name)
        self._rows(name, args, outs)
        flops = gemm_flops(name, args)
        if flops:
            self.flops_fwd += flops if self.phase == "forward" else 0
            self.flops_bwd += flops if self.phase == "backward" else 0
            if any(self.geo.is_tile(t) for t in outs):
                self.events.append((self.phase, "proj"))
        if any(self.geo.is_n(t) for t in ins + outs):
            self.events.append((self.phase, "n_op"))
        return out

    def sync(self, name):
        self.syncs[name] += 1
        self.events.append((self.phase, "sync"))

    def _rows(self, name, args, outs):
        """Rows of D-wide tensors moved by index: W[U] and hidden's rows read, dW[U] and dh's rows written."""
        D = self.geo.D
        if name in GATHER:
            self.rows_gathered[self.phase] += sum(t.numel() // D for t in outs if t.dim() >= 2 and t.shape[-1] == D)
        elif name in SCATTER and args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2 \
                and args[0].shape[-1] == D:
            src = args[-1] if isinstance(args[-1], torch.Tensor) else None
            self.rows_scattered[self.phase] += 0 if src is None else src.numel() // D

    def _tiles(self, name, args, ins, outs):
        if name in SPARSE and args and isinstance(args[0], torch.Tensor):  # its first argument is not swept
            ins, outs = ins[1:], [t for t in outs if _ptr(t) != _ptr(args[0])]
        r = [t for t in ins if self.geo.is_tile(t)]
        w = [t for t in outs if self.geo.is_tile(t)]
        if r or w:
            self.reads, self.writes = self.reads + len(r), self.writes + len(w)
            self.by_op[name] += 1
            self.by_size["x".join(map(str, max(r + w, key=torch.Tensor.numel).shape))] += 1

    def _allocs(self, name, ins, outs):
        seen = {_ptr(t) for t in ins}
        geo = self.geo
        for t in outs:
            if _ptr(t) in seen or t.untyped_storage().nbytes() == 0:
                continue  # a view or an in-place result
            nbytes = t.untyped_storage().nbytes()
            seen.add(_ptr(t))
            self.largest = max(self.largest, nbytes)
            self.vd_allocs += t.dim() == 2 and t.numel() == geo.V * geo.D
            if t.dim() and t.shape[-1] == geo.D:
                continue  # the weight, hidden, their gradients: the inputs' and outputs' sizes, not the budget's
            if nbytes > geo.budget:
                self.over_budget.append(f"{name} {'x'.join(map(str, t.shape))} {nbytes} B")
            self.over_share += nbytes > geo.budget // 2
            if geo.is_n(t) and not geo.is_tile(t):
                self.events.append((self.phase, "n_alloc"))

    def per_tile(self, phase, kind):
        """Events of `kind` between the first and last projection of `phase`, per tile in between."""
        ev = [k for p, k in self.events if p == phase]
        proj = [i for i, k in enumerate(ev) if k == "proj"]
        if len(proj) < 2:
            return None
        return round(sum(k == kind for k in ev[proj[0]:proj[-1]]) / (len(proj) - 1), 2)

    def summary(self):
        return dict(
            projections=sum(k == "proj" for _, k in self.events), tile_passes=sum(self.by_op.values()),
            tile_reads=self.reads, tile_writes=self.writes,
            tile_passes_by_op=dict(self.by_op), tile_passes_by_size=dict(self.by_size),
            host_syncs=sum(self.syncs.values()), host_syncs_by_op=dict(self.syncs),
            host_syncs_per_tile={p: self.per_tile(p, "sync") for p in ("forward", "backward")},
            allocs_over_budget=len(self.over_budget), allocs_over_budget_list=self.over_budget[:8],
            allocs_over_half_budget=self.over_share, largest_alloc_bytes=self.largest, vd_allocs=self.vd_allocs,
            gemm_flops=self.flops_fwd + self.flops_bwd, gemm_flops_forward=self.flops_fwd,
            gemm_flops_backward=self.flops_bwd,
            n_allocs_per_tile={p: self.per_tile(p, "n_alloc") for p in ("forward", "backward")},
            n_ops_per_tile={p: self.per_tile(p, "n_op") for p in ("forward", "backward")},
            kernel_calls=self.kernel_calls, kernel_ops_excluded=self.kernel_ops, custom_ops=dict(self.custom_ops),
            rows_gathered={p: self.rows_gathered[p] for p in ("forward", "backward")},
            rows_scattered={p: self.rows_scattered[p] for p in ("forward", "backward")})


@contextlib.contextmanager
def counting(counter, kernels=()):
    """The counter active, with each (module, name) in `kernels` suspending it while it runs, and
    Tensor.tolist counted as a host sync (it reads CPU tensors without a torch op)."""
    def suspend(fn):
        def wrapped(*a, **k):
            counter.kernel_calls += 1
            counter.suspended += 1
            try:
                return fn(*a, **k)
            finally:
                counter.suspended -= 1
        return wrapped

    tolist, own = torch.Tensor.tolist, torch.Tensor.__dict__.get("tolist")

    def counted_tolist(self):
        if not counter.suspended:
            counter.sync("Tensor.tolist")
        return tolist(self)

    saved = [(m, n, getattr(m, n)) for m, n in kernels]
    try:
        for m, n, fn in saved:
            setattr(m, n, suspend(fn))
        torch.Tensor.tolist = counted_tolist
        with counter:
            yield counter
    finally:
        if own is None:
            del torch.Tensor.tolist  # back to TensorBase's
        else:
            torch.Tensor.tolist = own
        for m, n, fn in saved:
            setattr(m, n, fn)


def count_call(run, wrt, geo, kernels=()):
    """Counts of `loss = run()` then torch.autograd.grad(loss, wrt), as HeadCounter.summary()."""
    counter = HeadCounter(geo)
    with counting(counter, kernels):
        loss = run()
        counter.phase = "backward"
        torch.autograd.grad(loss, wrt)
    return counter.summary()


def peak_bytes(run, wrt):
    """The CPU allocator's high-water mark over `loss = run()` then torch.autograd.grad(loss, wrt), above
    what was allocated before (the gradients it returns included): the running total of the profiler's
    allocation events. -> (peak, bytes still allocated at the end, the returned gradients' bytes)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    def walk(nodes):
        for n in nodes:
            yield n
            yield from walk(n.children)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        grads = torch.autograd.grad(run(), wrt)
    sizes = sorted((n.start_time_ns, n.extra_fields.alloc_size)
                   for n in walk(prof.profiler.kineto_results.experimental_event_tree())
                   if n.tag == _EventType.Allocation and str(n.extra_fields.device) == "cpu")
    now = peak = 0
    for _, b in sizes:
        now += b
        peak = max(peak, now)
    return peak, now, sum(g.numel() * g.element_size() for g in grads)


def our_kernels():
    from gtpo_kernels.kernels import dispatch
    return [(dispatch, n) for n in dir(dispatch) if n.startswith("vocab_") and callable(getattr(dispatch, n))]
