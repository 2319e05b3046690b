"""The sampler's distribution on logits (spec 13): each counted token's log-prob and entropy over its
kept set, from the sets the engine recorded (`sampling_mask`) or rebuilt from `top_k` / `top_p` / `min_p`,
with the call's temperature. The values are differentiable w.r.t. the logits (exactly 0 outside the sets)
and feed the loss as log-probs computed elsewhere do (loss.logps_loss)."""
from __future__ import annotations

import math

import torch

from ..core import checks
from ..core.flags import BAD_NONFINITE
from ..core.layout import float_dtype_for
from ..core.sampling import check_exclusive, check_rule, check_sampling_mask_flat
from ..kernels import replay as rp
from ..kernels.kept_set_ops import as_rule, kept_sets_flat


def requested(sampling_mask, top_k, top_p, min_p):
    """Whether a call replays a kept set (the mask and the rules are exclusive: refused together)."""
    check_exclusive(sampling_mask, top_k, top_p, min_p)
    return sampling_mask is not None or any(x is not None for x in (top_k, top_p, min_p))


def check_rules(b, top_k, top_p, min_p, validate, dtype=None, in_kernels=False):
    """top_k, top_p, min_p as the rebuild takes them: None, a number or a per-token (n,) tensor, each
    with its invalid tokens (n,) or None (refused when validating: call inside checks.one_host_read).
    Tensor thresholds in `dtype`, the logits' float dtype (default: b.logits3's), never rounded below it.
    in_kernels: a tensor's values are not checked here and the batch's derived fields are not formed (the
    kernel of the kept sets flags an invalid value, into the status word when validating, whose failure
    runs these checks on the host to name it: kernels/kept_rule_triton.py)."""
    if dtype is None:
        dtype = torch.float32 if b.logits3 is None else float_dtype_for(b.logits3)
    T = None if b.packed else b.tok_shape[1]
    n = math.prod(b.tok_shape)
    # (recorded sets only: no rule, and none of the batch's derived fields formed for them)
    unchecked = in_kernels
    dev = b.given["ids"].device

    def rule(name, x):
        if x is None:
            return None, None
        if not isinstance(x, torch.Tensor):  # a number: checked on the host alone
            return check_rule(name, x, b.B, T, n, dev, validate=validate, dtype=dtype)
        if unchecked:  # (malformed cu_seqlens: the kernels make everything NaN)
            return check_rule(name, x, b.B, T, n, dev, b.given["cu_seqlens"], None, False, dtype, flag=False)
        return check_rule(name, x, b.B, T, n, dev, b.cu_seqlens, b.counted, validate, dtype)
    out = [rule(name, x) for name, x in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p))]
    return [v for v, _ in out], [bad for _, bad in out]


def _any(*flags):
    out = None
    for f in flags:
        if f is not None:
            out = f if out is None else out | f
    return out


def at(x, pos):
    """A number or a 0-d tensor (one value for every token: a schedule) as it is, a per-token (n,) tensor at
    the positions `pos`."""
    return x[pos] if isinstance(x, torch.Tensor) and x.dim() else x


def replayed(b, tau, sampling_mask, rules, backend, validate):
    """(logp, entropy, flags, metrics): logp and entropy (n,) over each counted token's kept set
    (differentiable, 0 at uncounted tokens, NaN where invalid), the int8 flags (n,) of the replay kernel
    (a row with NaN or +inf, or an invalid set or value when unvalidated) and the metrics of spec 13.
    tau: a number or (n,) tensor (NaN where invalid); rules: check_rules' output."""
    logits3, V = b.logits3, b.logits3.shape[-1]
    (top_k, top_p, min_p), rule_bad = rules
    if sampling_mask is not None:
        with checks.one_host_read():
            token_ids, offsets, invalid = check_sampling_mask_flat(sampling_mask, b.ids, b.counted, V, validate)
        rows_b, rows_t = rp.flat_rows(b.tok_shape, b.logits_start, logits3.device)
        logp, ent, flags = rp.replay_logprobs(logits3, rows_b, rows_t, b.ids, tau, token_ids, offsets, invalid,
                                              backend=backend, counted=b.counted)
        flags = torch.where(b.counted, flags, torch.zeros_like(flags))
        return logp, ent, flags, rp.replay_metrics(offsets, M=b.counted.sum(), bad=_flagged(flags, invalid, b))
    # the sets rebuilt for every flat token (an uncounted one's is empty): one custom op, so that the call
    # traces whole (their total size is the one size known only after it runs)
    acc = float_dtype_for(logits3)
    rows_b, rows_t = rp.flat_rows(b.tok_shape, b.logits_start, logits3.device)
    rule = [as_rule(x, dt, logits3) for x, dt in ((tau, acc), (top_k, torch.long), (top_p, acc), (min_p, acc))]
    sets = kept_sets_flat(logits3.detach(), rows_b, rows_t, b.ids, b.counted, *rule)  # the sets: no gradient
    token_ids, offsets, restored, nonfinite, mass = sets
    invalid = _any(nonfinite, *rule_bad)
    logp, ent, flags = rp.replay_logprobs(logits3, rows_b, rows_t, b.ids, tau, token_ids, offsets, invalid,
                                          backend=backend, counted=b.counted)
    flags = flags | nonfinite_flag(nonfinite)  # a row with NaN / +inf: invalid input, as without kept sets
    bad = _flagged(flags, invalid, b)
    return logp, ent, flags, rp.replay_metrics(offsets, restored, mass, M=b.counted.sum(), bad=bad)


def _flagged(flags, invalid, b):
    """The counted tokens whose outputs are NaN (flagged, or invalid unvalidated): the metrics' poison."""
    return _any(flags != 0, None if invalid is None else invalid.reshape(-1)) & b.counted


def nonfinite_flag(nonfinite):
    """The flag (core/flags) of rows the rebuild found holding NaN or +inf (their sets mean nothing): refused
    when validating (checks.raise_on_flags names the row), NaN outputs otherwise."""
    return torch.where(nonfinite, BAD_NONFINITE, 0).to(torch.int8)
