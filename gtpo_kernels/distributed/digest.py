"""The checksums the ranks of a group compare in the agreement (spec 12): of the options (`fingerprint`,
by value), of the tensors' values (`values_digest`), of the tokens (`token_digest`), each a 0-d int64
mod 2**61 formed where the tensors live (no host read). These torch forms are the definition; in the
agreement's row they are `Digest` fields, formed when the row is made by one kernel each
(kernels/digest_triton, bitwise equal) where Triton runs on the row's device."""
from __future__ import annotations

import dataclasses
import numbers
import re
import struct
import zlib

import torch

from ..core import checks, entry
from ..core.layout import spread_rows
_MASK61 = (1 << 61) - 1
_K1, _K2, _K3, _K4 = (0x9E3779B97F4A7C15 - (1 << 64), 0x632BE59BD9B4E019, 0x2545F4914F6CDD1D,
                      0xBF58476D1CE4E5B9 - (1 << 64))  # odd 64-bit mixers, as int64

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
    if where is not None:  # (a mask of any dtype: nonzero selects)
        h = torch.where(where.reshape(-1) != 0, h, torch.zeros((), dtype=torch.int64, device=h.device))
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


def _parts(options):
    """fingerprint's host part (an int) and its tensors' (tensor, position) terms."""
    text, numbers_at, tensors_at = [], [], []
    for o in _flatten(options):
        if isinstance(o, torch.Tensor):
            tensors_at.append((o, len(text)))
            text.append("#" if o.numel() == 1 else f"#{tuple(o.shape)}")
        elif isinstance(o, numbers.Real) and not isinstance(o, bool):
            numbers_at.append((len(text), float(o)))
            text.append("#")
        else:  # an object's address differs between processes (a torch.Generator, say): its type counts
            text.append(_ADDRESS.sub("", repr(o)))
    digest = zlib.crc32(repr(text).encode())
    for pos, v in numbers_at:  # the same words as a one-element tensor of that value would give
        digest = _wrap(digest + _mix_int(_bits_int(v), pos))
    return digest, tensors_at


def fingerprint(options):
    """The options as one stable int (the same on every process, unlike hash()), compared BY VALUE:
    every number (int, float, numpy scalar, a tensor of one element) counts as its float64 value, so 1,
    1.0 and tensor(1.0) are one option; a config (a dataclass) counts by its fields; anything else by
    its repr (without an object's address). With a tensor among them: a 0-d int64 tensor on its device;
    the numbers are hashed on the host, the tensors where they live (no host read, no copy to the device).
    (The torch form; fingerprint_field defers the tensors' terms to the agreement's row.)"""
    field = fingerprint_field(options)
    return field if isinstance(field, int) else field.value()


def fingerprint_field(options):
    """fingerprint(options) as an agreement field: an int, or with tensors among the options a Digest
    formed in the row (equal to fingerprint's value)."""
    digest, tensors_at = _parts(options)
    if not tensors_at:
        return _wrap(digest) & _MASK61
    return Digest("fingerprint", _wrap(digest) & _MASK61, tensors_at)


def _mix_int(x, pos):
    """_mix of one Python int word at position pos, wrapping as int64 does."""
    x = _wrap(x * _K1 + pos * _K2)
    x = _wrap((x ^ (x >> 31)) * _K4)
    return x ^ (x >> 29)


def _bits_int(v):
    """_float_bits of one Python float, as an int."""
    v = 0.0 if v == 0.0 else float("nan") if v != v else v
    return struct.unpack("<q", struct.pack("<d", v))[0]


def _wrap(x):
    """A Python int as the int64 it wraps to."""
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


PACKED_T = 1 << 62  # token_digest's row length in the packed form: every token in row 0


def _given_ids(b):
    """The ids as the caller gave them (flat), where the Batch keeps them."""
    return b.given["ids"] if b.given else b.ids


def token_row_length(b):
    """token_digest's row length T (a token's row: its position // T): the padded rows', or PACKED_T (the
    packed form's completions are compared in cu_seqlens' own field, not made per token)."""
    return PACKED_T if b.packed else b.tok_shape[1]


