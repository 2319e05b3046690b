"""The public calls: gtpo_loss, conflict_weights, token_logprobs."""
from __future__ import annotations

import dataclasses
import warnings
from typing import Dict

import torch

from . import autograd as _autograd  # noqa: F401  (registers attach_grad's backward)
from . import checks, conflict, dispatch, ops, parallel, reference_backend
from .config import GTPOConfig, as_config, is_zero
from .layout import float_dtype_for, pad, packed_layout
from .surrogate import surrogate


@dataclasses.dataclass
class GTPOOutput:
    """What `gtpo_loss` returns. Per-token tensors are (B, T) (packed form: (N,)), detached, 0 where
    masked out; `loss` is differentiable (a scalar, or per token with loss_agg='none')."""
    loss: torch.Tensor
    logps: torch.Tensor
    entropy: torch.Tensor
    per_token_loss: torch.Tensor
    lam: torch.Tensor
    n_conf: torch.Tensor
    kept: torch.Tensor
    seq_entropy: torch.Tensor
    metrics: Dict[str, torch.Tensor]


def gtpo_loss(logits, completion_ids, advantages, completion_mask=None, *, group_size=None,
              old_logps=None, ref_logps=None, config=GTPOConfig(), lam=None, n_conf=None,
              cu_seqlens=None, max_seqlen=None, logits_start=0, num_items_in_batch=None,
              rollout_is_weights=None, rollout_logps=None, inplace=False, validate=True,
              backend="auto", process_group=None) -> GTPOOutput:
    """The GTPO policy-gradient loss (spec: docs/GTPO_SPEC.md), fused over the vocabulary.

    In one line of torch, for the default config (padded form, every token counted)::

        logp = log_softmax(logits[:, s:s+T] / tau, -1).gather(-1, ids[..., None])[..., 0]
        loss = mean_i mean_t -lam * min(r * Ahat, clip(r, 1-eps_low, 1+eps_high) * Ahat)

    with r = exp(logp - old_logps) (or 1 on-policy), Ahat the entropy-shaped advantage and lam the
    conflict-token weights. Nothing of size tokens x vocabulary is allocated besides the gradient.

    logits          (B, T_l, V) float16/bfloat16/float32 (float64: backend 'torch'), any strides; row
                    logits_start + t predicts completion_ids[:, t]. Packed form (cu_seqlens): (N_l, V).
    completion_ids  (B, T) (packed: (N,)) any integer dtype; ignored where the mask is 0.
    advantages      (B,) or (B, 1), one per completion.
    completion_mask (B, T) (packed: (N,)) bool, or int/float holding only 0 and 1 (checked when
                    validating; with validate=False any nonzero value counts as 1). Default all counted.
    group_size      completions per prompt (groups are contiguous); needed for the conflict weights
                    unless lam/n_conf come from `conflict_weights`.
    config          a GTPOConfig or a preset name (see PRESETS).
    lam, n_conf     precomputed conflict weights from `conflict_weights` (shape of completion_ids, and
                    (B,)); when given they are used as they are, whatever config.use_conflict_mask says.
    old_logps       (shape of completion_ids) the sampling policy's log-probs; None = on-policy.
    ref_logps       the reference model's log-probs, needed when config.beta > 0.
    logits_start    row of logits that predicts completion token 0.
    num_items_in_batch  the denominator of loss_agg='token-mean' instead of this call's counted tokens
                    (gradient accumulation, data parallelism: see the README's "Normalizers"); refused
                    with any other aggregation.
    rollout_is_weights  rollout importance weights (training/inference mismatch, spec 9), per token
                    (completion_ids' shape) or per completion ((B,) / (B, 1)), >= 0; they multiply the
                    policy term (see `rollout_is_weights()` for TRL's four ways to make them).
    rollout_logps   the inference engine's log-probs (completion_ids' shape): the sampling policy of
                    config.off_policy_mask_threshold (default: old_logps).
    inplace         write the gradient into the logits' storage (saves one logits-sized buffer; the
                    logits are overwritten during backward). Off by default; refused on logits whose rows
                    overlap in memory and inside torch.compile.
    validate        host-side checks (ids in range, mask values, non-finite counted rows). Inside
                    torch.compile or CUDA-graph capture they are skipped (no sync, no graph break); an
                    invalid counted token then gives NaN outputs there and a NaN loss, as validate=False.
    backend         'auto' (Triton on CUDA, chunked torch on CPU and for float64), 'triton', 'torch' or
                    'reference'.
    process_group   vocabulary-parallel logits (spec 12): this rank's logits hold the r-th contiguous slice
                    of the vocabulary (rank order; sizes may differ), ids are global. Loss and outputs are
                    identical on every rank; the gradient is this rank's slice. A DTensor sharded on the
                    last dimension brings its own group.
    """
    cfg = as_config(config)
    if advantages is None:
        raise TypeError("advantages is required: a (B,) tensor, one advantage per completion")
    host = checks.host_checks(validate)
    logits, process_group = parallel.unwrap_dtensor(logits, process_group)
    vp = _vocab_parallel(process_group, logits, completion_ids, logits_start, cu_seqlens)
    extras = dict(old_logps=old_logps, ref_logps=ref_logps, lam=lam, n_conf=n_conf,
                  rollout_is_weights=rollout_is_weights, rollout_logps=rollout_logps)
    b = checks.prepare(logits, completion_ids, completion_mask, advantages=advantages, cu_seqlens=cu_seqlens,
                       max_seqlen=max_seqlen, logits_start=logits_start, validate=host,
                       vocab_size=None if vp is None else vp.V, **extras)
    checks.check_inplace(inplace, logits)
    dt = float_dtype_for(logits)
    num_items = _check_loss_args(b, cfg, num_items_in_batch, dt)
    backend = dispatch.resolve_backend(backend, logits.device, logits.dtype)
    if backend == "reference":
        if vp is not None:
            raise ValueError("backend='reference' takes the whole vocabulary: no process_group")
        return reference_backend.gtpo_loss(b, logits, cfg, group_size, extras, num_items, GTPOOutput)
    if vp is not None:
        vp.ids = parallel.local_ids(b.ids, vp.start, b.V)
    _conflicts_for(b, cfg, group_size, dt, backend)
    loss, res = _fused_loss(b, cfg, backend, inplace, host, num_items, vp)
    return _output(b, cfg, loss, res, dt, host)


