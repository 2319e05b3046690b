"""The public calls on logits: gtpo_loss and token_logprobs (from log-probs: logps.py; from hidden
states: linear.py; the conflict weights: weights.py)."""
from __future__ import annotations

import dataclasses
import numbers

import torch

from ..core import batch, checks, entry
from ..core.config import GTPOConfig, as_config
from ..core.flags import nan_where, tau_or_nan
from ..core.layout import float_dtype_for
from ..core.output import GTPOOutput
from ..distributed import agree
from ..distributed import vocab_parallel as parallel
from ..distributed import vocab_replay
from ..kernels import dispatch
from ..pipeline import epilogue, epilogue_attached, logps_epilogue, reference, replay
from ..pipeline.loss import (call_temperature, check_loss_args, conflicts_for, forward, fused_loss, logps_loss,
                             make_output, vocab_parallel, vocab_summary)

@entry.backend_kernels
def gtpo_loss(logits, completion_ids, advantages, completion_mask=None, *, group_size=None,
              old_logps=None, ref_logps=None, config=GTPOConfig(), lam=None, n_conf=None,
              cu_seqlens=None, max_seqlen=None, logits_start=None, num_items_in_batch=None,
              rollout_is_weights=None, rollout_logps=None, temperature=None, sampling_mask=None, top_k=None,
              top_p=None, min_p=None, inplace=False, validate=True, backend="auto",
              process_group=None) -> GTPOOutput:
    """The GTPO policy-gradient loss (spec: docs/GTPO_SPEC.md), fused over the vocabulary.

    In one line of torch, for the default config (padded form, every token counted)::

        logp = log_softmax(logits[:, s:s+T] / tau, -1).gather(-1, ids[..., None])[..., 0]
        loss = mean_i mean_t -lam * min(r * Ahat, clip(r, 1-eps_low, 1+eps_high) * Ahat)

    with r = exp(logp - old_logps) (or 1 on-policy), Ahat the entropy-shaped advantage and lam the
    conflict-token weights. Nothing of size tokens x vocabulary is allocated besides the gradient.

    logits          (B, T_l, V) float16/bfloat16/float32 (float64: backend 'torch'), any strides; row
                    logits_start + t predicts completion_ids[:, t]. Packed form (cu_seqlens): (N_l, V).
                    With logits_start=None, T_l == T (packed: N_l == N).
    completion_ids  (B, T) (packed: (N,)) any integer dtype; ignored where the mask is 0.
    advantages      (B,) or (B, 1), one per completion.
    completion_mask (B, T) (packed: (N,)) bool, or int/float holding only 0 and 1 (checked when
                    validating; with validate=False any nonzero value counts as 1). Default all counted.
    group_size      completions per prompt (groups are contiguous); needed for the conflict weights
                    unless lam/n_conf come from `conflict_weights`; unused by a config without them
                    (the TRL-family presets), where one that does not divide B warns.
    config          a GTPOConfig or a preset name (see PRESETS).
    lam, n_conf     precomputed conflict weights from `conflict_weights` (shape of completion_ids, and
                    (B,)); when given they are used as they are, whatever config.use_conflict_mask says.
    old_logps       (shape of completion_ids) the sampling policy's log-probs; None = on-policy.
    ref_logps       the reference model's log-probs, needed when config.beta > 0.
    logits_start    row of logits that predicts completion token 0; None (default): the logits hold
                    exactly one row per token, anything else is refused with a hint (a model's
                    (B, P + T, V) logits need logits_start=P - 1).
    num_items_in_batch  the denominator of loss_agg='token-mean' instead of this call's counted tokens
                    (gradient accumulation, data parallelism: see docs/usage.md, "Normalizers"); refused
                    with any other aggregation.
    rollout_is_weights  rollout importance weights (training/inference mismatch, spec 9), finite and >= 0:
                    per token (completion_ids' shape: (B, T), packed (N,)) or per completion ((B, 1);
                    (B,) in the padded form only: packed, it is refused as ambiguous); they multiply the
                    policy term (see `rollout_is_weights()` for TRL's four ways to make them).
    rollout_logps   the inference engine's log-probs (completion_ids' shape): the sampling policy of
                    config.off_policy_mask_threshold (default: old_logps).
    temperature     the sampler's tau, in place of config.temperature (None): a number > 0 (a 0-d tensor is
                    read once to check it; a schedule kept on its device goes in config.temperature), or a tensor
                    per completion ((B,) or (B, 1)) or per token (completion_ids' shape) of them (spec 13:
                    each token's logits divided by its own tau; with process_group every rank passes the same).
    sampling_mask   the kept sets the sampler drew from (spec 13): (token_ids, offsets), vLLM's compressed
                    layout, one set per counted token in the packed order: log-probs, entropies and the
                    gradient are then over each set (exactly 0 outside it). Or, when the engine recorded
                    none, top_k / top_p / min_p (numbers, or per completion / per token tensors) rebuild
                    the sets by vLLM's rules from these logits (the sampled token restored if left out;
                    vLLM's ranges: top_k 0 or -1 off, top_p in (0, 1], min_p in [0, 1]).
                    Not with inplace; with process_group the rules need top_k (docs/parallelism.md).
    inplace         write the gradient into the logits' storage (saves one logits-sized buffer; the
                    logits are overwritten during backward). Off by default; refused on logits whose rows
                    overlap in memory and inside torch.compile.
    validate        host-side checks (ids in range, mask values, non-finite counted rows). Inside
                    torch.compile or CUDA-graph capture they are skipped (no sync, no graph break); an
                    invalid counted token then gives NaN outputs there and a NaN loss, as validate=False.
    backend         'auto' (Triton on CUDA, chunked torch on CPU, float64), 'triton', 'torch' or 'reference'.
    process_group   vocabulary-parallel logits (spec 12): this rank's logits hold the r-th contiguous slice
                    of the vocabulary (rank order; sizes may differ), ids are global. Loss and outputs are
                    identical on every rank; the gradient is this rank's slice. A DTensor sharded on the
                    last dimension brings its own group.
    """
    with agree.guard(_group(logits, process_group)) as g:  # an error is held until every rank knows (spec 12)
        logits, process_group = parallel.unwrap_dtensor(logits, process_group)
        cfg = _with_temperature(as_config(config), temperature)
        checks.require_advantages(advantages)
        host = checks.host_checks(validate)
        logits_start = batch.resolve_logits_start(logits, completion_ids, logits_start, cu_seqlens)
        extras = dict(old_logps=old_logps, ref_logps=ref_logps, lam=lam, n_conf=n_conf,
                      rollout_is_weights=rollout_is_weights, rollout_logps=rollout_logps)
        replaying = replay.requested(sampling_mask, top_k, top_p, min_p)
        fast = epilogue.eligible(logits, cfg, backend, replaying, process_group)  # checks in its kernel
        # the kept sets' loss math in the epilogue kernel (recorded sets: 8 launches, spec 8; split: merged log-probs)
        replay_epi = replaying and epilogue.eligible(logits, cfg, backend, False, None)
        fast_replay = replay_epi and process_group is None
        # the recorded sets' path checks in its kernels too (the sets: their status, then the host); not with a
        # per-token temperature: its host check must come after the batch's, as on the eager path
        sets_in_kernels = fast_replay and sampling_mask is not None and not _per_token_tau(temperature)
        # sets rebuilt by the rules: one launch writes them as thresholds, the kernels read them (spec 8, 13)
        rules_in_kernels = fast_replay and sampling_mask is None
        in_kernels = fast or sets_in_kernels or rules_in_kernels
        prep = dict(advantages=advantages, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, logits_start=logits_start,
                    vocab_size=_local_vocab(process_group), **extras)
        # the checks' values read on the host once; with a group, by the agreement's read (spec 12)
        with checks.one_host_read(defer=agree.deferred(g, logits)):
            b = batch.prepare(logits, completion_ids, completion_mask, validate=host and not in_kernels, **prep)
            checks.check_unused_group_size(group_size, b.B, cfg, config)
            checks.check_inplace(inplace, logits)
            dt = float_dtype_for(logits)
            backend = dispatch.resolve_backend(backend, logits.device, logits.dtype)
            num_items = check_loss_args(b, cfg, num_items_in_batch, dt, host and not in_kernels, raw=fast or fast_replay)
            # a tau tensor on the three-launch path goes to the kernels as given (checked there: a token whose tau
            # is not finite and > 0 is flagged, and revalidate names it), one per completion read at each token's
            tau_kernels = (fast or rules_in_kernels) and _per_token_tau(temperature)  # (rules: spread, flagged alike)
            per_seq = tau_kernels and _per_completion(temperature, b)  # (the rules' kernel reads it so too)
            # so too on a split vocabulary's epilogue path (validating: checked by the agreement's row)
            tau_split = (process_group is not None and not replaying and _per_token_tau(temperature)
                         and epilogue_attached.takes(logits, cfg, backend))
            # (one per completion: (B,) as given, read at each token's completion by the kernels and the agreement)
            split_seq = tau_split and _per_completion(temperature, b) and b.B > 0
            tau = call_temperature(temperature if _per_token_tau(temperature) else None, b,
                                   torch.float64 if logits.dtype == torch.float64 else torch.float32,
                                   host and not tau_kernels, in_kernels=fast or rules_in_kernels or tau_split,
                                   spread=not (per_seq or split_seq))
            b.tau, b.tau_seq = tau, per_seq or split_seq  # compared across the ranks of a vocabulary split (digest)
            rules = _replay_rules(b, sampling_mask, top_k, top_p, min_p, host, process_group, inplace,
                                  in_kernels=rules_in_kernels)

            def revalidate():  # an input check failed in the kernel: the host checks name it
                with checks.one_host_read():
                    b2 = batch.prepare(logits, completion_ids, completion_mask, validate=True, **prep)
                    check_loss_args(b2, cfg, num_items_in_batch, dt, True)
                    if tau_kernels:  # (the eager order: the batch, the loss's arguments, the temperature)
                        call_temperature(temperature, b2, dt, True)
                    if rules_in_kernels:  # (an invalid rule flags its token: named here)
                        replay.check_rules(b2, top_k, top_p, min_p, True)
            if fast or rules_in_kernels:  # three launches (spec 8), the rules' one more
                conflicts_for(b, cfg, group_size, dt, backend, epilogue=True)
                return epilogue.loss(b, cfg, num_items, tau, host, revalidate,  # validating: one read
                                     rules=rules[0] if rules_in_kernels else None, inplace=inplace, per_seq=per_seq)
        if backend == "reference":
            checks.refuse_reference_with_group(process_group)
            tau = reference.config_tau(b, cfg, tau, host)
            if rules is None:
                return reference.gtpo_loss(b, logits, cfg, group_size, extras, num_items, GTPOOutput, tau, None, host)
            keep, metrics = reference.kept_window(b, logits, cfg.temperature if tau is None else tau,
                                                  sampling_mask, rules, host)
            out = reference.gtpo_loss(b, logits, cfg, group_size, extras, num_items, GTPOOutput, tau, keep, host)
            if b.malformed is not None:  # (the kept sets' metrics too: no completion is known)
                metrics = nan_where(b.malformed, metrics)
            out.metrics.update({k: v.to(out.loss.dtype) for k, v in metrics.items()})
            return out
        # split over ranks: the epilogue kernel between the merged vocabulary passes (epilogue_attached)
        attached = process_group is not None and rules is None and epilogue_attached.takes(b.logits3, cfg, backend)
        conflicts_for(b, cfg, group_size, dt, backend, epilogue=replay_epi or attached, defer=attached)
        vocab_summary(g, b, logits, host, backend, (cfg, group_size, num_items_in_batch,  # by value (spec 12)
                                                    attached), (sampling_mask, top_k, top_p, min_p))  # (the path too)
    vp = vocab_parallel(g, logits, "gtpo_loss(process_group=...)",  # (its kernels read b.ids - vp.start)
                        first=g.error is None and attached and epilogue_attached.first(b, cfg))
    if fast_replay and sampling_mask is not None:  # (sets_in_kernels: validating, the kernels check)
        return logps_epilogue.recorded_sets(b, cfg, tau, sampling_mask, num_items, host, revalidate)
    if rules is not None:  # the sampler's kept sets
        logp, ent, metrics = _replayed(b, cfg, tau, sampling_mask, rules, backend, host, vp)
        if b.malformed is not None:  # (the kept sets' metrics too: no completion is known)
            metrics = nan_where(b.malformed, metrics)
        if replay_epi:  # (split, replayed raised on the flags: the status word is read for the warning only)
            warns = host and (fast_replay or cfg.entropy_threshold is not None)
            return logps_epilogue.logps_loss(b, cfg, logp, ent, num_items, warns, metrics, nan_all=False)
        loss, res = logps_loss(b, cfg, logp, ent, num_items, dt, host, nan_all=False)
        res["metrics"].update({k: v.to(dt) for k, v in metrics.items()})
        return make_output(b, cfg, loss, res, dt, host)
    if attached:
        return epilogue_attached.loss(b, cfg, backend, inplace, host, num_items, vp, tau)
    loss, res = fused_loss(b, cfg, backend, inplace, host, num_items, vp, tau)
    return make_output(b, cfg, loss, res, dt, host)


