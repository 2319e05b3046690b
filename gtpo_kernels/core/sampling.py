"""Arguments of the sampler's distribution (spec 13): temperature per token, the kept sets given as
`sampling_mask = (token_ids, offsets)`, and the truncation rules `top_k`, `top_p`, `min_p`.

Shapes and Python numbers are always checked (no device read). What only the tensors' values can show
(a temperature <= 0, an id out of range, malformed offsets ...) is one device-side predicate per idea,
read on the host once when validating (a clear error naming the argument and the token) and otherwise
returned as a per-token `invalid` flag, with which the caller makes that token's outputs NaN.

Tokens are numbered in the packed order of the counted tokens (padded form: row-major over counted
positions), M of them; per-token tensors of the batch are flat, n = B * T (padded) or N (packed).
"""
from __future__ import annotations

import math
import numbers

import torch

from .checks import _check, _rounded, _selection, check_int_tensor, check_on_device, check_tensor
from .layout import spread_rows


def _is_number(x):
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def per_token(name, x, B, T, n, device, cu_seqlens=None, spread=True):
    """x as a flat (n,) tensor on `device`, or the number itself: a number; per completion (B,) or
    (B, 1); per token (B, T) (padded) or (n,) (packed, n = N, with cu_seqlens). A shape that could mean
    both (packed with B == N) is refused. spread=False: one per completion is returned as (B,), not
    spread to the tokens (the caller's kernel reads it per token)."""
    if _is_number(x):
        return x
    check_tensor(name, x)
    x = x.detach().to(device)
    shape = tuple(x.shape)
    packed = cu_seqlens is not None
    if packed and B == n and shape == (n,):
        raise ValueError(f"{name} of shape {shape} is ambiguous when B == N = {n} (per completion or per "
                         f"token): pass a number, or one per completion as a ({n}, 1) tensor (a ({n},) tensor "
                         f"is per token only where the batch's B != N)")
    if not packed and shape == (B, T):
        return x.reshape(n)
    if packed and shape == (n,):
        return x
    if shape in ((B,), (B, 1)):
        x = x.reshape(B)
        if not spread:
            return x
        return spread_rows(x, (cu_seqlens, n) if packed else T)
    want = f"({n},) (per token, packed)" if packed else f"({B}, {T}) (per token)"
    raise ValueError(f"{name} must be a number, a tensor per completion ({B},) or ({B}, 1), or {want}; "
                     f"got shape {shape}")


def _first(bad):
    return int(bad.nonzero()[0, 0])


def _refuse(name, bad, values, want, counted=None):
    """Host read (validating): raise naming the first counted token whose value is out of range."""
    if counted is not None:
        bad = bad & counted

    def fail():
        k = _first(bad)
        raise ValueError(f"{name} must be {want}; flat token position {k} holds {values[k].item()!r}")
    check_on_device(bad.any(), fail)  # read now, or with the call's other checks (checks.one_host_read)


def check_temperature(temperature, B, T, n, device, cu_seqlens=None, counted=None, validate=True,
                      dtype=torch.float32, flag=True, spread=True, where=None):
    """tau (spec 13): a finite number > 0, or a tensor (per completion / per token) of them. counted: the
    tokens checked, a bool tensor or (with `where`, the mask as given) a callable making it (checks._selection).
    Returns (tau: a number or a `dtype` (n,) tensor, invalid: None or an (n,) bool tensor; None too when
    validating (an invalid tau at a counted token raises, formed by a process group's agreement row) or
    neither `validate` nor `flag`: the caller's kernels flag such a tau). spread=False (validating, or with
    neither validate nor flag): one per completion stays (B,) (per_token), checked where a counted token of
    its completion reads it."""
    if _is_number(temperature):
        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be finite and > 0, got {temperature!r}")
        return float(temperature), None
    if isinstance(temperature, torch.Tensor) and not temperature.dtype.is_floating_point:
        raise TypeError(f"temperature must be a number or a floating-point tensor, got {temperature.dtype}")
    tau = per_token("temperature", temperature, B, T, n, device, cu_seqlens, spread or flag and not validate).to(dtype)
    rows = None if spread or tuple(temperature.shape) not in ((B,), (B, 1)) else T if cu_seqlens is None else (
        cu_seqlens, n)  # (one per completion, kept: read at each token's, as Batch.seq_rows)
    if not (validate or flag):
        return tau, None
    def invalid():  # (a float32 tau below 2.9e-39: 1 / tau is not finite)
        return ~(torch.isfinite(tau) & (tau > 0) & torch.isfinite(tau.reciprocal()))
    if validate:
        made, where = _selection(counted, where)

        def bad():
            out = at_tokens(invalid())
            return out if counted is None else out & made()

        def at_tokens(x):  # (one per completion: spread on the tokens)
            return x if rows is None else spread_rows(x, rows)

        def fail():  # (none found here: a subnormal tau the device's division flushed to 0)
            k = _first(bad()) if bool(bad().any()) else None
            at = "a subnormal value" if k is None else f"flat token position {k} holds {at_tokens(tau)[k].item()!r}"
            raise ValueError(f"temperature must be finite and > 0, with 1 / tau finite, at counted tokens; {at}")
        _check(tau, where, "positive", None, bad, fail, rows)
        return tau, None
    return tau, invalid()


