"""The device-side value checks read on the host together, once (one_host_read), or handed to a process
group's agreement instead (its own read carries them)."""
from __future__ import annotations

import contextlib
import contextvars
import functools

import torch

# Checks of values on the device made inside one_host_read(): (0-d bool "failed", raise) in order made
_PENDING = contextvars.ContextVar("gtpo_pending_checks", default=None)


@contextlib.contextmanager
def one_host_read(defer=None):
    """The device-side value checks made inside (a 0-d flag each) are read on the host together, once,
    when the block ends normally; the first that failed, in the order made, then raises its error (which
    may read more to name the position). Nested blocks read with the outermost. Nothing inside a block
    may index with a value it checks. (Under torch.compile no check reads the host: nothing to gather.)
    defer: instead of reading, hand the block's checks to defer(any_failed, raise_first) (a 0-d bool
    tensor, unread, and a callable that reads them and raises the first that failed), e.g. to a process
    group's agreement, whose own host read then carries them; what runs until then must take unchecked
    values as validate=False does."""
    if torch.compiler.is_compiling() or _PENDING.get() is not None:
        yield
        return
    items = []
    token = _PENDING.set(items)
    try:
        yield
    finally:
        _PENDING.reset(token)
    if not items:
        return
    dev = items[0][0].device
    if defer is not None:
        flags = [f.reshape(()).to(dev, torch.bool) for f, _ in items]
        defer(flags[0] if len(flags) == 1 else torch.stack(flags).any(), lambda: _raise_first(items))
        return
    if len(items) == 1:  # the one host read (no stack to launch for one value)
        failed = [items[0][0].reshape(()).tolist()]
    else:
        failed = torch.stack([f.reshape(()).to(dev) for f, _ in items]).tolist()
    for (_, fail), bad in zip(items, failed):
        if bad:
            fail(bad)


def _raise_first(items):
    """The first of a deferred block's checks that failed raises its error (each flag read in turn)."""
    for failed, fail in items:
        value = failed.reshape(()).tolist()
        if value:
            fail(value)


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
