"""The public calls from hidden states (spec 11): linear_gtpo_loss, linear_token_logprobs."""
from __future__ import annotations

import numbers

import torch

from ..core import batch, checks, entry, host_read
from ..core.config import GTPOConfig, as_config
from ..core.flags import nan_where, tau_or_nan
from ..core.layout import float_dtype_for
from ..core.vocab_block import VOCAB_BLOCK
from ..distributed import agree
from ..distributed import vocab_parallel as parallel
from ..kernels import dispatch
from ..pipeline import head as linear
from ..pipeline import head_ops, head_replay_ops, logps_epilogue, loss, replay
from . import logits as api

SCHEDULES = ("auto", "fused", "recompute")


@entry.backend_kernels
@host_read.carrying  # one process, validating: the arguments' checks read with the tile plan's read
def linear_gtpo_loss(hidden, weight, completion_ids, advantages, completion_mask=None, *, bias=None,
                     logit_scale=1.0, logit_softcap=None, memory_budget=None, schedule="auto",
                     group_size=None, old_logps=None, ref_logps=None, config=GTPOConfig(), lam=None,
                     n_conf=None, cu_seqlens=None, max_seqlen=None, num_items_in_batch=None,
                     rollout_is_weights=None, rollout_logps=None, temperature=None, validate=True,
                     backend="auto", process_group=None, logits_start=None, inplace=False, sampling_mask=None,
                     top_k=None, top_p=None, min_p=None, head_dtype=None, batch_invariant=False):
    """`gtpo_loss` from the final hidden states and the LM head, never holding the (tokens x V) logits.

    hidden    (B, T, D) (packed: (N, D), with cu_seqlens): row t predicts completion_ids[:, t]; pass
              the model's h[:, P-1:P-1+T] as a view (read in place).
    weight    (V, D) the LM head; bias (V,) optional; same dtype and device as hidden.
    logits    z = (hidden @ weight.T + bias) * logit_scale, then logit_softcap * tanh(z / logit_softcap)
              when logit_softcap is given (Gemma), then / temperature as in gtpo_loss.
    memory_budget  bytes for one tile of logits and its gradient (default 1 GiB); tiles of counted tokens.
    schedule  'auto' (the 3-GEMM fused schedule when each tile's gradient coefficients depend on that
              tile alone and its modeled GEMM FLOPs are the lower, else 'recompute', 4 GEMMs on the rows
              with a gradient: with the entropy filter on; see gtpo_kernels.pipeline.schedule), or force
              'fused' / 'recompute'; out.metrics['grad_in_forward'] is 1 when the fused schedule ran.
    Gradients reach hidden, weight and bias (whichever require grad); weight and bias gradients
    accumulate in float32 across tiles and are cast once. Every other argument is gtpo_loss's
    (rollout_is_weights: (B, T) / packed (N,) per token, (B, 1) per completion, (B,) padded only).
    process_group  vocabulary-parallel head (spec 12): weight (and bias) hold this rank's contiguous
              slice of the vocabulary rows in rank order; ids are global; the loss and outputs are
              identical on every rank, the weight/bias gradients are this rank's slice.
    temperature  in place of config.temperature (None): a number, or a tensor per completion ((B,), (B, 1))
              or per token ((B, T); packed (N,)), as in gtpo_loss; every backend and schedule, and with
              process_group.
    sampling_mask, top_k, top_p, min_p  gtpo_loss's kept sets (spec 13): with recorded sets only the union of
              a tile's sets is projected (GEMM work and memory_budget counted on it, not V; 4 GEMMs: the
              projection, again in the backward, and the two gradient GEMMs); the rules rebuild the sets
              from tiles of the whole vocabulary in the forward and project the unions in the backward.
              `schedule` does not apply. With process_group each rank projects the union's ids in its
              slice and the statistics merge in O(M) bytes; the rules then need top_k.
    logits_start, inplace  gtpo_loss's, refused here (only their defaults pass): slice the hidden states
              instead of offsetting them (a view, read in place), and there are no logits to overwrite.
    head_dtype  None: the logits are the GEMM's output in the inputs' dtype (16-bit inputs: each logit
              rounded to 16 bits); torch.float32 (vLLM's head_dtype, spec 14): 16-bit hidden and weight are
              projected in float32 (each tile's rows and the weight upcast, a float32 GEMM), so logp and
              entropy are those of the exact product to float32's precision; gradients keep the inputs'
              dtypes. Costs a float32 copy of the weight (its rows in a kept-set union) per pass and float32
              tiles (half the rows per memory_budget). A no-op for float32 inputs; refused for float64.
    batch_invariant  True (spec 14): every projection GEMM has one fixed shape (64 rows, the last block of a
              tile padded with zero rows), so each token's logp and entropy are bitwise the same for any
              memory_budget, batch composition or layout; gradients are deterministic call after call.
              With process_group: bitwise the single-process values on any number of ranks when every
              slice boundary is a multiple of gtpo_kernels.VOCAB_BLOCK (refused otherwise). Not yet with
              kept sets or the reference backend (refused).
    Under torch.autocast the head computes in its inputs' dtypes (autocast is off inside).
    Host reads: planning the tiles (the number of counted rows per completion, one read, which validating
    carries the arguments' value checks too; the recompute backward: the rows with a gradient), and
    validating, the flags once after the tiles.
    """
    with agree.guard(process_group) as g, linear.autocast_off(_device(hidden)):  # spec 12; spec 6 (autocast)
        cfg = as_config(config)
        cfg = api._with_temperature(cfg, temperature)  # a value checked by the config, named as the argument
        _refuse_logits_keywords(logits_start, inplace)
        checks.require_advantages(advantages)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        host = checks.host_checks(validate)
        extras = dict(old_logps=old_logps, ref_logps=ref_logps, lam=lam, n_conf=n_conf,
                      rollout_is_weights=rollout_is_weights, rollout_logps=rollout_logps)
        dt = float_dtype_for(hidden)
        # the arguments' value checks read on the host together, once; with a group, by the agreement's read
        # (one process, planning tiles: with the plan's read, core.host_read.carried)
        carry = _carry(backend, sampling_mask, top_k, top_p, min_p)
        with checks.one_host_read(defer=agree.deferred(g, hidden) or carry):
            b, head, budget = _prepare(hidden, weight, bias, completion_ids, completion_mask, advantages, cu_seqlens,
                                       max_seqlen, logit_scale, logit_softcap, memory_budget, host, process_group,
                                       temperature, head_dtype, batch_invariant)
            batch.add_extras(b, hidden.device, validate=host, **extras)
            num_items = loss.check_loss_args(b, cfg, num_items_in_batch, dt, host)
            rules = _replay_rules(b, sampling_mask, top_k, top_p, min_p, host, process_group, float_dtype_for(hidden))
        replay_kw = dict(sampling_mask=sampling_mask, top_k=top_k, top_p=top_p, min_p=min_p)
        backend = dispatch.resolve_backend(backend, hidden.device, hidden.dtype)
        linear.refuse_invariant(head, backend, rules, process_group)
        if backend == "reference":  # the oracle on the materialized logits (autograd through the projection)
            checks.refuse_reference_with_group(process_group)
            logits = _materialize(head, hidden)
            return api.gtpo_loss(logits, completion_ids, advantages, completion_mask, group_size=group_size,
                                 config=cfg, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                 temperature=temperature if api._per_token_tau(temperature) else None,
                                 num_items_in_batch=num_items_in_batch, validate=validate, backend="reference",
                                 **extras, **replay_kw)
        checks.check_unused_group_size(group_size, b.B, cfg, config)
        # the epilogue kernel reads lam only where counted: conflict weights computed in one kernel there
        loss.conflicts_for(b, cfg, group_size, dt, backend, epilogue=head_ops.uses_epilogue(b, cfg, backend,
                                                                                           process_group))
        span = head_ops.coefficient_span(cfg)
        _summary(g, b, hidden, weight, host, (backend, cfg, schedule, budget, span, group_size, num_items_in_batch,
                                              logit_scale, logit_softcap, str(head.proj), head.invariant),
                 (sampling_mask, top_k, top_p, min_p))
    # (batch_invariant as given: a rank whose checks failed inside the guard has no head, and the agreement raises)
    vp = _vocab_parallel(g, hidden, "linear_gtpo_loss(process_group=...)", batch_invariant is True)
    with linear.autocast_off(hidden.device):
        if rules is not None:  # the sampler's kept sets: only the union of a tile's sets is projected
            logp, ent, metrics = head_replay_ops.replayed(b, head, hidden, _one_tau(cfg, b), sampling_mask, rules,
                                                      budget, backend, host, vp)
            if b.malformed is not None:  # (packed: the kept sets' metrics NaN where no completion is known)
                metrics = nan_where(b.malformed, metrics)
            if logps_epilogue.uses_epilogue(cfg, backend, logp.dtype):  # the loss math in one kernel
                # (its status word read only for the entropy filter's warning: replayed raised on the flags)
                warns = host and cfg.entropy_threshold is not None
                return logps_epilogue.logps_loss(b, cfg, logp, ent, num_items, warns, metrics, nan_all=False)
            value, res = loss.logps_loss(b, cfg, logp, ent, num_items, dt, host, nan_all=False)
            res["metrics"].update({k: v.to(dt) for k, v in metrics.items()})
            return loss.make_output(b, cfg, value, res, dt, host)
        return head_ops.head_loss(b, cfg, head, hidden, budget, schedule, backend, num_items, host, vp)


