"""Replay over the kept sets (spec 13) as one differentiable call: which implementation runs
(replay_triton | replay_torch) and the autograd rule tying the forward to the backward.

    logp, H, flags = replay_logprobs(logits3, rows_b, rows_t, y, tau, token_ids, offsets)

is, for counted token m predicted by row (rows_b[m], rows_t[m]) with kept set K_m = token_ids[offsets[m]:
offsets[m+1]], in one line of torch:

    s = z'[rows_b[m], rows_t[m], K_m] / tau[m];  logp = log_softmax(s)[K_m.index(y[m])];  H = -(p * log p).sum()

with z' the logit after scale and soft-cap. The gradient w.r.t. the raw logits is exactly 0 outside the
kept sets. Tokens whose set or row is invalid (the forward's flags, or `invalid` from
core.sampling's unvalidated checks) get NaN in logp, H and their gradient, never a finite number.
Saved for backward: the logits by reference and O(M) numbers per token plus the kept ids.
"""
from __future__ import annotations

import torch

from ..core.flags import nan_where
from .dispatch import check_transforms, resolve_backend


def _impl(backend):
    if backend == "triton":
        from . import replay_triton as impl
    else:
        from . import replay_torch as impl
    return impl


def counted_rows(counted, tok_shape, logits_start=0):
    """(rows_b, rows_t) of the counted tokens in the packed order: padded tok_shape (B, T) -> row
    (i, logits_start + t) of a (B, T_l, V) view; packed (N,) -> row (0, logits_start + k) of a (1, T_l, V)
    view. One host read (the number of counted tokens)."""
    k = counted.reshape(-1).nonzero().squeeze(1)
    if len(tok_shape) == 2:
        T = tok_shape[1]
        return k // T, k % T + logits_start
    return torch.zeros_like(k), k + logits_start


def flat_rows(tok_shape, logits_start, device):
    """(rows_b, rows_t) of every flat token (n,), counted or not, with no host read: padded (B, T) ->
    row (j // T, logits_start + j % T); packed (N,) -> row (0, logits_start + j)."""
    n = 1
    for d in tok_shape:
        n *= d
    j = torch.arange(n, device=device)
    if len(tok_shape) == 2:
        return j // tok_shape[1], j % tok_shape[1] + logits_start
    return torch.zeros_like(j), j + logits_start


def _nan_where(bad, x):
    return x.masked_fill(bad if x.dim() == 1 else bad[:, None], float("nan"))  # (one launch)


def finish(logp, ent, stats, flags, invalid=None, counted=None):
    """The forward's outputs as the callers see them: NaN (logp, H, stats) where the kernel flagged the
    token or `invalid` (M,) says so; with `counted` (flat layout), the uncounted tokens (empty sets) get
    0 and no flag."""
    if counted is not None:
        flags = torch.where(counted, flags, 0)
    bad = flags != 0
    if invalid is not None:
        bad = bad | invalid
    logp, ent, stats = _nan_where(bad, logp), _nan_where(bad, ent), _nan_where(bad, stats)
    if counted is not None:
        logp = torch.where(counted, logp, 0.0)
        ent = torch.where(counted, ent, 0.0)
    return logp, ent, stats, flags


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits3, rows_b, rows_t, y, tau, token_ids, offsets, invalid, counted, scale, softcap,
                backend):
        logp, ent, stats, flags = finish(*replay_values(logits3, rows_b, rows_t, y, tau, token_ids, offsets, scale,
                                                        softcap, backend), invalid, counted)
        ctx.save_for_backward(logits3, rows_b, rows_t, y, tau if isinstance(tau, torch.Tensor) else None,
                              token_ids, offsets, stats, ent)
        ctx.meta = (tau if not isinstance(tau, torch.Tensor) else None, scale, softcap, backend)
        ctx.mark_non_differentiable(flags)
        ctx.set_materialize_grads(False)
        return logp, ent, flags

    @staticmethod
    def backward(ctx, g_logp, g_ent, _g_flags):
        logits3, rows_b, rows_t, y, tau_t, token_ids, offsets, stats, ent = ctx.saved_tensors
        tau_n, scale, softcap, backend = ctx.meta
        if not ctx.needs_input_grad[0] or (g_logp is None and g_ent is None):
            return (None,) * 12
        c = torch.zeros_like(ent) if g_logp is None else g_logp.to(ent.dtype)
        e = None if g_ent is None else g_ent.to(ent.dtype)
        grad3 = replay_grad(logits3, rows_b, rows_t, y, tau_n if tau_t is None else tau_t, token_ids, offsets,
                            stats, ent, c, e, scale, softcap, backend)
        return (grad3,) + (None,) * 11