def _check_loss_args(b, cfg, num_items_in_batch, dt):
    """Checks that depend on the config; returns num_items_in_batch as the surrogate takes it."""
    if b.ref is None and not is_zero(cfg.beta):
        raise ValueError("config.beta > 0 (or a tensor beta) needs ref_logps (the reference model's "
                         "log-probs, shape of completion_ids); or set beta=0")
    if cfg.loss_agg == "none" and cfg.importance_sampling_level == "sequence":
        raise ValueError("loss_agg='none' with importance_sampling_level='sequence' is refused: each token's "
                         "loss then depends on every token of its completion, so a per-token upstream "
                         "gradient has no per-token meaning; aggregate the loss instead")
    return checks.check_num_items(num_items_in_batch, cfg.loss_agg, b.counted.device, dt)


def _conflicts_for(b, cfg, group_size, dt, backend):
    """The conflict weights the loss uses: given (b.lam / b.n_conf) or computed here; 1 off the mask."""
    if cfg.use_conflict_mask and (b.lam is None or
                                  (b.n_conf is None and cfg.loss_agg == "gtpo-official")):
        group_size = checks.check_group_size(group_size, b.B)
        lam_c, n_conf_c = _conflict_flat(b, group_size, cfg, dt, backend)
        b.lam = b.lam if b.lam is not None else lam_c
        b.n_conf = b.n_conf if b.n_conf is not None else n_conf_c
    if b.lam is not None:  # ignored where masked out, as everything else
        b.lam = torch.where(b.counted, b.lam, torch.ones_like(b.lam))


def _surrogate(b, cfg, logp, ent, num_items, dt):
    return surrogate(logp.to(dt), ent.to(dt), b.counted, b.seg, b.B, b.adv, cfg, old=b.old, ref=b.ref,
                     lam=b.lam, n_conf=b.n_conf, num_items=num_items, max_len=b.max_len,
                     rollout_w=b.rollout_w, rollout_w_seq=b.rollout_w_seq, rollout_logps=b.rollout_logps)


def _loss_value(b, cfg, res):
    """The loss value without gradient: sum_k w_k l_k, or w_k l_k per token with loss_agg='none'."""
    weighted = res["weight"] * res["loss_tok"]
    return weighted.reshape(b.tok_shape) if cfg.loss_agg == "none" else \
        weighted.sum(dtype=torch.float64).to(weighted.dtype)