@entry.backend_kernels
@host_read.carrying
def linear_token_logprobs(hidden, weight, completion_ids, temperature=1.0, completion_mask=None, *, bias=None,
                          logit_scale=1.0, logit_softcap=None, cu_seqlens=None, max_seqlen=None,
                          memory_budget=None, sampling_mask=None, top_k=None, top_p=None, min_p=None,
                          validate=True, backend="auto", process_group=None, head_dtype=None,
                          batch_invariant=False):
    """Forward-only log-probs and entropies from hidden states (old-policy and reference passes); temperature
    a number or a tensor per completion / per token, as in token_logprobs:
    -> (logps, entropy) of completion_ids' shape, float32 (float64 for float64 inputs), 0 where masked
    out. No autograd; only a tile of logits at a time. process_group, head_dtype, batch_invariant: as in
    linear_gtpo_loss."""
    with agree.guard(process_group) as g, linear.autocast_off(_device(hidden)):  # spec 12; spec 6 (autocast)
        if not api._per_token_tau(temperature):
            temperature = api._with_temperature(GTPOConfig(), temperature).temperature  # validates it
        host = checks.host_checks(validate)
        carry = _carry(backend, sampling_mask, top_k, top_p, min_p)  # (as in linear_gtpo_loss)
        with checks.one_host_read(defer=agree.deferred(g, hidden) or carry):
            b, head, budget = _prepare(hidden, weight, bias, completion_ids, completion_mask, None, cu_seqlens,
                                       max_seqlen, logit_scale, logit_softcap, memory_budget, host, process_group,
                                       temperature, head_dtype, batch_invariant)
            rules = _replay_rules(b, sampling_mask, top_k, top_p, min_p, host, process_group, float_dtype_for(hidden))
        backend = dispatch.resolve_backend(backend, hidden.device, hidden.dtype)
        linear.refuse_invariant(head, backend, rules, process_group)
        if backend == "reference":
            checks.refuse_reference_with_group(process_group)
            with torch.no_grad():
                logits = _materialize(head, hidden)
            return api.token_logprobs(logits, completion_ids, temperature, completion_mask, cu_seqlens=cu_seqlens,
                                      max_seqlen=max_seqlen, validate=validate, backend="reference",
                                      sampling_mask=sampling_mask, top_k=top_k, top_p=top_p, min_p=min_p)
        one = None if b.tau is not None else temperature  # a per-token tau: compared by value (b.tau)
        _summary(g, b, hidden, weight, host, (backend, one, "logprobs", budget, logit_scale, logit_softcap,
                                              str(head.proj), head.invariant),
                 (sampling_mask, top_k, top_p, min_p))
    vp = _vocab_parallel(g, hidden, "linear_token_logprobs(process_group=...)", batch_invariant is True)
    with linear.autocast_off(hidden.device):
        if rules is not None:
            with torch.no_grad():
                tau = b.tau if b.tau is not None else _one_tau(GTPOConfig(temperature=temperature), b)
                logp, ent, _ = head_replay_ops.replayed(b, head, hidden, tau, sampling_mask, rules, budget, backend, host,
                                                    vp)
            dt = float_dtype_for(hidden)
            zero = torch.zeros((), dtype=dt, device=hidden.device)
            return (torch.where(b.counted, logp.to(dt), zero).reshape(b.tok_shape),
                    torch.where(b.counted, ent.to(dt), zero).reshape(b.tok_shape))
        return head_ops.head_logprobs(b, head, hidden, temperature if b.tau is None else b.tau, budget, backend,
                                      host, vp)


