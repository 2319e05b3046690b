"""gtpo_loss_from_logps: the loss from per-token log-probs computed elsewhere (spec 10)."""
from __future__ import annotations

import warnings

import torch

from ..core import batch, checks, entry
from ..core.config import GTPOConfig, as_config
from ..core.layout import float_dtype_for
from ..core.output import GTPOOutput
from ..kernels import dispatch
from ..objective.conflict import ID_LIMIT
from ..pipeline import logps_epilogue
from ..pipeline.loss import check_loss_args, conflicts_for, logps_loss, make_output


@entry.backend_kernels
def gtpo_loss_from_logps(logps, completion_ids, advantages, completion_mask=None, *, entropy=None,
                         group_size=None, old_logps=None, ref_logps=None, config=GTPOConfig(), lam=None,
                         n_conf=None, cu_seqlens=None, max_seqlen=None, num_items_in_batch=None,
                         rollout_is_weights=None, rollout_logps=None, validate=True, backend="auto") -> GTPOOutput:
    """`gtpo_loss` from per-token log-probs computed elsewhere (spec 10): TRL's fused LM head, verl's or
    Megatron's vocabulary-parallel log-probs, an inference engine.

    logps    (B, T) (packed: (N,), with cu_seqlens) the current policy's log-probs of completion_ids,
             differentiable; values at masked-out positions are ignored (and get zero gradient).
    entropy  the per-token entropies (same shape), needed by the entropy filter and shaping, the
             top-entropy quantile and the entropy bonus (differentiable for the bonus).
    The sampler's distribution (spec 13): this call takes no temperature, kept sets nor rules. When the
    rollout engine sampled with a temperature or truncated (top-k, top-p, min-p), logps, entropy and
    old_logps must already be over that distribution (replayed: e.g. token_logprobs(..., sampling_mask=)
    or the engine's processed log-probs), or every ratio is biased by the kept mass.
    completion_ids serve the conflict weights only (counted ids in [0, 2**31)). Every other argument is
    gtpo_loss's (rollout_is_weights: (B, T) / packed (N,) per token, (B, 1) per completion, (B,) padded
    only). It equals gtpo_loss on the logits that gave these log-probs and entropies, outputs included.
    backend  'auto' (Triton on CUDA, the eager surrogate elsewhere and for float64 log-probs), 'triton' or
             'torch': on Triton, one process and the configs of gtpo_loss's four-launch path (rollout
             weights included), the loss math is one kernel (pipeline/logps_epilogue.py), else eager.
    """
    cfg = as_config(config)
    checks.require_advantages(advantages)
    checks.check_float_tensor("logps", logps)
    host = checks.host_checks(validate)
    backend = _backend(backend, logps)
    fast = logps_epilogue.uses_epilogue(cfg, backend, logps.dtype)
    args = (logps, completion_ids, completion_mask, advantages, entropy, group_size, config, cfg,
            dict(old_logps=old_logps, ref_logps=ref_logps, lam=lam, n_conf=n_conf, rollout_is_weights=rollout_is_weights,
                 rollout_logps=rollout_logps), cu_seqlens, max_seqlen, num_items_in_batch)
    with checks.one_host_read():  # the checks' values read on the host once
        # on the epilogue's path the kernels make the value checks (the status word: one host read)
        b, dt, num_items = _prepare(*args, validate=host and not fast, raw=fast)
        if fast:
            conflicts_for(b, cfg, group_size, dt, backend, epilogue=True)
            return logps_epilogue.logps_loss(b, cfg, logps, entropy, num_items, host,
                                             revalidate=(lambda: _revalidate(*args)) if host else None)
    conflicts_for(b, cfg, group_size, dt, dispatch.resolve_backend("auto", logps.device))
    loss, res = logps_loss(b, cfg, logps, entropy, num_items, dt, host)
    return make_output(b, cfg, loss, res, dt, host)


def _prepare(logps, completion_ids, completion_mask, advantages, entropy, group_size, config, cfg, extras, cu_seqlens,
             max_seqlen, num_items_in_batch, validate, raw):
    """(Batch, loss dtype, num_items) from the call's arguments, with the value checks when validating."""
    b = batch.prepare_tokens(completion_ids, completion_mask, advantages, cu_seqlens=cu_seqlens,
                             max_seqlen=max_seqlen, device=logps.device, validate=validate)
    checks.check_same_shape("logps", logps, b.tok_shape)
    checks.check_unused_group_size(group_size, b.B, cfg, config)
    if validate:  # the conflict weights' ids (unvalidated: lam = NaN for a completion holding another id)
        checks.check_ids_in_range(b.ids, b.counted, ID_LIMIT)
        checks.check_finite("logps", logps.detach(), b.counted)
    if entropy is None and cfg.needs_entropy:
        raise ValueError("entropy (per-token entropies, shape of completion_ids) is required by this config: its "
                         "entropy filter, shaping (entropy_penalty), entropy bonus or top_entropy_quantile use "
                         "it; pass it, or turn those off (e.g. GTPOConfig.preset('grpo'))")
    if entropy is not None:
        checks.check_float_tensor("entropy", entropy)
        checks.check_same_shape("entropy", entropy, b.tok_shape)
        if validate:
            checks.check_finite("entropy", entropy, b.counted)
    batch.add_extras(b, logps.device, validate=validate, **extras)
    dt = float_dtype_for(logps)
    return b, dt, check_loss_args(b, cfg, num_items_in_batch, dt, validate, raw=raw)


def _revalidate(*args):
    """A value check failed in the kernels (the status word): the host checks run to raise the error that
    names the argument, as the eager path's. They pass where the kernels saw a value the eager path takes
    too but that overflows float32 (a float64 1e39): the call then returns its NaN outputs, as that path."""
    with checks.one_host_read(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the call's own warnings were given already)
        _prepare(*args, validate=True, raw=False)


def _backend(backend, logps):
    """The backend by gtpo_loss's rules ('reference': the eager surrogate, as 'torch'); 'triton' does not
    take float64 log-probs (it accumulates in float32)."""
    if backend == "triton" and logps.dtype == torch.float64:
        raise TypeError("backend='triton' accumulates in float32 and does not take float64 logps: use "
                        "backend='torch' (float64 accumulation) or 'auto', or cast the log-probs")
    backend = dispatch.resolve_backend(backend, logps.device, logps.dtype)
    return "torch" if backend == "reference" else backend