def _output(b, cfg, loss, res, dt, host):
    if host and cfg.entropy_threshold is not None and not bool(res["kept"].any()) and bool(b.counted.any()):
        warnings.warn(
            f"gtpo_loss: the entropy filter dropped every completion (mean entropy above entropy_threshold="
            f"{float(cfg.entropy_threshold):.3g}), so the loss and its gradient are zero. A model more uncertain than "
            f"that from the start needs GTPOConfig(initial_entropy=<its mean entropy>) (the paper's gate) or "
            f"entropy_threshold=None; out.metrics['filtered_frac'] tracks it.", stacklevel=3)
    dev = b.counted.device
    lam_out = torch.ones(b.tok_shape, dtype=dt, device=dev) if b.lam is None else b.lam.to(dt).reshape(b.tok_shape)
    n_conf_out = torch.ones(b.B, dtype=dt, device=dev) if b.n_conf is None else b.n_conf.to(dt)
    return GTPOOutput(loss=loss, logps=res["logp"].reshape(b.tok_shape), entropy=res["ent"].reshape(b.tok_shape),
                      per_token_loss=res["loss_tok"].reshape(b.tok_shape), lam=lam_out, n_conf=n_conf_out,
                      kept=res["kept"], seq_entropy=res["seq_entropy"], metrics=res["metrics"])


def gtpo_loss_from_logps(logps, completion_ids, advantages, completion_mask=None, *, entropy=None,
                         group_size=None, old_logps=None, ref_logps=None, config=GTPOConfig(), lam=None,
                         n_conf=None, cu_seqlens=None, max_seqlen=None, num_items_in_batch=None,
                         rollout_is_weights=None, rollout_logps=None, validate=True) -> GTPOOutput:
    """`gtpo_loss` from per-token log-probs computed elsewhere (spec 10): TRL's fused LM head, verl's or
    Megatron's vocabulary-parallel log-probs, an inference engine.

    logps    (B, T) (packed: (N,), with cu_seqlens) the current policy's log-probs of completion_ids,
             differentiable; values at masked-out positions are ignored (and get zero gradient).
    entropy  the per-token entropies (same shape), needed by the entropy filter and shaping, the
             top-entropy quantile and the entropy bonus (differentiable for the bonus).
    completion_ids serve the conflict weights only. Every other argument is gtpo_loss's. It equals
    gtpo_loss on the logits that gave these log-probs and entropies, outputs included.
    """
    cfg = as_config(config)
    if advantages is None:
        raise TypeError("advantages is required: a (B,) tensor, one advantage per completion")
    checks.check_float_tensor("logps", logps)
    host = checks.host_checks(validate)
    b = checks.prepare_tokens(completion_ids, completion_mask, advantages, cu_seqlens=cu_seqlens,
                              max_seqlen=max_seqlen, device=logps.device, validate=host)
    checks.check_same_shape("logps", logps, b.tok_shape)
    needs_entropy = cfg.entropy_threshold is not None or not is_zero(cfg.entropy_penalty) or \
        not is_zero(cfg.entropy_coef) or not is_zero(cfg.top_entropy_quantile - 1.0)
    if entropy is None and needs_entropy:
        raise ValueError("entropy (per-token entropies, shape of completion_ids) is required by this config: its "
                         "entropy filter, shaping (entropy_penalty), entropy bonus or top_entropy_quantile use "
                         "it; pass it, or turn those off (e.g. GTPOConfig.preset('grpo'))")
    if entropy is not None:
        checks.check_float_tensor("entropy", entropy)
        checks.check_same_shape("entropy", entropy, b.tok_shape)
    checks.add_extras(b, logps.device, old_logps=old_logps, ref_logps=ref_logps, lam=lam, n_conf=n_conf,
                      rollout_is_weights=rollout_is_weights, rollout_logps=rollout_logps, validate=host)
    dt = float_dtype_for(logps)
    num_items = _check_loss_args(b, cfg, num_items_in_batch, dt)
    _conflicts_for(b, cfg, group_size, dt, dispatch.resolve_backend("auto", logps.device))
    zero = torch.zeros((), dtype=dt, device=logps.device)
    lp = torch.where(b.counted, logps.reshape(-1).to(dt), zero)  # gradient only where counted
    ent = zero.expand(lp.shape) if entropy is None else torch.where(b.counted, entropy.reshape(-1).to(dt), zero)
    with torch.no_grad():
        res = _surrogate(b, cfg, lp.detach(), ent.detach(), num_items, dt)
        value = _loss_value(b, cfg, res)
    # the value, with d/dlogps = c and d/dentropy = e attached (x - sg(x) is 0 with gradient 1)
    attach = res["c"] * (lp - lp.detach())
    if res["e"] is not None:
        attach = attach + res["e"] * (ent - ent.detach())
    loss = value + (attach.reshape(b.tok_shape) if cfg.loss_agg == "none" else attach.sum())
    return _output(b, cfg, loss, res, dt, host)


