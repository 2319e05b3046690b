"""The device-side value checks read on the host together, once (one_host_read), or handed to a process
group's agreement instead (its own read carries them; the common predicates are then formed by the
agreement row's own kernel: RowCheck, no launch of their own)."""
from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

# Checks of values on the device made inside one_host_read(): (0-d bool "failed", raise) in order made
_PENDING = contextvars.ContextVar("gtpo_pending_checks", default=None)
# inside one_host_read(defer=...) whose defer has a `row_device`: the device of the agreement's row, whose
# kernel forms the RowCheck predicates of tensors that live there
_ROW = contextvars.ContextVar("gtpo_row_device", default=None)


class RowCheck:
    """A value check formed by the agreement row's kernel (distributed/digest.write_row) instead of a
    launch of its own: kind 'finite' (x finite), 'binary' (x is 0 or 1), 'range' (x in [0, V); V may
    be inf), at the positions `where` selects (any dtype, nonzero; None: every position); 'cu' (x, a
    cu_seqlens, from 0 to V = N, never decreasing), 'cu_max' (no completion of x longer than V =
    max_seqlen), 'atleast' (x finite and >= V, an int, at `where`) or 'positive' (x finite and > 0 with 1 / x
    finite, at `where`: a temperature). torch_bad(): its torch form (a bool tensor, read only on the failing
    rank). row_length T (not None): x holds one value per row of T tokens, checked where `where` selects a
    token of its row (where: None or one per token); T = (cu_seqlens, N): one per completion of the packed
    form (Batch.seq_rows)."""
    __slots__ = ("x", "where", "kind", "V", "torch_bad", "row_length")

    def __init__(self, x, where, kind, V, torch_bad, row_length=None):
        self.x, self.where, self.kind, self.V, self.torch_bad = x, where, kind, V, torch_bad
        self.row_length = row_length


def in_row(x, where, kind, V, torch_bad, fail, row_length=None):
    """Record a value check for the agreement row's kernel (True), where the enclosing one_host_read hands its
    checks to an agreement whose row lives on x's (and where's) device; else False (the caller launches it).
    row_length: see RowCheck."""
    device, items = _ROW.get(), _PENDING.get()
    if device is None or items is None or x.device != device or (where is not None and where.device != device):
        return False
    items.append((RowCheck(x.detach().reshape(-1), None if where is None else where.reshape(-1), kind, V,
                           torch_bad, row_length), lambda _value: fail()))
    return True


@contextlib.contextmanager
def one_host_read(defer=None):
    """The device-side value checks made inside (a 0-d flag each) are read on the host together, once,
    when the block ends normally; the first that failed, in the order made, then raises its error (which
    may read more to name the position). Nested blocks read with the outermost. Nothing inside a block
    may index with a value it checks. (Under torch.compile no check reads the host: nothing to gather.)
    defer: instead of reading, hand the block's checks to defer(any_failed, raise_first, row_checks) (a 0-d
    bool tensor, unread, or None; a callable that reads them and raises the first that failed; the
    RowCheck predicates recorded for the row's kernel when defer.row_device is set), e.g. to a process
    group's agreement, whose own host read then carries them; what runs until then must take unchecked
    values as validate=False does."""
    if torch.compiler.is_compiling() or _PENDING.get() is not None:
        yield
        return
    items = []
    token = _PENDING.set(items)
    row = _ROW.set(getattr(defer, "row_device", None))
    try:
        yield
    finally:
        _ROW.reset(row)
        _PENDING.reset(token)
    if not items:
        return
    if defer is not None:
        flags = [f for f, _ in items if not isinstance(f, RowCheck)]
        flags = [f.reshape(()).to(flags[0].device, torch.bool) for f in flags]
        defer(None if not flags else flags[0] if len(flags) == 1 else torch.stack(flags).any(),
              lambda: _raise_first(items), [f for f, _ in items if isinstance(f, RowCheck)])
        return
    dev = items[0][0].device
    if len(items) == 1:  # the one host read (no stack to launch for one value)
        failed = [items[0][0].reshape(()).tolist()]
    else:
        failed = torch.stack([f.reshape(()).to(dev) for f, _ in items]).tolist()
    for (_, fail), bad in zip(items, failed):
        if bad:
            fail(bad)


