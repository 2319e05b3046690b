"""The fused LM head's math (spec 11): the logits of a tile of hidden rows, their chain rule, and the
frozen options one call runs with.

    z_raw = hidden @ weight.T + bias            (the GEMM, bias added by addmm)
    z     = softcap * tanh(z_raw * scale / softcap)   (softcap optional), then / temperature

The vocabulary kernels take `scale` and `softcap` and apply them to the values they load, in the
forward and in the chain rule of the backward (which writes dL/dz_raw over the tile): the tile is then
only touched by the GEMMs, on one process and vocabulary-parallel alike.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import NamedTuple, Optional

import torch

from ..core.layout import float_dtype_for
from ..core.vocab_block import VOCAB_BLOCK

DEFAULT_MEMORY_BUDGET = 1 << 30  # bytes for one tile of logits and its gradient
INVARIANT_ROWS = 64  # batch_invariant=True: the rows of every projection GEMM (a fixed shape, spec 14)


class Head(NamedTuple):
    """The LM head's parameters and transforms, as the public call checked them."""
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    scale: float
    cap: Optional[float]
    proj: Optional[torch.dtype] = None  # head_dtype: the projection's dtype when not the inputs' (float32)
    invariant: bool = False  # batch_invariant: fixed-shape projection GEMMs


def project_dtype(weight, proj):
    """The dtype a tile's logits are projected in: the inputs' dtype, or float32 with head_dtype=float32
    (spec 14: 16-bit hidden and weight upcast, a float32 GEMM)."""
    return weight.dtype if proj is None else proj


def upcast(x, proj):
    """x in the projection's dtype (a copy only where head_dtype asks for another one)."""
    return x if x is None or proj is None or x.dtype == proj else x.to(proj)


def head_dtype_arg(head_dtype, hidden):
    """head_dtype as the head takes it: None, or float32 for 16-bit inputs (float32 inputs: None already)."""
    if head_dtype is None:
        return None
    if head_dtype is not torch.float32:
        raise ValueError(f"head_dtype must be None (the inputs' dtype) or torch.float32, got {head_dtype!r}")
    if hidden.dtype == torch.float64:
        raise ValueError("head_dtype=torch.float32 would round float64 hidden and weight: leave it None (float64 "
                         "inputs are projected in float64)")
    return None if hidden.dtype == torch.float32 else torch.float32


def refuse_invariant(head, backend, rules, group):
    """batch_invariant=True where the fixed-shape projection does not reach yet: refused, not ignored. (A
    process group is taken: its slice boundaries are checked after the agreement, api/linear._vocab_parallel.)"""
    if not head.invariant:
        return
    if rules is not None:
        raise ValueError("batch_invariant=True with kept sets (sampling_mask, top_k, top_p, min_p) is not supported "
                         "yet: a tile's union of kept sets sets the projection's width; drop batch_invariant")
    if backend == "reference":
        raise ValueError("batch_invariant=True applies to the 'triton' and 'torch' backends (the reference "
                         "materializes the logits in one GEMM)")


@dataclasses.dataclass(frozen=True)
class HeadOptions:
    """Everything one call of the head runs with that is not a tensor (the custom ops take it by key).

    cfg       the GTPOConfig (None: log-probs and entropies only)
    per_tile  counted rows in one tile (the budget over the bytes of a row of logits and its gradient)
    fused     form the gradient in the forward (3 GEMMs a tile) or recompute it in the backward (4)
    B         completions; vp: (process group, whole vocabulary's size, every rank's slice size under
              batch_invariant (the block merge, spec 14) or None) when vocabulary-parallel, or None
    proj      head_dtype: None (the inputs' dtype) or torch.float32
    invariant batch_invariant: project in GEMMs of INVARIANT_ROWS rows
    """
    cfg: object
    backend: str
    scale: float
    softcap: Optional[float]
    per_tile: int
    fused: bool
    B: int
    vp: object = None
    proj: object = None
    invariant: bool = False