_TOP_K_MAX = 2 ** 31 - 1
try:  # a NumPy bool is no int either
    from numpy import bool_ as np_bool
except ImportError:  # pragma: no cover
    np_bool = bool
_RULES = {  # name: (test of a valid value, what is expected, integer?); vLLM's ranges (top_k -1: off, as 0)
    "top_k": (lambda x: x >= -1, "an integer >= -1 (0 or -1: off)", True),
    "top_p": (lambda x: (x > 0) & (x <= 1), "in (0, 1] (1: off)", False),
    "min_p": (lambda x: (x >= 0) & (x <= 1), "in [0, 1] (0: off; 1: the entries tied at the maximum)", False),
}


def sampler_rules(temperature, top_k=None, top_p=None, min_p=None, name=str) -> dict:
    """A trainer's sampler settings (Python numbers) as the replay keywords {temperature, top_k, top_p,
    min_p}, a rule that is off None: top_k None / 0 / -1, top_p None / 1, min_p None / 0. temperature
    finite and > 0, top_k an integer (5.0 too), the rest in _RULES' ranges, bools refused; a bad value
    raises ValueError naming the field as name(field) spells it."""
    t = temperature
    if not (_is_number(t) and math.isfinite(t) and t > 0):
        raise ValueError(f"{name('temperature')} must be finite and > 0 (the sampler's temperature), got {t!r}")
    out = dict(temperature=float(t))
    for f, x, off in (("top_k", top_k, (0, -1)), ("top_p", top_p, (1,)), ("min_p", min_p, (0,))):
        ok, want, integer = _RULES[f]
        if x is not None and not (_is_number(x) and math.isfinite(x) and (not integer or x == int(x)) and ok(x)):
            raise ValueError(f"{name(f)} must be {want}, got {x!r}")
        out[f] = None if x is None or x in off else int(x) if integer else float(x)
    return out


def check_rule(name, x, B, T, n, device, cu_seqlens=None, counted=None, validate=True, dtype=torch.float32,
               flag=True):
    """One of top_k, top_p, min_p: None, a number, or a tensor per completion / per token.
    Returns (None | number | (n,) tensor (int64 for top_k, `dtype` else), invalid None | (n,) bool; None too
    when neither `validate` nor `flag`: the caller's kernel flags such a value)."""
    ok, want, integer = _RULES[name]
    if x is None:
        return None, None
    if isinstance(x, (bool, np_bool)):
        raise TypeError(f"{name} must be {'an int' if integer else 'a float'} or a tensor of them, got {x!r}")
    if _is_number(x):
        if integer and not isinstance(x, numbers.Integral):
            raise TypeError(f"{name} must be an int or an integer tensor, got {x!r}")
        if not (math.isfinite(x) and ok(x)):
            raise ValueError(f"{name} must be {want}, got {x!r}")
        # a top_k past any vocabulary (ids lie below 2**31) keeps every entry, as one of 2**31 - 1 does (it
        # fits every kernel's argument); a threshold in the logits' dtype, as a tensor's (every backend alike;
        # checked in float64: one that rounds to its range's open end keeps what the rules keep there)
        return (min(int(x), _TOP_K_MAX) if integer else _rounded(float(x), dtype)), None
    check_tensor(name, x)
    if integer:
        check_int_tensor(name, x)
    elif not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a number or a floating-point tensor, got {x.dtype}")
    v = per_token(name, x, B, T, n, device, cu_seqlens)
    v = v.long() if integer else v.to(dtype)  # the logits' dtype: a float64 cut is never rounded to float32
    if not (validate or flag):
        return v, None
    bad = ~ok(v) if integer else ~(torch.isfinite(v) & ok(v))
    if validate:
        _refuse(name, bad, v, want + " at counted tokens", counted)
    return v, bad


