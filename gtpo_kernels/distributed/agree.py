"""Failure is collective (spec 12): no input, valid or not, on any subset of ranks leaves another rank
waiting in a collective.

Every entry point that takes a process group runs this rank's local checks inside `guard` (with a group,
every Exception is held instead of raised), then makes its one small collective through `agree`: an
all-gather of a few int64 per rank whose first is this rank's error flag. If any rank failed, every rank
raises the same ValueError naming the failing rank(s) (on a failing rank, chained to its own error), so
no rank raises or returns while another still waits. The rest of each row is what the ranks must agree on
(shapes, options, and for a vocabulary-parallel group the tokens' `token_digest`); `odd_ranks` names the
ranks that differ, and the caller raises, on every rank, the same error for them.

A condition that is only known on the device (a malformed cu_seqlens unvalidated) joins the error flag
through `fail_if` without a host read of its own: the gathered row is the one read."""
from __future__ import annotations

import dataclasses
import numbers
import re
import zlib
from collections import Counter

import torch

_MASK61 = (1 << 61) - 1
_K1, _K2, _K3, _K4 = (0x9E3779B97F4A7C15 - (1 << 64), 0x632BE59BD9B4E019, 0x2545F4914F6CDD1D,
                      0xBF58476D1CE4E5B9 - (1 << 64))  # odd 64-bit mixers, as int64
_KINDS = ("ValueError", "TypeError", "RuntimeError", "IndexError", "KeyError", "AttributeError",
          "PicklingError", "OverflowError", "NotImplementedError")


class guard:
    """`with guard(group) as g:` this rank's checks. Without a group (None) errors propagate as usual;
    with one, the first Exception is held in g.error (the block stops there) until `agree` reports it
    on every rank. g.fields: what the rank brings to the agreement (set at the end of the block)."""

    def __init__(self, group):
        self.group, self.error, self.fields, self.later = group, None, None, []

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if self.group is None or not isinstance(err, Exception):
            return False
        self.error = err
        return True


def fail_if(g, bad, error):
    """A 0-d bool tensor `bad` (on the device, unread) counts as this rank failing with `error`."""
    g.later.append((bad, error))


def _kind(err):
    name = type(err).__name__
    return 1 + (_KINDS.index(name) if name in _KINDS else len(_KINDS))


def _kind_name(code):
    return _KINDS[code - 1] if code - 1 < len(_KINDS) else "an exception"


def _row(g, width, device):
    """[error flag, *fields] as one int64 tensor on `device` (device fields are not read on the host)."""
    try:
        if g.error is None:
            fields = list(g.fields)
            if len(fields) != width:
                raise RuntimeError(f"agree: {len(fields)} fields, expected {width}")
            row = torch.tensor([0] + [0 if isinstance(f, torch.Tensor) else int(f) for f in fields],
                               dtype=torch.int64).to(device)
            on_dev = [i for i, f in enumerate(fields) if isinstance(f, torch.Tensor)]
            if on_dev:
                row[[i + 1 for i in on_dev]] = torch.stack([fields[i].reshape(()).to(device, torch.int64)
                                                            for i in on_dev])
            for bad, error in g.later:
                row[0] = torch.where(bad.to(device), _kind(error), row[0])
            return row
    except Exception as e:  # noqa: BLE001 - held like any other local failure
        g.error = e
    row = torch.zeros(width + 1, dtype=torch.int64, device=device)
    row[0] = _kind(g.error)
    return row


def agree(g, width, device, where):
    """The one small collective: every rank's [error flag, *g.fields] -> the fields of every rank (lists
    of ints, rank order); one host read. If any rank failed, every rank raises the same ValueError
    naming the failing rank(s); a failing rank chains its own error."""
    import torch.distributed as dist
    mine = _row(g, width, device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(g.group))]
    dist.all_gather(every, mine, group=g.group)
    rows = torch.stack(every).tolist()
    if g.error is None and rows[dist.get_rank(g.group)][0]:  # a device-side condition failed here
        g.error = next(e for bad, e in g.later if bool(bad))
    failed = [r for r, row in enumerate(rows) if row[0]]
    if failed:
        why = ", ".join(f"rank {r}: {_kind_name(rows[r][0])}" for r in failed)
        raise ValueError(f"{where}: rank(s) {failed} refused their arguments ({why}; the error chained on "
                         f"the failing rank says why); every rank of the group raises this error, none is "
                         f"left waiting") from g.error
    return [row[1:] for row in rows]


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


def _mix(x, pos):
    """Spread int64 words x at positions pos (a tensor, or an int) over 64 bits (wrapping arithmetic)."""
    x = x * _K1 + (pos * _K2 if isinstance(pos, torch.Tensor) else _wrap(pos * _K2))
    x = (x ^ (x >> 31)) * _K4
    return x ^ (x >> 29)


def _float_bits(x):
    """x as float64 bit patterns, one pattern per value: -0.0 as 0.0, every NaN as one NaN."""
    x = x.detach().to(torch.float64) + 0.0
    return torch.where(torch.isnan(x), torch.full_like(x, float("nan")), x).view(torch.int64)