def token_digest(b):
    """(counted tokens, checksum of ids, mask and padded rows mod 2**61, largest counted id) of a Batch as
    0-d int64 tensors on its device: a few elementwise passes over N, no host read. The ids as given (a
    malformed cu_seqlens unvalidated does not change them here)."""
    ids, counted = _given_ids(b).long(), b.counted
    if ids.numel() == 0:
        zero = torch.zeros((), dtype=torch.int64, device=ids.device)
        return zero, zero, zero - 1
    pos = torch.arange(ids.numel(), device=ids.device)
    x = _mix(ids + (pos // token_row_length(b)) * _K3, pos)  # wraps mod 2**64
    zero = torch.zeros((), dtype=torch.int64, device=ids.device)
    checksum = torch.where(counted, x, zero).sum() & _MASK61
    top = torch.where(counted, ids, zero - 1).max()
    return counted.sum(), checksum, top


# What the ranks of a vocabulary-parallel group must pass alike besides the tokens (spec 12), each
# compared by a checksum of its values (per-token inputs at counted tokens; None counts as absent).
INPUTS = ("cu_seqlens and max_seqlen", "advantages", "old_logps", "ref_logps", "lam", "n_conf",
          "rollout_is_weights", "rollout_logps", "temperature (per token)")
_ABSENT = 1
_COMPUTED = 2  # lam or n_conf computed in the call (from the inputs compared: no values to read before the row)
_MAX_SEQLEN_AT = 1 << 40  # the position of max_seqlen's word in the cu_seqlens field


def input_digests(b):
    """The checksums of INPUTS for a Batch, in that order (Digest fields, _ABSENT or _COMPUTED); nothing is
    launched before the row is made. cu_seqlens and the advantages as given; max_seqlen (None: -1) as the
    cu_seqlens field's constant word; per-token inputs at the counted tokens, per-completion rollout weights
    and temperatures too (their spread's checksum: the same values per token or per completion agree)."""
    cu, given = _ABSENT, b.given or {}
    if given.get("cu_seqlens") is not None:
        cu = Digest("values", _mix_int(-1 if b.max_seqlen is None else b.max_seqlen, _MAX_SEQLEN_AT) & _MASK61,
                    (given["cu_seqlens"], None))
    made = () if b.conflicts is None else (b.conflicts.lam, b.conflicts.n_conf)  # (deferred: not yet made)
    whole = [given["adv"] if "adv" in given else b.adv, None, None, None, b.n_conf, None, None, None]
    # (per completion: rollout weights and a temperature read at each token's completion, never spread)
    rw_rows = b.rollout_w_seq if not b.packed or b.B else None
    tau_rows = b.tau if b.tau_per_row else None
    per_row = [None, None, None, None, None, rw_rows, None, tau_rows]
    counted = [None, b.old, b.ref, b.lam, None, None if rw_rows is not None else b.rollout_w, b.rollout_logps,
               None if tau_rows is not None else b.tau]
    out = [cu]
    for x, y, r in zip(whole, counted, per_row):
        if any(x is t or y is t for t in made):  # (lam, n_conf computed: from the ids, mask, advantages compared)
            out.append(_COMPUTED)
        elif r is not None:
            out.append(Digest("rows", 0, (r, b.mask, b.seq_rows)))
        elif x is not None:
            out.append(Digest.values(x))
        elif y is not None:
            out.append(Digest.values(y, b.mask))  # (the mask as given; None: every token counts)
        else:
            out.append(_ABSENT)
    return out


def token_fields(b):
    """token_digest(b) as three agreement fields, formed in the row (one kernel where it can)."""
    return [Digest("tokens", 0, b), Digest("filled", 0, None), Digest("filled", 0, None)]


class Digest:
    """An agreement field formed when the row is made (nothing launched before, none for a rank that
    failed): `const` plus (mod 2**61), kind 'values', values_digest(x, where) (terms (x, where)); 'fingerprint',
    each tensor option's word at its position (terms [(t, pos)]); 'rows', values_digest of x (one per
    completion) spread on the tokens, at where (terms (x, where, rows), rows a Batch's seq_rows: T, or
    (cu_seqlens, N) packed); 'tokens', token_digest in three slots (terms: the Batch; the next two 'filled'). By the
    kernels of kernels/digest_triton (write_row: the whole row in one launch) where the tensors live on the
    row's device and Triton runs there, else by the torch forms above (`write`; bitwise equal)."""
    __slots__ = ("kind", "const", "terms")

    def __init__(self, kind, const, terms):
        self.kind, self.const, self.terms = kind, const, terms

    @classmethod
    def values(cls, x, where=None):
        return cls("values", 0, (x, where))

    def _tensors(self):
        if self.kind == "rows" and isinstance(self.terms[2], tuple):
            return [t for t in self.terms[:2] + self.terms[2][:1] if t is not None]
        if self.kind in ("values", "rows"):
            return [t for t in self.terms[:2] if t is not None]
        if self.kind == "fingerprint":
            return [t for t, _ in self.terms]
        if self.kind == "tokens":
            b = self.terms
            return [_given_ids(b)] + ([] if b.mask is None else [b.mask])
        return []

    def write(self, row, slot, const=True):
        """The torch form's value into row[slot:] (write_row forms the kernels' in one launch; const False: the
        terms alone, the constant left out)."""
        if self.kind == "filled":
            return
        value = torch.stack(list(self.value())) if self.kind == "tokens" else self.value(const).reshape(1)
        row[slot:slot + value.numel()] = value.to(row.device)

    def value(self, const=True):
        """The torch form's value (0-d int64 tensors; 'tokens': three); const False: the terms alone."""
        c = self.const if const else 0
        if self.kind == "values":
            return (values_digest(*self.terms) + c) & _MASK61
        if self.kind == "rows":
            x, where, rows = self.terms
            return (values_digest(spread_rows(x.reshape(-1), rows), where) + c) & _MASK61
        if self.kind == "tokens":
            return token_digest(self.terms)
        digest = c
        for t, pos in self.terms:
            digest = digest + _mix(_float_bits(t.reshape(())) if t.numel() == 1 else values_digest(t), pos)
        return digest & _MASK61


def write_row(fields, row, row_checks=(), head=None):
    """Every Digest among `fields` formed into `row` (field i at slot i + 1): by the kernels in one launch
    (digest_triton.row_terms; one more per SLOTS terms, and per tensor option of a fingerprint after its first,
    added into its slot after), the others by their torch forms. row_checks (core.host_read.RowCheck): their
    predicates in the same launch, a failure setting row[0] = 1 (a ValueError), by their torch forms where the
    kernels do not run. head (agree's row): False, the Digests' terms alone (no constant) into a row written
    already; or row_launches' head: the first launch writes the row whole first (a launch even with no term)."""
    from ..kernels import digest_triton
    jobs, tokens, after, torch_forms = _row_work(fields, row, row_checks, head is None)
    for form in torch_forms if not head else ():
        form()
    if jobs or tokens is not None or head:
        digest_triton.row_terms(row, [tuple(j) for j in jobs], tokens, head or None)
        for form in torch_forms if head else ():
            form()
        for slot, t, _, size, pos, _, *_ in after:
            digest_triton.terms(row, slot, t, None, size, pos)


def row_launch(fields, row, row_checks=(), head=None):
    """write_row's whole work as the one program of digest_triton._row_body: (its arguments after the row, its
    switches) for another launch to run (vp_first_triton); None where it takes more. Nothing is launched."""
    from ..kernels import digest_triton
    jobs, tokens, after, torch_forms = _row_work(fields, row, row_checks, head is None)
    if torch_forms or after:
        return None
    launches = digest_triton.row_launches(row, [tuple(j) for j in jobs], tokens, head)
    return launches[0] if len(launches) == 1 else None


def _row_work(fields, row, row_checks, const=True):
    """write_row's work: (the kernels' jobs, the tokens' job, later options, the torch forms), nothing run."""
    from ..kernels import digest_triton
    jobs, tokens, after, torch_forms = [], None, [], []
    for i, f in enumerate(fields):
        if not isinstance(f, Digest) or f.kind == "filled":
            continue
        if not kernels_on(row.device, f._tensors()):
            torch_forms.append(lambda f=f, i=i: f.write(row, i + 1, const))
        elif f.kind == "values":
            x, where = f.terms
            jobs.append([i + 1, x, where, _size_term(x), None, None])
        elif f.kind == "rows":
            x, where, rows = f.terms
            n = rows[1] if isinstance(rows, tuple) else x.numel() * rows
            jobs.append([i + 1, x, where, (n * _K3) % _MASK61, None, None, rows])
        elif f.kind == "fingerprint":
            for k, (t, pos) in enumerate(f.terms):
                (after if k else jobs).append([i + 1, t, None, _size_term(t), pos, None])
        else:
            b = f.terms
            tokens = (i + 1, _given_ids(b), b.mask, token_row_length(b))
    for c in row_checks:
        if not kernels_on(row.device, [c.x] + ([] if c.where is None else [c.where])):
            torch_forms.append(lambda c=c: row[:1].masked_fill_(c.torch_bad().any().to(row.device).reshape(1), 1))
            continue
        same = (c.kind not in digest_triton.BOUNDED and c.row_length is None  # (a check on rows: a term of its own)
                and next((j for j in jobs if j[4] is None and j[5] is None and len(j) == 6 and _same(j[1], c.x)
                          and _same(j[2], c.where)), None))
        if same:
            same[5] = c
        else:
            jobs.append([0, c.x, c.where, 0, None, c])
    return jobs, tokens, after, torch_forms


def _same(a, b):
    """Whether two tensors (or None) read as the same flat values."""
    if a is None or b is None:
        return a is None and b is None
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.numel() == b.numel()
            and a.reshape(-1).stride() == b.reshape(-1).stride() == (1,))


def _size_term(x):
    return (x.numel() * _K3) % _MASK61


def kernels_on(device, tensors):
    """Whether the digest kernels run for tensors, into a row on `device`."""
    if not entry.kernels_allowed() or any(t.device != device for t in tensors):  # (backend='torch': none)
        return False
    from ..kernels import dispatch
    return dispatch.triton_runs_on(device)