_KEYS: dict = {}
_OPTIONS: dict = {}
_COUNTER = itertools.count()


def _assume_constant_result(fn):
    """torch.compiler.assume_constant_result without its `import torch._dynamo` (3 of the 6 s that
    `import gtpo_kernels` took): torch's decorator only sets this marker, which dynamo reads when it
    traces; tests/test_layers.py checks that the two mark a function alike."""
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def options_key(cfg, backend, scale, softcap, per_tile, fused, B, vp, proj=None, invariant=False) -> str:
    """The key the head's custom ops take for their options (a string: custom ops take no Python
    objects). torch.compile calls it once while tracing and bakes the key into the graph; a tensor in
    the config is then read live by the ops. Equal options (tensors by identity) share a key."""
    ident = None if cfg is None else tuple(
        id(v) if isinstance(v, torch.Tensor) else v for v in (getattr(cfg, f.name) for f in dataclasses.fields(cfg)))
    sig = (ident, backend, float(scale), softcap, int(per_tile), bool(fused), int(B),
           None if vp is None else (id(vp[0]), *vp[1:]), proj, bool(invariant))
    key = _KEYS.get(sig)
    if key is None:
        key = _KEYS[sig] = f"head{next(_COUNTER)}"
        _OPTIONS[key] = HeadOptions(cfg, backend, float(scale), softcap, int(per_tile), bool(fused), int(B), vp, proj,
                                    bool(invariant))
    return key


def options(key: str) -> HeadOptions:
    return _OPTIONS[key]


def row_bytes(V, dtype, device):
    """Bytes one counted row takes in a tile: its logits and their gradient, plus a float32 copy of the
    gradient row where the weight-gradient GEMM cannot accumulate a 16-bit product in float32 here."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * V * elem + (4 * V if elem < 4 and not mixed_gemm(device) else 0)


def rows_per_tile(V, dtype, device, memory_budget):
    per_row = row_bytes(V, dtype, device)
    if memory_budget < per_row:
        raise ValueError(f"memory_budget = {memory_budget} bytes holds no row of logits and its gradient: "
                         f"one row takes {per_row} bytes (V = {V}); raise memory_budget")
    return int(memory_budget) // per_row


def project(h, weight, bias, out):
    """out = h @ weight.T (+ bias, added by the GEMM)."""
    if bias is None:
        return torch.mm(h, weight.t(), out=out)
    return torch.addmm(bias, h, weight.t(), out=out)


def project_blocks(h, weight, bias, out):
    """out = h @ weight.T (+ bias) by GEMMs of exactly INVARIANT_ROWS rows (the last row block padded with
    zero rows) and VOCAB_BLOCK weight rows each (the vocabulary's last block as wide as it is): every
    token's logits of a vocabulary block come from a GEMM of one fixed shape, whatever the tile's row count
    or the rank's slice of the vocabulary around the block, so their bits depend on neither the batch
    (batch_invariant=True, spec 14) nor, with slice boundaries at multiples of VOCAB_BLOCK, the split."""
    R, C = INVARIANT_ROWS, VOCAB_BLOCK
    n, V = h.shape[0], weight.shape[0]
    block = h.new_zeros((R, h.shape[1]))
    zs = {}
    for r0 in range(0, n, R):
        k = min(R, n - r0)
        block[:k].copy_(h[r0:r0 + k])
        if k < R:
            block[k:].zero_()
        for c0 in range(0, V, C):
            w = min(C, V - c0)
            z = zs.get(w)
            if z is None:
                z = zs[w] = out.new_empty((R, w))
            project(block, weight[c0:c0 + w], None if bias is None else bias[c0:c0 + w], z)
            out[r0:r0 + k, c0:c0 + w].copy_(z[:k])
    return out


_MIXED = {}


def mixed_gemm(device) -> bool:
    """Whether torch.addmm accumulates a 16-bit product into a float32 output here (out_dtype)."""
    kind = torch.device(device).type
    if kind not in _MIXED:
        if torch.compiler.is_compiling():  # a probe traced into a graph would fail when the graph runs
            return False  # the upcast tile: exact, probed in the next eager call
        try:
            acc = torch.zeros(2, 2, device=device)
            a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
            torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
            _MIXED[kind] = True
        except (RuntimeError, TypeError, NotImplementedError):
            _MIXED[kind] = False
    return _MIXED[kind]


def accumulate(acc, a, b):
    """acc += a @ b in acc's dtype (float32 for 16-bit a, b), in place, never rounding a tile's product
    to 16 bits: a mixed-precision GEMM where torch has one, else only the tile upcast."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b.to(acc.dtype))  # b 16-bit only with head_dtype=float32: the tile's rows upcast
    elif mixed_gemm(acc.device):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))
    return acc