def _forward(b, temperature, backend, host, vp=None):
    """The forward pass: per token (logp, H, stats, flags), with flagged counted tokens' logp and H set
    to NaN (so that invalid input unchecked on the host gives NaN, never a finite wrong number).
    vp: the vocabulary-parallel layout (parallel.VocabParallel), or None."""
    if vp is None:
        logp, ent, stats, bad = ops.vocab_fwd(b.logits3.detach(), b.ids, b.counted, temperature,
                                              b.logits_start, backend)
    else:
        logp, ent, stats, bad = parallel.vp_forward(b, vp.ids, temperature, backend, vp.group, vp.V)
    if host:
        checks.raise_on_flags(bad, b.tok_shape)
    invalid = bad != 0
    nan = torch.full((), float("nan"), dtype=logp.dtype, device=logp.device)
    return torch.where(invalid, nan, logp), torch.where(invalid, nan, ent), stats


def _fused_loss(b, cfg, backend, inplace, host, num_items, vp=None):
    """Forward pass -> O(N) surrogate -> the loss value with the backward pass attached."""
    dt = float_dtype_for(b.logits3)
    with torch.no_grad():
        temperature = ops.as_tensor_param(cfg.temperature)
        logp, ent, stats = _forward(b, temperature, backend, host, vp)
        res = _surrogate(b, cfg, logp, ent, num_items, dt)
        value = _loss_value(b, cfg, res)
        cdt = stats.dtype  # the kernel's coefficients in its accumulation dtype
        c = res["c"].to(cdt)
        e = None if res["e"] is None else res["e"].to(cdt)
    ids = b.ids if vp is None else vp.ids  # vocabulary-parallel: this slice's ids
    loss = ops.attach_grad(b.logits3, value, ids, stats, ent.to(cdt), c, e, temperature, b.logits_start,
                           backend, inplace)
    return loss, res


def conflict_weights(completion_ids, completion_mask, advantages, group_size=None, *, group_ids=None, config=None,
                     cu_seqlens=None, max_seqlen=None, dtype=torch.float32, validate=True, backend="auto"):
    """Conflict-token weights (spec section 3) -> (lam, n_conf).

    Call it once per batch when the advantages are computed (groups must be whole), then pass
    `lam=lam[rows], n_conf=n_conf[rows]` to `gtpo_loss` for any micro-batch of rows. lam has the shape
    of completion_ids ((B, T), or (N,) packed) and n_conf is (B,). Weights come from `config`
    (default GTPOConfig(): w_pos = 2.0, w_neg = 0.0). backend: 'auto' (a Triton kernel on CUDA, sort-based
    torch ops on the CPU), 'triton' or 'torch'; neither syncs with the host when validate=False (packed
    form: give max_seqlen too).

    Groups: `group_size` consecutive rows, or `group_ids` (instead): one hashable key per row (verl's
    `uid`: strings, ints, a numpy object array, or a 1-D integer tensor), rows of a group in any order,
    groups of any sizes. Grouping by key costs one host sync (the largest group's size).
    """
    cfg = GTPOConfig() if config is None else as_config(config)
    if advantages is None:
        raise TypeError("advantages is required: a (B,) tensor, one advantage per completion")
    b = checks.prepare_tokens(completion_ids, completion_mask, advantages, cu_seqlens=cu_seqlens,
                              max_seqlen=max_seqlen, validate=checks.host_checks(validate))
    layout = None
    if group_ids is not None:
        if group_size is not None:
            raise TypeError("pass group_size (contiguous groups) or group_ids (a group key per row), not both")
        from .grouping import group_layout
        layout = group_layout(group_ids, b.B, device=b.counted.device)
    else:
        group_size = checks.check_group_size(group_size, b.B)
    backend = dispatch.resolve_backend(backend, completion_ids.device)
    lam, n_conf = _conflict_flat(b, group_size, cfg, dtype, "torch" if backend == "reference" else backend,
                                 layout=layout)
    return lam.reshape(b.tok_shape), n_conf


