"""The sampler's distribution on logits (spec 13): each counted token's log-prob and entropy over its
kept set, from the sets the engine recorded (`sampling_mask`) or rebuilt from `top_k` / `top_p` / `min_p`,
with the call's temperature. The values are differentiable w.r.t. the logits (exactly 0 outside the sets)
and feed the loss as log-probs computed elsewhere do (loss.logps_loss)."""
from __future__ import annotations

import torch

from ..core import checks
from ..core.layout import float_dtype_for
from ..core.sampling import check_exclusive, check_rule, check_sampling_mask_flat
from ..kernels import replay as rp
from ..kernels.kept_set import kept_sets


def requested(sampling_mask, top_k, top_p, min_p):
    """Whether a call replays a kept set (the mask and the rules are exclusive: refused together)."""
    check_exclusive(sampling_mask, top_k, top_p, min_p)
    return sampling_mask is not None or any(x is not None for x in (top_k, top_p, min_p))


def check_rules(b, top_k, top_p, min_p, validate, dtype=None):
    """top_k, top_p, min_p as the rebuild takes them: None, a number or a per-token (n,) tensor, each
    with its invalid tokens (n,) or None (refused when validating: call inside checks.one_host_read).
    Tensor thresholds in `dtype`, the logits' float dtype (default: b.logits3's), never rounded below it."""
    if dtype is None:
        dtype = torch.float32 if b.logits3 is None else float_dtype_for(b.logits3)
    T = None if b.packed else b.tok_shape[1]
    n = b.counted.numel()
    out = [check_rule(name, x, b.B, T, n, b.counted.device, b.cu_seqlens, b.counted, validate, dtype)
           for name, x in (("top_k", top_k), ("top_p", top_p), ("min_p", min_p))]
    return [v for v, _ in out], [bad for _, bad in out]


def _any(*flags):
    out = None
    for f in flags:
        if f is not None:
            out = f if out is None else out | f
    return out


def at(x, pos):
    """A number as it is, a per-token (n,) tensor at the positions `pos`."""
    return x[pos] if isinstance(x, torch.Tensor) else x


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
        metrics = rp.replay_metrics(offsets, M=b.counted.sum())
        return logp, ent, torch.where(b.counted, flags, torch.zeros_like(flags)), metrics
    pos = b.counted.reshape(-1).nonzero().squeeze(1)  # one host read: the number of counted tokens
    rows_b, rows_t = rp.counted_rows(b.counted, b.tok_shape, b.logits_start)
    y = b.ids[pos]
    tau_m = at(tau, pos)
    token_ids, offsets, restored, nonfinite, mass = kept_sets(logits3, rows_b, rows_t, y, tau_m, at(top_k, pos),
                                                              at(top_p, pos), at(min_p, pos))
    bad = _any(*(None if x is None else x[pos] for x in rule_bad))
    invalid = nonfinite if bad is None else nonfinite | bad
    lp_m, ent_m, fl_m = rp.replay_logprobs(logits3, rows_b, rows_t, y, tau_m, token_ids, offsets, invalid,
                                           backend=backend)
    n = b.counted.numel()
    zero = torch.zeros(n, dtype=lp_m.dtype, device=lp_m.device)
    logp, ent = zero.scatter(0, pos, lp_m), zero.scatter(0, pos, ent_m)
    flags = torch.zeros(n, dtype=fl_m.dtype, device=fl_m.device).scatter(0, pos, fl_m)
    return logp, ent, flags, rp.replay_metrics(offsets, restored, mass)