@entry.backend_kernels
def token_logprobs(logits, completion_ids, temperature=1.0, completion_mask=None, *, logits_start=None,
                   cu_seqlens=None, max_seqlen=None, sampling_mask=None, top_k=None, top_p=None, min_p=None,
                   validate=True, backend="auto", process_group=None):
    """Forward-only log-probs and entropies (no autograd), e.g. for the old-policy and reference
    passes: -> (logps, entropy), each of completion_ids' shape, float32 (float64 for float64 logits),
    0 where masked out (NaN at an invalid counted token when the host checks are off). Nothing of size
    tokens x vocabulary is allocated. temperature: a number, or a tensor per completion / per token as
    gtpo_loss's. sampling_mask, top_k, top_p, min_p: over the sampler's kept sets, as in gtpo_loss.
    process_group: vocabulary-parallel logits, as in gtpo_loss."""
    with agree.guard(_group(logits, process_group)) as g:  # an error is held until every rank knows (spec 12)
        logits, process_group = parallel.unwrap_dtensor(logits, process_group)
        if not _per_token_tau(temperature):  # one value, checked by the config
            temperature = _with_temperature(GTPOConfig(), temperature).temperature
        host = checks.host_checks(validate)
        logits_start = batch.resolve_logits_start(logits, completion_ids, logits_start, cu_seqlens)
        try:  # (a backend that does not resolve: raised where the call resolves it, after the inputs' errors)
            one = (process_group is None and sampling_mask is None and isinstance(logits, torch.Tensor)
                   and dispatch.resolve_backend(backend, logits.device, logits.dtype) == "triton")  # one launch
        except (ValueError, TypeError, RuntimeError):
            one = False
        # validating in that launch: the kernel checks the mask values, ids, cu_seqlens and temperatures (rules:
        # checked in the kernels too); no token, no program: nothing would check cu_seqlens
        fast = one and host and isinstance(completion_ids, torch.Tensor) and completion_ids.numel() > 0
        # the checks' values read on the host once; with a group, by the agreement's read (spec 12)
        with checks.one_host_read(defer=agree.deferred(g, logits)):
            b = batch.prepare(logits, completion_ids, completion_mask, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                               logits_start=logits_start, validate=host and not fast,
                               vocab_size=_local_vocab(process_group))
            given_tau = temperature
            tau_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
            per_seq = False  # a tau per completion read in the one kernel, not spread to the tokens first
            if _per_token_tau(temperature):  # in the one kernel: checked there (fast), else NaN there
                per_seq = one and (fast or not host) and _per_completion(temperature, b)  # (the rules' kernel too)
                temperature = b.tau = call_temperature(temperature, b, tau_dtype, host and not fast,
                                                       in_kernels=fast or (one and not host), spread=not per_seq)
            backend = dispatch.resolve_backend(backend, logits.device, logits.dtype)  # (one: spec 8)
            # (rules: the kept sets' kernel one more; unvalidated it flags an invalid tensor value itself)
            rules = _replay_rules(b, sampling_mask, top_k, top_p, min_p, host, process_group, False,
                                  in_kernels=one and (fast or not host))
            if one:
                def revalidate():  # a check failed in the kernel: the host checks name it, in the eager order
                    with checks.one_host_read():
                        b2 = batch.prepare(logits, completion_ids, completion_mask, cu_seqlens=cu_seqlens,
                                           max_seqlen=max_seqlen, logits_start=logits_start, validate=True)
                        if _per_token_tau(given_tau):
                            call_temperature(given_tau, b2, tau_dtype, True)
                        replay.check_rules(b2, top_k, top_p, min_p, True)  # (no rule: nothing)
                return epilogue.token_logps(b, temperature, host, revalidate if fast else None,
                                            None if rules is None else rules[0], per_seq)
        if backend == "reference":
            checks.refuse_reference_with_group(process_group)
            keep = None if rules is None else reference.kept_window(b, logits, temperature, sampling_mask, rules,
                                                                    host)[0]
            return tuple(x.detach() for x in reference.token_logprobs(b, logits, temperature, keep, host))  # (detached)
        vocab_summary(g, b, logits, host, backend, (temperature,), (sampling_mask, top_k, top_p, min_p))
    vp = vocab_parallel(g, logits, "token_logprobs(process_group=...)")
    dt = float_dtype_for(logits)
    with torch.no_grad():
        if rules is not None:
            logp, ent, _ = _replayed(b, None, temperature, sampling_mask, rules, backend, host, vp)
        else:
            logp, ent, _, _ = forward(b, temperature, backend, host, vp)
            if vp is not None:  # (the merge's finish: 0 where not counted, NaN at a flagged token: no launch more)
                return logp.to(dt).reshape(b.tok_shape), ent.to(dt).reshape(b.tok_shape)
    zero = torch.zeros((), dtype=dt, device=logits.device)
    logp = torch.where(b.counted, logp.to(dt), zero)
    ent = torch.where(b.counted, ent.to(dt), zero)
    return logp.reshape(b.tok_shape), ent.reshape(b.tok_shape)