def _carry(backend, sampling_mask, top_k, top_p, min_p):
    """Where the call plans tiles (no kept sets, not the reference backend): the carried() block that reads
    the arguments' value checks with the plan's read; else None (read at the block's end)."""
    return None if backend == "reference" or replay.requested(sampling_mask, top_k, top_p, min_p) \
        else host_read.carry()


def _replay_rules(b, sampling_mask, top_k, top_p, min_p, host, process_group, dtype):
    """None when the call replays no kept set, else the checked rules (pipeline.replay.check_rules)."""
    if not replay.requested(sampling_mask, top_k, top_p, min_p):
        return None
    if process_group is not None and sampling_mask is None and top_k is None:
        raise ValueError("top_p / min_p with process_group need top_k as well (each rank's top_k candidates are "
                         "gathered to rebuild the sets), or pass the sets the engine recorded as sampling_mask")
    return replay.check_rules(b, top_k, top_p, min_p, host, dtype)


def _one_tau(cfg, b):
    """The replay's temperature: the call's per-token b.tau, or the config's one value as a number (a 0-d
    tensor, e.g. a schedule, read on the host: it lives there; NaN where it is no longer > 0)."""
    if b.tau is not None:
        return b.tau
    t = cfg.temperature
    return tau_or_nan(float(t)) if isinstance(t, torch.Tensor) else t


