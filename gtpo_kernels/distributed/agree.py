"""Failure is collective (spec 12): no input, valid or not, on any subset of ranks leaves another rank
waiting in a collective.

Every entry point that takes a process group runs this rank's local checks inside `guard` (with a group,
every Exception is held instead of raised), then makes its one small collective through `agree`: an
all-gather of a few int64 per rank whose first is this rank's error flag. If any rank failed, every rank
raises the same ValueError naming the failing rank(s) (on a failing rank, chained to its own error), so
no rank raises or returns while another still waits. The rest of each row is what the ranks must agree on
(shapes, options, and for a vocabulary-parallel group the checksums of digest.py); `odd_ranks` names the
ranks that differ, and the caller raises, on every rank, the same error for them.

A condition that is only known on the device (a malformed cu_seqlens unvalidated) joins the error flag
through `fail_if` without a host read of its own: the gathered row is the one read. Validating, the value
checks (`deferred`) join it the same way; where the row's kernel runs, it forms their predicates itself
(core.host_read.RowCheck: no launch of their own)."""
from __future__ import annotations

from collections import Counter

import torch

from .digest import _MASK61, Digest, kernels_on, row_launch, write_row

# the agreement's collective: an all-gather into one tensor (named all_gather_into_tensor before torch 2.13)
GATHER = "all_gather_single" if hasattr(torch.distributed, "all_gather_single") else "all_gather_into_tensor"
_KINDS = ("ValueError", "TypeError", "RuntimeError", "IndexError", "KeyError", "AttributeError",
          "PicklingError", "OverflowError", "NotImplementedError")


class guard:
    """`with guard(group) as g:` this rank's checks. Without a group (None) errors propagate as usual;
    with one, the first Exception is held in g.error (the block stops there) until `agree` reports it
    on every rank. g.fields: what the rank brings to the agreement (set at the end of the block)."""

    def __init__(self, group):
        self.group, self.error, self.fields, self.later, self.row_checks = group, None, None, [], []
        self.layout = None  # (agree: each field's part in the row)

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if self.group is None or not isinstance(err, Exception):
            return False
        self.error = err
        return True


def fail_if(g, bad, error):
    """A 0-d bool tensor `bad` (on the device, unread) counts as this rank failing with `error` (an
    exception, or a callable that raises it: run, on this rank, only once the agreement says it failed).
    bad None: the row's kernel forms it (g.row_checks); `error` then runs to tell whether it failed."""
    g.later.append((bad, error))


class deferred:
    """For checks.one_host_read(defer=...): with a group, the block's value checks join this rank's error flag
    (fail_if) instead of being read, so that the agreement's one host read carries them; the rank whose checks
    failed then runs them on the host and chains the first one's error (kind: ValueError, as the value checks
    raise). x: a tensor of the call (the row's device: collective_device); where the row's kernel runs there
    (`row_device`), the predicates of the tensors that live there are formed by it. None without a group
    (the checks are read as usual)."""

    def __new__(cls, g, x=None):
        if g.group is None:
            return None
        self = super().__new__(cls)
        self.g, self.row_device = g, None
        if isinstance(x, torch.Tensor):
            device = collective_device(g.group, x)
            self.row_device = device if kernels_on(device, []) else None
        return self

    def __call__(self, failed, raise_first, row_checks=()):
        if failed is not None:
            fail_if(self.g, failed, raise_first)
        if row_checks:
            self.g.row_checks.extend(row_checks)
            fail_if(self.g, None, raise_first)


def _raised(error):
    """`error` as an exception (a callable runs: it raises the error that names the position), or None
    where the callable raises nothing."""
    if isinstance(error, BaseException):
        return error
    try:
        error()
    except Exception as e:  # noqa: BLE001 - the check's own error, whatever its kind
        return e
    return None


def _first_failed(later):
    """The error of the first of g.later that failed (bad None: its host form, run, says)."""
    for bad, error in later:
        if bad is None or bool(bad):
            err = _raised(error)
            if err is not None or bad is not None:
                return err or _passed()
    return _passed()


def _passed():
    return RuntimeError("a deferred check flagged this rank on the device, but its host check passed")


def _kind(err):
    name = type(err).__name__ if isinstance(err, BaseException) else "ValueError"  # (deferred value checks)
    return 1 + (_KINDS.index(name) if name in _KINDS else len(_KINDS))


def _kind_name(code):
    return _KINDS[code - 1] if code - 1 < len(_KINDS) else "an exception"


def _layout(fields, raw):
    """Each field's part in the row: ('raw', value) for the first `raw` (compared as they are: they may differ
    between ranks), ('digest', const) for a Digest formed on the device (its constant kept on the host; a
    'tokens' one's and the next two's 0), ('device', 0) for a tensor field, ('host', int) for a number."""
    def part(i, f):
        if isinstance(f, Digest):  # (among the raw ones too: a config holding a 0-d tensor fingerprints so)
            return ("digest", f.const) if f.kind not in ("tokens", "filled") else ("device", 0)
        if isinstance(f, torch.Tensor):
            return "device", 0
        return ("raw" if i < raw else "host"), int(f)
    return [part(i, f) for i, f in enumerate(fields)]


def _key(layout):
    """The constants' checksum (62 bits, the top one set: an int64 launch argument of one type)."""
    import hashlib
    kept = repr([(kind, None if kind == "raw" else v) for kind, v in layout]).encode()
    return (int.from_bytes(hashlib.blake2b(kept, digest_size=8).digest(), "little") >> 3) | (1 << 61)


def _head(layout):
    """The row's values known on the host: [0 (the error flag), the raw fields, 0 elsewhere, the key]."""
    return [0] + [v if kind == "raw" else 0 for kind, v in layout] + [_key(layout)]