def _per_completion(t, b):
    """A tensor temperature given per completion, (B,) or (B, 1), not per token."""
    return tuple(t.shape) in ((b.B,), (b.B, 1)) and tuple(t.shape) != tuple(b.tok_shape)


def _replay_rules(b, sampling_mask, top_k, top_p, min_p, host, process_group, inplace, in_kernels=False):
    """None when the call replays no kept set, else the checked rules (replay.check_rules; in_kernels: the
    kernel of the kept sets flags invalid values); what replay does not take yet is refused."""
    if not replay.requested(sampling_mask, top_k, top_p, min_p):
        return None
    if process_group is not None and sampling_mask is None and top_k is None:
        raise ValueError("top_p / min_p with process_group need top_k as well (each rank's top_k candidates are "
                         "gathered to rebuild the sets), or pass the sets the engine recorded as sampling_mask")
    if inplace:
        raise ValueError("inplace=True is not taken with sampling_mask / top_k / top_p / min_p (the replay's "
                         "gradient is written to a buffer of its own)")
    return replay.check_rules(b, top_k, top_p, min_p, host, in_kernels=in_kernels)


def _replayed(b, cfg, tau, sampling_mask, rules, backend, host, vp=None):
    """(logp, entropy, metrics) over the kept sets, with the call's temperature (tau: a per-token tensor,
    or None for cfg's; token_logprobs passes cfg=None and its own number or tensor); validating, a flagged
    row raises."""
    if cfg is not None and tau is None:
        tau = cfg.temperature
    if isinstance(tau, torch.Tensor) and tau.dim() == 0:  # a schedule: one value, NaN if no longer > 0
        tau = tau_or_nan(float(tau)) if not torch.compiler.is_compiling() else \
            tau_or_nan(tau.to(b.logits3.device, float_dtype_for(b.logits3))).expand(b.given["ids"].numel())
        # (read on the host: a CPU tensor, no device sync; traced, it stays a tensor, one per token)
    if vp is not None:  # each rank reads the kept logits of its slice; O(M) merge (spec 12, 13)
        return vocab_replay.replayed(b, tau, sampling_mask, rules, vp, host)
    logp, ent, flags, metrics = replay.replayed(b, tau, sampling_mask, rules, backend, host)
    if host:
        checks.raise_on_flags(flags, b.tok_shape)
    return logp, ent, metrics