def resolved(backend, device, dtype):
    """The implementation that runs on logits of `dtype` on `device`: 'triton' or 'torch' ('reference'
    runs the torch one here)."""
    backend = resolve_backend(backend, device, dtype)
    return "torch" if backend == "reference" else backend


def replay_values(logits3, rows_b, rows_t, y, tau, token_ids, offsets, scale=1.0, softcap=None, backend="torch"):
    """The replay's forward without autograd and before `finish`: (logp, H, stats, flags) (M,), (M,),
    (M, 3), int8 (M,), nothing NaN'd yet (a caller over several tiles finishes them once). backend: resolved;
    logits3 with vocabulary stride 1 for 'triton'."""
    return _impl(backend).replay_fwd(logits3, rows_b, rows_t, y, tau, token_ids, offsets, scale, softcap)


def replay_grad(logits3, rows_b, rows_t, y, tau, token_ids, offsets, stats, ent, c, e, scale=1.0, softcap=None,
                backend="torch"):
    """dL/dz in logits3's shape, exactly 0 outside the kept sets, from the forward's stats and (finished)
    entropies and the upstream gradients c = dL/dlogp, e = dL/dH (M,) (e None: no entropy term)."""
    grad3 = torch.zeros_like(logits3)
    _impl(backend).replay_bwd(logits3, grad3, rows_b, rows_t, y, tau, token_ids, offsets, stats, ent, c, e, scale,
                              softcap)
    return grad3


def replay_logprobs(logits3, rows_b, rows_t, y, tau, token_ids, offsets, invalid=None, scale=1.0,
                    softcap=None, backend="auto", counted=None):
    """logits3 (B, T_l, V) raw logits (vocabulary stride 1 for 'triton'); rows_b, rows_t, y (M,) int:
    each token's logits row and sampled id; tau a number or (M,) tensor; token_ids (K,), offsets
    (M + 1,) int64, the kept sets; invalid None or (M,) bool. Returns logp (M,), entropy (M,) (float32,
    float64 for float64 logits; differentiable w.r.t. logits3) and the int8 flags (M,) of core/flags
    (nonzero: that token's outputs are NaN). The tokens are the counted ones (counted_rows), or, with
    `counted` (M,) bool, every flat token (flat_rows, core.sampling.flat_offsets: no host read), the
    uncounted ones with empty sets and outputs 0."""
    check_transforms(scale, softcap)
    backend = resolved(backend, logits3.device, logits3.dtype)
    if backend == "triton" and logits3.stride(-1) != 1:
        logits3 = logits3.contiguous()
    return _Replay.apply(logits3, rows_b, rows_t, y, tau, token_ids, offsets, invalid, counted, scale, softcap,
                         backend)


def kept_mass_from_logps(logp_full, logp_kept):
    """The full softmax's mass on each kept set, exp(LSE_K - LSE_V) = p^V_y / p^K_y: from the sampled token's
    log-prob over the whole vocabulary (a full-vocabulary pass, when one runs) and over its kept set. O(M)."""
    return torch.exp(logp_full.detach() - logp_kept.detach())


def replay_metrics(offsets, restored=None, kept_mass=None, M=None, bad=None):
    """metrics of spec 13 over the M counted tokens (0-d float64 tensors, no host read; the callers cast
    them to the call's dtype, so a float64 call's are float64-exact): mean_kept_size,
    replay_restored_frac (0 with a recorded mask) and kept_mass (when the per-token masses are given).
    M: the number of counted tokens (a tensor too) when `offsets` also spans uncounted ones (flat
    layout), else offsets' sets. bad: the tokens flagged (poisoned)."""
    n = (offsets.numel() - 1 if M is None else M)
    n = n.clamp(min=1) if isinstance(n, torch.Tensor) else max(n, 1)
    f64 = torch.float64
    out = {"mean_kept_size": (offsets[-1] - offsets[0]).to(f64) / n,
           "replay_restored_frac": (torch.zeros((), dtype=f64, device=offsets.device) if restored is None
                                    else restored.to(f64).sum() / n)}
    if kept_mass is not None:
        out["kept_mass"] = kept_mass.to(f64).sum() / n
    return poisoned(out, bad)


def poisoned(metrics, bad):
    """The replay's metrics NaN where any token of `bad` (bool, None: none) is set: a counted token flagged
    unvalidated (an invalid set, rule value or temperature, a row with NaN / +inf) has a set that means
    nothing, averaged in they would be finite wrong numbers (spec 13)."""
    return metrics if bad is None else nan_where(bad.any(), metrics)