def _head_args(layout):
    """digest_triton.row_launches' head for this layout: its kernel writes the row's host values (a raw field in
    slot 1 at most), or None where it cannot."""
    raws = [v for kind, v in layout if kind == "raw"]
    return None if len(raws) > 1 else (len(layout), raws[0] if raws else None, _key(layout))


def _row(g, width, device, raw):
    """[error flag, *fields, key] as one int64 tensor on `device`: a field the ranks compare by value (`raw`)
    as it is, a Digest's terms and a device field formed into their slots, 0 elsewhere: the host's constants
    travel as their checksum (`_key`), so nothing is copied to the device where the row's kernel runs (it writes
    the row whole); else the host's values are one tensor made on the host."""
    try:
        if g.error is None:
            fields = list(g.fields)
            if len(fields) != width:
                raise RuntimeError(f"agree: {len(fields)} fields, expected {width}")
            layout = _layout(fields, raw)
            head = _head_args(layout) if kernels_on(device, []) else None
            row = torch.empty(width + 2, dtype=torch.int64, device=device) if head else \
                torch.tensor(_head(layout), dtype=torch.int64).to(device)
            write_row(fields, row, g.row_checks, head or False)  # the checksums and checks: one launch where the kernels run
            for i, f in enumerate(fields):  # (a device field: a launch each)
                if isinstance(f, torch.Tensor):
                    row[i + 1] = f.reshape(()).to(device, torch.int64)
            for bad, error in g.later:  # (one launch each)
                if bad is not None:
                    row[:1].masked_fill_(bad.to(device, torch.bool).reshape(1), _kind(error))
            g.layout = layout
            return row
    except Exception as e:  # noqa: BLE001 - held like any other local failure
        g.error = e
    row = torch.zeros(width + 2, dtype=torch.int64, device=device)
    row[0] = _kind(g.error)
    return row


def row_to_fold(g, width, device, raw=1):
    """(the row, the one program that forms it whole: digest.row_launch) where another launch may run that
    program before `agree(..., row=row)`, else None (this rank failed, a field lives on the device, a
    device-side condition joins the flag, or the row takes more than that program)."""
    if g.error is not None or len(g.fields) != width or any(isinstance(f, torch.Tensor) for f in g.fields) \
            or any(bad is not None for bad, _ in g.later) or not kernels_on(device, []):
        return None
    try:  # (a failure here is left to _row, which holds it as this rank's)
        layout = _layout(g.fields, raw)
        head = _head_args(layout)
        row = torch.empty(width + 2, dtype=torch.int64, device=device)
        launch = None if head is None else row_launch(g.fields, row, g.row_checks, head)
    except Exception:  # noqa: BLE001
        return None
    if launch is None:
        return None
    g.layout = layout
    return row, launch


def agree(g, width, device, where, row=None, raw=1):
    """The one small collective: every rank's [error flag, *g.fields, key] -> the fields of every rank (lists
    of ints, rank order); one host read. If any rank failed, every rank raises the same ValueError
    naming the failing rank(s); a failing rank chains its own error. row: this rank's row, formed already
    (row_to_fold's, its program run by another launch). raw: how many leading fields travel as they are;
    the others' host values travel as their checksum, and only where it differs between ranks (every rank
    sees that alike) are they all-gathered themselves (a second collective, on the way to an error)."""
    import torch.distributed as dist
    mine = _row(g, width, device, raw) if row is None else row
    every = mine.new_empty(dist.get_world_size(g.group) * mine.numel())
    getattr(dist, GATHER)(every, mine, group=g.group)
    rows = every.view(-1, mine.numel()).tolist()
    if g.error is None and rows[dist.get_rank(g.group)][0]:  # a device-side condition failed here
        g.error = _first_failed(g.later)
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        why = ", ".join(f"rank {r}: {_kind_name(rows[r][0])}" for r in failed)
        raise ValueError(f"{where}: rank(s) {failed} refused their arguments ({why}; the error chained on "
                         f"the failing rank says why); every rank of the group raises this error, none is "
                         f"left waiting") from g.error
    layouts = [g.layout] * len(rows)
    if len({row[-1] for row in rows}) > 1:  # the host's values differ somewhere: gathered to be named
        layouts = [None] * len(rows)
        dist.all_gather_object(layouts, g.layout, group=g.group)
    return [rebuilt(layout, row) for layout, row in zip(layouts, rows)]


def rebuilt(layout, row):
    """A gathered row's fields (a list of ints) from its layout (_layout's): a Digest's constant added back."""
    return [(c + v) & _MASK61 if kind == "digest" else c if kind == "host" else v
            for (kind, c), v in zip(layout, row[1:-1])]


def odd_ranks(values):
    """The ranks whose value differs from the majority's; without a strict majority (two ranks that
    differ, say), every rank: none can be told apart as the one that is wrong."""
    common, n = Counter(values).most_common(1)[0]
    if 2 * n <= len(values):
        return list(range(len(values))) if len(set(values)) > 1 else []
    return [r for r, v in enumerate(values) if v != common]


def disagree(where, values, what, fix):
    """Raise (the same text on every rank) when the ranks' `values` differ."""
    odd = odd_ranks(values)
    if odd:
        raise ValueError(f"{where}: the ranks disagree on {what}: rank(s) {odd} differ"
                         f"{' from the others' if len(odd) < len(values) else ''}; per rank {values}; {fix}")


def collective_device(group, x):
    """Where the small collective's tensors live: x's device, CUDA for a CPU tensor under NCCL."""
    import torch.distributed as dist
    device = x.device if isinstance(x, torch.Tensor) else torch.device("cpu")
    if device.type == "cpu" and dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    return device