def values_digest(x, where=None):
    """A 0-d int64 checksum mod 2**61 of a tensor's values with their positions and its size, on its device
    (no host read): floats by value (as float64), integers as they are; `where`: only those positions."""
    flat = x.reshape(-1)
    words = _float_bits(flat) if flat.dtype.is_floating_point else flat.long()
    h = _mix(words, torch.arange(flat.numel(), device=flat.device))
    if where is not None:
        h = torch.where(where.reshape(-1), h, torch.zeros((), dtype=torch.int64, device=h.device))
    return (h.sum() + (flat.numel() * _K3) % _MASK61) & _MASK61


def _flatten(options):
    for o in options:
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            for f in dataclasses.fields(o):
                yield f.name
                yield getattr(o, f.name)
        elif isinstance(o, (tuple, list)):
            yield len(o)
            yield from _flatten(o)
        else:
            yield o


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def fingerprint(options):
    """The options as one stable int (the same on every process, unlike hash()), compared BY VALUE:
    every number (int, float, numpy scalar, a tensor of one element) counts as its float64 value, so 1,
    1.0 and tensor(1.0) are one option; a config (a dataclass) counts by its fields; anything else by
    its repr (without an object's address). With a tensor among them: a 0-d int64 tensor on its device;
    the numbers are hashed on the host, the tensors where they live (no host read, no copy to the device)."""
    text, numbers_at, tensors_at = [], [], []
    for o in _flatten(options):
        if isinstance(o, torch.Tensor):
            tensors_at.append((len(text), o))
            text.append("#" if o.numel() == 1 else f"#{tuple(o.shape)}")
        elif isinstance(o, numbers.Real) and not isinstance(o, bool):
            numbers_at.append((len(text), float(o)))
            text.append("#")
        else:  # an object's address differs between processes (a torch.Generator, say): its type counts
            text.append(_ADDRESS.sub("", repr(o)))
    digest = zlib.crc32(repr(text).encode())
    if numbers_at:  # the same words as a one-element tensor of that value would give
        pos, vals = zip(*numbers_at)
        digest = _wrap(digest + int(_mix(_float_bits(torch.tensor(vals, dtype=torch.float64)), torch.tensor(pos)).sum()))
    for pos, t in tensors_at:  # one word each, mixed at its position (a Python int: no copy)
        word = _float_bits(t.reshape(())) if t.numel() == 1 else values_digest(t)
        digest = digest + _mix(word, pos)
    return digest & _MASK61 if isinstance(digest, torch.Tensor) else _wrap(digest) & _MASK61


def _wrap(x):
    """A Python int as the int64 it wraps to."""
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


def token_digest(b):
    """(counted tokens, checksum of ids, mask and segments mod 2**61, largest counted id) of a Batch as
    0-d int64 tensors on its device: a few elementwise passes over N, no host read."""
    ids, counted = b.ids.long(), b.counted
    if ids.numel() == 0:
        zero = torch.zeros((), dtype=torch.int64, device=ids.device)
        return zero, zero, zero - 1
    pos = torch.arange(ids.numel(), device=ids.device)
    x = _mix(ids + b.seg.long() * _K3, pos)  # wraps mod 2**64
    zero = torch.zeros((), dtype=torch.int64, device=ids.device)
    checksum = torch.where(counted, x, zero).sum() & _MASK61
    top = torch.where(counted, ids, zero - 1).max()
    return counted.sum(), checksum, top


# What the ranks of a vocabulary-parallel group must pass alike besides the tokens (spec 12), each
# compared by a checksum of its values (per-token inputs at counted tokens; None counts as absent).
INPUTS = ("cu_seqlens and max_seqlen", "advantages", "old_logps", "ref_logps", "lam", "n_conf",
          "rollout_is_weights", "rollout_logps", "temperature (per token)")
_ABSENT = 1


def input_digests(b):
    """The checksums of INPUTS for a Batch, in that order (0-d int64 tensors, or _ABSENT); no host read."""
    cu = _ABSENT
    if b.cu_seqlens is not None:
        extra = b.cu_seqlens.new_full((1,), -1 if b.max_seqlen is None else b.max_seqlen, dtype=torch.int64)
        cu = values_digest(torch.cat([b.cu_seqlens.long(), extra]))
    whole = [b.adv, None, None, None, b.n_conf, None, None, None]
    counted = [None, b.old, b.ref, b.lam, None, b.rollout_w, b.rollout_logps, b.tau]
    out = [cu]
    for x, y in zip(whole, counted):
        if x is not None:
            out.append(values_digest(x))
        elif y is not None:
            out.append(values_digest(y, b.counted))
        else:
            out.append(_ABSENT)
    return out


def collective_device(group, x):
    """Where the small collective's tensors live: x's device, CUDA for a CPU tensor under NCCL."""
    import torch.distributed as dist
    device = x.device if isinstance(x, torch.Tensor) else torch.device("cpu")
    if device.type == "cpu" and dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    return device