def product(a, b, acc):
    """a @ b in the dtype acc (float32 for 16-bit a, b), never rounded to 16 bits: one GEMM where a and b
    are already acc, else accumulate into zeros."""
    if a.dtype == b.dtype == acc:
        return a @ b
    return accumulate(torch.zeros(a.shape[0], b.shape[1], dtype=acc, device=a.device), a, b)


def autocast_off(device):
    """The head computes in its inputs' dtypes (spec 6): torch.autocast off for `device` inside it (a
    float32 model under autocast keeps float32 GEMMs and gradients)."""
    kind = torch.device(device).type
    if not torch.amp.is_autocast_available(kind):
        return contextlib.nullcontext()
    return torch.autocast(kind, enabled=False)


def materialize(hidden, weight, bias, scale, softcap, proj=None):
    """The whole logits, out of place (autograd flows through): the reference backend only. As the tiles
    form them (spec 11): the GEMM's output, bias included, rounded once to its dtype, then the scale and
    soft-cap in float32 (float64 for float64). Its backward runs with torch.autocast off too, wherever
    backward() runs (spec 6)."""
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in leaves):
        return _logits(hidden, weight, bias, scale, softcap, proj)
    return _NoAutocastBackward.apply(lambda *a: _logits(*a, scale, softcap, proj), hidden, weight, bias)


class _NoAutocastBackward(torch.autograd.Function):
    """f(*inputs) whose backward forms f again and differentiates it with torch.autocast off on the inputs'
    device (a caller's backward() inside an autocast region would run the GEMMs' backward in 16 bits): a
    backward run again (retain_graph) or differentiated again (create_graph) works as autograd's own."""

    @staticmethod
    def forward(ctx, f, *inputs):
        ctx.f, ctx.none = f, [t is None for t in inputs]
        ctx.save_for_backward(*[t for t in inputs if t is not None])
        return f(*inputs)

    @staticmethod
    def backward(ctx, g):
        higher = torch.is_grad_enabled()  # create_graph: the gradient itself differentiable
        saved = iter(ctx.saved_tensors)
        xs = [None if none else next(saved) for none in ctx.none]
        with torch.enable_grad(), autocast_off(g.device):
            xs = [x if x is None or higher else x.detach().requires_grad_(x.requires_grad) for x in xs]
            wrt = [x for x in xs if x is not None and x.requires_grad]
            grads = iter(torch.autograd.grad(ctx.f(*xs), wrt, g, create_graph=higher))
        return (None, *(next(grads) if x is not None and x.requires_grad else None for x in xs))


def _logits(hidden, weight, bias, scale, softcap, proj):
    hidden, weight, bias = upcast(hidden, proj), upcast(weight, proj), upcast(bias, proj)
    z = hidden @ weight.t() if bias is None else torch.addmm(bias, hidden.reshape(-1, hidden.shape[-1]),
                                                              weight.t()).reshape(*hidden.shape[:-1], -1)
    z = z.to(float_dtype_for(z)) * scale
    return z if softcap is None else softcap * torch.tanh(z / softcap)
