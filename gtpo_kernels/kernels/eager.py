"""The package's custom ops called eagerly without torch.library's per-call Python.

A `torch.library.custom_op` call fills in its defaults, flattens every argument, checks aliasing and
redispatches through autograd before its body runs: about 20 us of host time for a small op and several
times that for the fused loss's 26 arguments, per call, where the whole call should cost the host a few
launches (spec 8). `eager(op, backward, setup_context)` returns a callable with the op's signature that:
- under torch.compile or export, given a tensor subclass (a fake or functional tensor, a DTensor) or a meta
  tensor, calls the op itself, so graphs hold the registered op and its fake implementation; so too inside a
  backward that builds a graph (create_graph=True), where the ops' missing second-order formula then raises
  as the registered ops raise it (never a second-order term silently 0);
- otherwise runs the op's own Python body directly (below autograd, as the op's dispatch runs it), through
  an autograd.Function made of the op's own `setup_context` and `backward` when it has a gradient.
The same code runs either way: the values, the gradients and the kernels launched are the op's.
Ops that mutate an argument keep the op's call (its dispatch bumps the argument's version counter).
"""
from __future__ import annotations

import inspect
import threading

import torch

_STATE = threading.local()  # .registered: inside a backward with create_graph=True (the registered ops' calls)


def eager(op, backward=None, setup_context=None):
    """The eager caller of custom op `op` (module docstring); backward, setup_context: as registered with
    op.register_autograd (None: the op has no gradient)."""
    body = op._init_fn
    sig = inspect.signature(body)
    names = tuple(sig.parameters)
    defaults = tuple(p.default for p in sig.parameters.values())
    many = str(sig.return_annotation).startswith(("List", "list", "typing.List"))
    function = None if backward is None else _function(body, backward, setup_context, many)

    def call(*args, **kwargs):
        if not args or torch.compiler.is_compiling() or type(args[0]) is not torch.Tensor or args[0].is_meta \
                or getattr(_STATE, "registered", False):
            return op(*args, **kwargs)
        if kwargs or len(args) < len(names):
            args = args + tuple(kwargs.pop(n, d) for n, d in zip(names[len(args):], defaults[len(args):]))
            if kwargs or any(a is inspect.Parameter.empty for a in args):
                raise TypeError(f"{op}: unexpected or missing arguments (given {sorted(kwargs)}; takes {names})")
        if function is not None:
            out = function.apply(*args)
            return list(out) if many else out
        if torch.is_grad_enabled():
            with torch.no_grad():
                return body(*args)
        return body(*args)

    call.op = op
    call.__doc__, call.__name__ = body.__doc__, body.__name__
    return call


def _function(body, backward, setup_context, many):
    """An autograd.Function running `body` with the op's setup_context and backward (lists as the op's:
    outputs a list when `many`, the gradients of list arguments None)."""

    class Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):  # (ctx in forward: apply binds no signature a call)
            out = body(*args)
            setup_context(ctx, args, out)
            return tuple(out) if many else out

        @staticmethod
        def backward(ctx, *grads):
            before = getattr(_STATE, "registered", False)
            _STATE.registered = before or torch.is_grad_enabled()  # (create_graph=True)
            try:
                out = backward(ctx, list(grads) if many else grads[0])
            finally:
                _STATE.registered = before
            return tuple(None if isinstance(g, (list, tuple)) else g for g in out)

    Op.__name__ = body.__name__
    return Op