def _per_token_tau(temperature):
    """Whether a call's temperature is a tensor per completion or per token (0-d: one value, a schedule)."""
    return isinstance(temperature, torch.Tensor) and temperature.dim() > 0


def _with_temperature(cfg, temperature):
    """The config with a call's one-value `temperature` in it (a number or a 0-d tensor, checked by the
    config), or as it is for None or a tensor per completion / per token (call_temperature checks that;
    with process_group the ranks compare it by value in their agreement)."""
    if temperature is None or _per_token_tau(temperature):
        return cfg
    if isinstance(temperature, bool) or not isinstance(temperature, (numbers.Real, torch.Tensor)):
        raise TypeError(f"temperature must be a number > 0 or a floating-point tensor, got {temperature!r}")
    try:
        return cfg.replace(temperature=temperature if isinstance(temperature, torch.Tensor) else float(temperature))
    except ValueError as e:  # the config names its field; the value is this call's `temperature=`
        raise ValueError(str(e).replace("GTPOConfig.temperature", "temperature (the call's argument)", 1)) from None


def _group(logits, process_group):
    """The group the agreement runs on: a Shard(-1) DTensor's own (every rank holding it knows it, so a
    process_group passed as well on some ranks is refused inside the guard, on every rank alike), else
    process_group. A DTensor laid out otherwise is refused here, before any collective: its placements
    are the same on every rank, so every rank raises alike."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - old torch
        return process_group
    if not isinstance(logits, DTensor):
        return process_group
    return parallel.unwrap_dtensor(logits, None, in_order=False)[1]


def _local_vocab(process_group):
    """prepare's range check: the logits' own V on one process; with a group the whole vocabulary is known
    only after the agreement (vocab_layout checks it there), so only negative ids are refused here."""
    return None if process_group is None else float("inf")