def _conflict_flat(b, group_size, cfg, dtype, backend, layout=None):
    """lam (N,) flat and n_conf (B,) for a prepared batch (padded or packed). With a
    grouping.GroupLayout, rows are first moved to contiguous groups of layout.size slots."""
    if b.packed:
        L, pos = packed_layout(b)
        ids, m = pad(b, b.ids.long(), L, pos), pad(b, b.counted, L, pos)
    else:
        ids, m = b.ids.reshape(b.tok_shape), b.counted.reshape(b.tok_shape)
    if layout is None:
        conf_f, conf_b = conflict.conflict_runs(ids, m, b.adv, group_size, backend)
    else:  # padding slots: masked out, advantage 0 (inactive): they change no weight
        conf_f, conf_b = conflict.conflict_runs(layout.to_slots(ids), layout.to_slots(m, False),
                                                layout.to_slots(b.adv), layout.size, backend)
        conf_f, conf_b = conf_f[layout.slot], conf_b[layout.slot]
    lam, n_conf = conflict.weights_from_runs(conf_f, conf_b, b.adv, cfg.conflict_pos_weight,
                                             cfg.conflict_neg_weight, dtype)
    return (lam[b.seg, pos] if b.packed else lam.reshape(-1)), n_conf


def token_logprobs(logits, completion_ids, temperature=1.0, completion_mask=None, *, logits_start=0,
                   cu_seqlens=None, max_seqlen=None, validate=True, backend="auto", process_group=None):
    """Forward-only log-probs and entropies (no autograd), e.g. for the old-policy and reference
    passes: -> (logps, entropy), each of completion_ids' shape, float32 (float64 for float64 logits),
    0 where masked out (NaN at an invalid counted token when the host checks are off). Nothing of size
    tokens x vocabulary is allocated. process_group: vocabulary-parallel logits, as in gtpo_loss."""
    GTPOConfig(temperature=temperature)  # validates the temperature
    host = checks.host_checks(validate)
    logits, process_group = parallel.unwrap_dtensor(logits, process_group)
    vp = _vocab_parallel(process_group, logits, completion_ids, logits_start, cu_seqlens)
    b = checks.prepare(logits, completion_ids, completion_mask, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                       logits_start=logits_start, validate=host, vocab_size=None if vp is None else vp.V)
    backend = dispatch.resolve_backend(backend, logits.device, logits.dtype)
    if backend == "reference":
        if vp is not None:
            raise ValueError("backend='reference' takes the whole vocabulary: no process_group")
        return reference_backend.token_logprobs(b, logits, temperature)
    if vp is not None:
        vp.ids = parallel.local_ids(b.ids, vp.start, b.V)
    dt = float_dtype_for(logits)
    with torch.no_grad():
        logp, ent, _ = _forward(b, ops.as_tensor_param(temperature), backend, host, vp)
    zero = torch.zeros((), dtype=dt, device=logits.device)
    logp = torch.where(b.counted, logp.to(dt), zero)
    ent = torch.where(b.counted, ent.to(dt), zero)
    return logp.reshape(b.tok_shape), ent.reshape(b.tok_shape)


def _vocab_parallel(group, logits, completion_ids, logits_start, cu_seqlens):
    """The vocabulary-parallel layout (spec 12) after one small collective, or None without a group."""
    if group is None:
        return None
    if not isinstance(logits, torch.Tensor) or not isinstance(completion_ids, torch.Tensor):
        raise TypeError("logits and completion_ids must be tensors")
    key = [completion_ids.dim(), *completion_ids.shape, *(0,) * (2 - completion_ids.dim()), logits.dim(),
           *logits.shape[:-1], *(0,) * (3 - logits.dim()), int(logits_start), int(cu_seqlens is None)]
    start, V = parallel.vocab_layout(group, logits.shape[-1], key, logits.device)
    return parallel.VocabParallel(group, start, V)