class Carried:
    """For one_host_read(defer=...) on one process: the block's value checks are not read at its end but with
    the next planned host read (read_planned: the LM head's tile plan), one read for both; whatever takes
    no planned read settles them (one read of their own, as before), and so does an error raised before it
    (a failed check's error comes first, as at its own read). What runs until then takes unchecked values
    as validate=False does."""
    row_device = None

    def __init__(self):
        self.failed = self.raise_first = None

    def __call__(self, failed, raise_first, row_checks=()):
        self.failed, self.raise_first = failed, raise_first

    def read_with(self, values):
        """values (a 1-D integer tensor) read on the host -> a list, with the carried flag in the same read
        (a failed check raises its error first)."""
        if self.failed is None:
            return values.tolist()
        both = torch.cat([values, self.failed.reshape(1).to(values.device, values.dtype)]).tolist()
        self.failed = None
        if both[-1]:
            self.raise_first()
        return both[:-1]

    def settle(self):
        """The carried checks read now, if no planned read took them."""
        if self.failed is not None:
            failed, self.failed = self.failed, None
            if failed.reshape(()).tolist():
                self.raise_first()


_CARRY = contextvars.ContextVar("gtpo_carried_checks", default=None)


@contextlib.contextmanager
def carried():
    """A Carried for the block's one_host_read(defer=...): the planned read inside (read_planned) takes its
    checks; read at the block's end otherwise."""
    carry = Carried()
    token = _CARRY.set(carry)
    try:
        yield carry
    except Exception:  # a held check that failed raises its own error first, as at a read of its own
        carry.settle()
        raise
    finally:
        _CARRY.reset(token)
    carry.settle()


def carrying(fn):
    """fn runs inside carried(): its one_host_read(defer=carry()) value checks ride on its planned read
    (under torch.compile no check reads the host: nothing to carry)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        with carried():
            return fn(*args, **kwargs)
    return run


def carry():
    """The enclosing carried() block's Carried (None outside one, and under torch.compile)."""
    return None if torch.compiler.is_compiling() else _CARRY.get()


def read_planned(values):
    """A planned host read (the LM head's tile plan) of values (a 1-D integer tensor) -> a list, with the
    enclosing carried() block's value checks in the same read."""
    held = carry()
    return values.tolist() if held is None else held.read_with(values)


def _raise_first(items):
    """The first of a deferred block's checks that failed raises its error (each flag read in turn). Where
    none fails on the host although the row's kernel flagged one, a 'positive' check (a temperature) holding
    a subnormal value at a selected position raises its error: a device that flushes subnormals to 0
    finds 1 / tau not finite there."""
    for failed, fail in items:
        value = (failed.torch_bad().any() if isinstance(failed, RowCheck) else failed).reshape(()).tolist()
        if value:
            fail(value)
    for failed, fail in items:
        if isinstance(failed, RowCheck) and failed.kind == "positive" and _subnormal(failed):
            fail(1)


def _subnormal(c):
    """Whether a RowCheck's x holds a subnormal float at a position its `where` selects."""
    x = c.x
    if not x.dtype.is_floating_point:
        return False
    sub = (x != 0) & (x.abs() < torch.finfo(x.dtype).tiny)
    return bool((sub if c.where is None else sub & (c.where != 0)).any())


def read_once(fn):
    """fn's device-side value checks read on the host once, at its end (one_host_read)."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with one_host_read():
            return fn(*args, **kwargs)
    return run


def check_on_device(failed, fail, with_value=False):
    """failed: a 0-d bool tensor (with_value: any 0-d tensor, nonzero when failed); fail() (with_value:
    fail(the value read)) raises the error. Read now, or with one_host_read's block."""
    run = fail if with_value else (lambda _value: fail())
    items = _PENDING.get()
    if items is None:
        value = failed.reshape(()).tolist()
        if value:
            run(value)
    else:
        items.append((failed, run))
