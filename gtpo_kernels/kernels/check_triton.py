"""The host checks' device predicates in one launch each (core.checks: check_finite, check_ids_in_range),
where Triton runs on the tensor's device: whether any (selected) value is not finite, or any (selected) id
lies outside [0, V), into a one-element bool, read with the call's other checks (checks.one_host_read).
torch forms the same predicate with six or seven small ops; it still does where Triton does not run.
Importing this module registers it with core.checks (kernels/__init__ does)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core import checks

BLOCK = 2048


@triton.jit(do_not_specialize=["n", "V"])
def _any_outside_kernel(x_ptr, where_ptr, out_ptr, n, V, IDS: tl.constexpr, HAS_WHERE: tl.constexpr,
                        BLOCK: tl.constexpr):
    """out[0] = any x[i] (where[i]) not finite, or IDS: outside [0, V) (one program, int64 offsets)."""
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    acc = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n, BLOCK):
        o = start + lanes
        inb = o < n
        if IDS:
            x = tl.load(x_ptr + o, mask=inb, other=0).to(tl.int64)
            bad = (x < 0) | (x >= V)
        else:
            x = tl.load(x_ptr + o, mask=inb, other=0.0)  # in its own dtype: a large float64 stays finite
            bad = (tl.abs(x) < float("inf")) == 0  # (NaN too)
        if HAS_WHERE:
            inb = inb & (tl.load(where_ptr + o, mask=inb, other=0) != 0)
        acc = acc | (inb & bad).to(tl.int32)
    tl.store(out_ptr, tl.max(acc, axis=0) != 0)


def any_outside(x, where=None, V=None):
    """0-d bool on x's device: any value of x (where `where`) not finite, or (V given) outside [0, V); None
    where Triton does not run on x's device (the caller forms it with torch)."""
    from . import dispatch
    dev = x.device
    if not dispatch.triton_runs_on(dev) or (where is not None and where.device != dev):
        return None
    flat = x.detach().reshape(-1).contiguous()  # (a view's reshape keeps its strides: the kernel reads stride 1)
    out = torch.empty(1, dtype=torch.bool, device=dev)
    _any_outside_kernel[(1,)](flat, flat if where is None else where.reshape(-1).contiguous(), out, flat.numel(),
                              0 if V is None else V, IDS=V is not None, HAS_WHERE=where is not None,
                              BLOCK=BLOCK)
    return out.reshape(())


checks.DEVICE_ANY = any_outside