def check_exclusive(sampling_mask, top_k, top_p, min_p):
    """A recorded mask and the rules that would rebuild it are not given together (spec 13)."""
    given = [k for k, v in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p)) if v is not None]
    if sampling_mask is not None and given:
        raise ValueError(f"sampling_mask is given together with {', '.join(given)}: pass the recorded kept "
                         f"sets (sampling_mask) or the rules that rebuild them, not both")


def unpack_mask(sampling_mask, M, device):
    """(token_ids, offsets) as int64 tensors on `device`; types and shapes checked (no device read):
    offsets (M + 1,) for the M counted tokens (M None: any length >= 1), token_ids 1-D."""
    if not (isinstance(sampling_mask, (tuple, list)) and len(sampling_mask) == 2):
        raise TypeError("sampling_mask must be a pair (token_ids, offsets) of integer tensors (the "
                        f"compressed layout of vLLM's SamplingMask), got {type(sampling_mask).__name__}")
    token_ids, offsets = sampling_mask
    check_int_tensor("sampling_mask.token_ids", token_ids)
    check_int_tensor("sampling_mask.offsets", offsets)
    if offsets.dim() != 1 or (offsets.numel() != M + 1 if M is not None else offsets.numel() < 1):
        want = "(M + 1,), one set per counted token" if M is None else \
            f"(M + 1,) = ({M + 1},), one set per counted token (M = {M})"
        raise ValueError(f"sampling_mask.offsets must have shape {want}, got {tuple(offsets.shape)}")
    if token_ids.dim() != 1:
        raise ValueError(f"sampling_mask.token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
    # (stride 1, as the kernels read them: a strided int64 view is copied, a contiguous one is not)
    return (token_ids.to(device=device, dtype=torch.long).contiguous(),
            offsets.to(device=device, dtype=torch.long).contiguous())


def segment_of(offsets, K):
    """The token (0..M-1) each of the K kept entries belongs to, from offsets (M + 1,), without a host read
    (well defined, if meaningless, for malformed offsets)."""
    M = offsets.numel() - 1
    e = torch.arange(K, device=offsets.device)
    return torch.searchsorted(offsets[1:].contiguous(), e, right=True).clamp_(max=max(M - 1, 0))


def mask_problems(token_ids, offsets, y, V):
    """Device-side predicates of a sampling mask (no host read): (malformed: 0-d bool, offsets not
    non-decreasing from 0 to len(token_ids); per token (M,) int8 codes, 0 = fine: 1 an id outside
    [0, V), 2 an id repeated in the set, 4 the sampled token y (M,) not in its set)."""
    M, K = offsets.numel() - 1, token_ids.numel()
    malformed = (offsets[0] != 0) | (offsets[-1] != K) | (offsets[1:] < offsets[:-1]).any()
    code = torch.zeros(M, dtype=torch.int8, device=token_ids.device)
    if M == 0:
        return malformed, code
    seg = segment_of(offsets, K)
    out = (token_ids < 0) | (token_ids >= V)
    key = seg * max(V, 1) + token_ids.clamp(0, max(V - 1, 0))
    srt = torch.sort(key).values
    dup = torch.zeros(K, dtype=torch.bool, device=token_ids.device)
    dup[1:] = srt[1:] == srt[:-1]
    hit = (token_ids == y.long()[seg]).to(torch.int32)
    hits = torch.zeros(M, dtype=torch.int32, device=token_ids.device).index_add_(0, seg, hit)
    code |= torch.zeros(M, dtype=torch.int8, device=code.device).index_add_(0, seg, out.to(torch.int8)).clamp_(max=1)
    dup_tok = torch.zeros(M, dtype=torch.int8, device=code.device).index_add_(0, srt // max(V, 1), dup.to(torch.int8))
    code |= dup_tok.clamp_(max=1) * 2
    code |= (hits == 0).to(torch.int8) * 4
    return malformed, code


_WHAT = {1: "holds an id outside [0, V) = [0, {V})", 2: "repeats an id",
         4: "does not contain the sampled token {y}"}


def check_sampling_mask(sampling_mask, y, V, validate=True, positions=None):
    """The recorded kept sets (spec 13) for the M counted tokens whose sampled ids are y (M,).
    Returns (token_ids int64, offsets int64, invalid (M,) bool): validating, any problem raises a
    ValueError naming the token (its flat position when `positions` (M,) is given); unvalidated,
    malformed offsets make every token invalid, the other problems the token concerned."""
    token_ids, offsets = unpack_mask(sampling_mask, y.numel(), y.device)
    malformed, code = mask_problems(token_ids, offsets, y, V)
    if validate:
        if bool(malformed):
            down = offsets[1:] < offsets[:-1]
            i = _first(down) + 1 if bool(down.any()) else None  # the first index where it decreases
            raise ValueError(f"sampling_mask.offsets must be non-decreasing from 0 to len(token_ids) = "
                             f"{token_ids.numel()}, got first {int(offsets[0])}, last {int(offsets[-1])}"
                             + ("" if i is None else f", decreasing at index {i}: offsets[{i - 1}] = "
                                f"{int(offsets[i - 1])}, offsets[{i}] = {int(offsets[i])}"))
        if bool((code != 0).any()):
            m = _first(code != 0)
            c = int(code[m])
            what = _WHAT[1 if c & 1 else (2 if c & 2 else 4)].format(V=V, y=int(y[m]))
            where = f"counted token {m}" + ("" if positions is None else f" (flat position {int(positions[m])})")
            raise ValueError(f"sampling_mask: the kept set of {where} {what}; "
                             f"{int((code != 0).sum())} set(s) are invalid")
    return token_ids, offsets, (code != 0) | malformed


def flat_offsets(offsets, counted):
    """Offsets (n + 1,) over the n flat tokens of the batch from the (M + 1,) offsets over the counted
    ones: an uncounted token gets an empty set, so kernels can run over the flat tokens (no host read for
    M). Also returns a 0-d bool: offsets does not have M + 1 entries (then every token is invalid)."""
    c = counted.reshape(-1).long()
    excl = torch.cat([c.new_zeros(1), torch.cumsum(c, 0)])  # counted tokens before each flat token
    last = offsets.numel() - 1
    return offsets.long()[excl.clamp(max=last)], excl[-1] != last


def check_sampling_mask_flat(sampling_mask, ids, counted, V, validate=True):
    """check_sampling_mask in the flat layout the kernels read without a host read: ids, counted (n,) of
    the batch; returns (token_ids int64, flat offsets (n + 1,), invalid (n,) bool, False at uncounted
    tokens unless the mask is malformed). Validating, the errors are check_sampling_mask's (host reads;
    the token named by its flat position); unvalidated, a wrong number of sets makes every token
    invalid."""
    counted = counted.reshape(-1).bool()
    if validate:
        pos = counted.nonzero().squeeze(1)
        token_ids, offsets, _ = check_sampling_mask(sampling_mask, ids.reshape(-1)[pos], V, True, pos)
    else:
        token_ids, offsets = unpack_mask(sampling_mask, None, ids.device)
    flat, mismatch = flat_offsets(offsets, counted)
    malformed, code = mask_problems(token_ids, flat, ids.reshape(-1), V)
    broken = malformed | mismatch  # every set then empty (as kernels/set_check_triton makes them), every token NaN
    return token_ids, torch.where(broken, 0, flat), ((code != 0) & counted) | broken