def _device(hidden):
    return hidden.device if isinstance(hidden, torch.Tensor) else "cpu"  # _prepare names a non-tensor


def _refuse_logits_keywords(logits_start, inplace):
    """gtpo_loss's logits_start and inplace have no meaning for the head: refused, saying what to do."""
    if logits_start is not None:
        raise ValueError(f"logits_start={logits_start!r}: linear_gtpo_loss takes the hidden states of the completion "
                         "tokens only, hidden[:, P - 1:P - 1 + T] for a model's (B, P + T, D) hidden states (a view, "
                         "read in place): slice them instead of passing logits_start")
    if inplace is not False:
        raise ValueError(f"inplace={inplace!r}: linear_gtpo_loss never holds the logits, so there is nothing to "
                         "overwrite (each tile's gradient is already written over its own logits); leave inplace "
                         "unset")


def _materialize(head, hidden):
    """The whole logits, out of place (autograd flows through): the reference backend only."""
    return linear.materialize(hidden, head.weight, head.bias, head.scale, head.cap, head.proj)


@checks.read_once
def _prepare(hidden, weight, bias, completion_ids, completion_mask, advantages, cu_seqlens, max_seqlen,
             logit_scale, logit_softcap, memory_budget, host, group=None, temperature=None, head_dtype=None,
             batch_invariant=False):
    """Checks of the head's arguments (names, shapes, dtypes, devices) -> (Batch, Head, budget). With a
    process group, counted ids are checked against the whole vocabulary once the ranks agree. A per-token
    or per-completion temperature becomes b.tau, (N,) per flat token (loss.call_temperature)."""
    for name, x in (("hidden", hidden), ("weight", weight)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in checks.FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be the LM head's (V, D) matrix, got shape {tuple(weight.shape)}")
    V, D = weight.shape
    packed = cu_seqlens is not None
    want = "(N, D) in the packed form (cu_seqlens given)" if packed else "(B, T, D)"
    if hidden.dim() != (2 if packed else 3):
        raise ValueError(f"hidden must be {want}, got shape {tuple(hidden.shape)}")
    if hidden.shape[-1] != D:
        Dh = hidden.shape[-1]
        hint = ", which looks transposed, (D, V): pass weight.t()" if V == Dh else ""
        raise ValueError(f"weight must be the LM head's (V, D) matrix with D = {Dh} (hidden's last dimension), "
                         f"got shape {tuple(weight.shape)}{hint}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise TypeError(f"weight must have hidden's dtype and device ({hidden.dtype}, {hidden.device}), got "
                        f"{weight.dtype} on {weight.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (V,):
            raise ValueError(f"bias must be a (V,) = ({V},) tensor, got "
                             f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
        if bias.dtype != hidden.dtype or bias.device != hidden.device:
            raise TypeError(f"bias must have hidden's dtype and device ({hidden.dtype}, {hidden.device}), got "
                            f"{bias.dtype} on {bias.device}")
    for name, x in (("logit_scale", logit_scale), ("logit_softcap", logit_softcap)):
        if x is None and name == "logit_softcap":
            continue
        if isinstance(x, bool) or not isinstance(x, numbers.Real) or not x > 0 or x == float("inf"):
            raise ValueError(f"{name} must be a finite number > 0, got {x!r}")
    if memory_budget is None:
        memory_budget = linear.DEFAULT_MEMORY_BUDGET
    elif isinstance(memory_budget, bool) or not isinstance(memory_budget, numbers.Integral) or memory_budget <= 0:
        raise ValueError(f"memory_budget must be a positive int (bytes), got {memory_budget!r}")
    b = batch.prepare_tokens(completion_ids, completion_mask, advantages, cu_seqlens=cu_seqlens,
                              max_seqlen=max_seqlen, device=hidden.device, validate=host)
    if tuple(hidden.shape[:-1]) != tuple(b.tok_shape):
        hint = ""
        if not packed and hidden.shape[0] == b.tok_shape[0] and hidden.shape[1] > b.tok_shape[1]:
            T_h, T = hidden.shape[1], b.tok_shape[1]
            hint = (f"; with the prompt's rows, (B, P + T, D), pass the rows that predict the completion tokens: "
                    f"hidden[:, {T_h - T - 1}:{T_h - 1}] (P - 1 = {T_h - T - 1}; a view, read in place)")
        raise ValueError(f"hidden must have shape {tuple(b.tok_shape) + (D,)} (completion_ids' shape + (D,)), "
                         f"got {tuple(hidden.shape)}{hint}")
    if host:
        checks.check_ids_in_range(b.ids, b.counted, V if group is None else float("inf"))
    if api._per_token_tau(temperature):
        b.tau = loss.call_temperature(temperature, b, float_dtype_for(hidden), host)
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be True or False, got {batch_invariant!r}")
    return b, linear.Head(weight, bias, logit_scale, logit_softcap, linear.head_dtype_arg(head_dtype, hidden),
                          batch_invariant), memory_budget


def _summary(g, b, hidden, weight, host, options, replay):
    """Inside the guard, last: this rank's part of the agreement (the tiles are planned after it from
    agreed inputs: the counted tokens, the largest slice, dtype, memory_budget, schedule and span)."""
    parallel.summary(g, b, weight.shape[0], loss.shape_key(b, hidden.shape[-1]), host, (str(hidden.dtype), *options),
                     replay)


def _vocab_parallel(g, hidden, where, invariant=False):
    """The vocabulary-parallel layout of the head's rows after the one small collective, or None.
    batch_invariant=True (spec 14) needs every slice boundary at a multiple of VOCAB_BLOCK: refused
    otherwise, on every rank alike (the sizes are the agreed ones)."""
    if g.group is None:
        return None
    vp = parallel.vocab_layout(g, agree.collective_device(g.group, hidden), where)
    if invariant and not vp.blockwise:
        starts = [sum(vp.sizes[:r]) for r in range(len(vp.sizes))]
        raise ValueError(f"{where}: batch_invariant=True needs every vocabulary slice to start at a multiple of "
                         f"gtpo_kernels.VOCAB_BLOCK = {VOCAB_BLOCK} (the slices here start at {starts}): pad the "
                         f"vocabulary (the weight's rows) to a multiple of VOCAB_BLOCK x the number of ranks, or "
                         f"drop batch_invariant; every rank raises this error")
    vp.ids = parallel.local_ids(g.batch.ids, vp.start)
    return vp
