"""The public calls: gtpo_loss, conflict_weights, token_logprobs."""
from __future__ import annotations

import dataclasses
import numbers
import warnings
from typing import Dict

import torch

from . import autograd, checks, conflict, dispatch
from .autograd import out_dtype
from .config import GTPOConfig, as_config, is_zero
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
              inplace=False, validate=True, backend="auto") -> GTPOOutput:
    """The GTPO policy-gradient loss (spec: docs/GTPO_SPEC.md), fused over the vocabulary.

    In one line of torch, for the default config (padded form, every token counted)::

        logp = log_softmax(logits[:, s:s+T] / tau, -1).gather(-1, ids[..., None])[..., 0]
        loss = mean_i mean_t -lam * min(r * Ahat, clip(r, 1-eps_low, 1+eps_high) * Ahat)

    with r = exp(logp - old_logps) (or 1 on-policy), Ahat the entropy-shaped advantage and lam the
    conflict-token weights. Nothing of size tokens x vocabulary is allocated besides the gradient.

    logits          (B, T_l, V) float16/bfloat16/float32/float64, any strides; row logits_start + t
                    predicts completion_ids[:, t]. Packed form (cu_seqlens given): (N_l, V).
    completion_ids  (B, T) (packed: (N,)) any integer dtype; ignored where the mask is 0.
    advantages      (B,) or (B, 1), one per completion.
    completion_mask (B, T) (packed: (N,)) bool/int/float, 1 = counted; default all counted.
    group_size      completions per prompt (groups are contiguous); needed for the conflict weights
                    unless lam/n_conf come from `conflict_weights`.
    config          a GTPOConfig or a preset name ('gtpo', 'gtpo-official', 'grpo', 'dapo', 'dr_grpo').
    lam, n_conf     precomputed conflict weights from `conflict_weights` (shape of completion_ids, and
                    (B,)); when given they are used as they are, whatever config.use_conflict_mask says.
    old_logps       (shape of completion_ids) the sampling policy's log-probs; None = on-policy.
    ref_logps       the reference model's log-probs, needed when config.beta > 0.
    logits_start    row of logits that predicts completion token 0.
    num_items_in_batch  global counted-token normalizer of 'token-mean' (gradient accumulation, DP).
    inplace         write the gradient into the logits' storage (saves one logits-sized buffer; the
                    logits are overwritten during backward). Off by default.
    validate        host-side checks (ids in range, non-finite counted rows); False = no host sync.
    backend         'auto' (Triton on CUDA, chunked torch on CPU), 'triton', 'torch' or 'reference'.
    """
    cfg = as_config(config)
    if advantages is None:
        raise TypeError("advantages is required: a (B,) tensor, one advantage per completion")
    b = checks.prepare(logits, completion_ids, completion_mask, advantages=advantages, old_logps=old_logps,
                       ref_logps=ref_logps, lam=lam, n_conf=n_conf, cu_seqlens=cu_seqlens,
                       max_seqlen=max_seqlen, logits_start=logits_start, validate=validate)
    if ref_logps is None and not is_zero(cfg.beta):
        raise ValueError("config.beta > 0 (or a tensor beta) needs ref_logps (the reference model's "
                         "log-probs, shape of completion_ids); or set beta=0")
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool, got {inplace!r}")
    if inplace and logits.stride(-1) != 1:
        raise ValueError("inplace=True needs logits with vocabulary stride 1 (it writes the gradient "
                         "into their storage)")
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(logits.device, out_dtype(logits)).clamp(min=1)
        elif isinstance(num_items_in_batch, numbers.Real) and not isinstance(num_items_in_batch, bool) \
                and num_items_in_batch > 0:
            num_items_in_batch = max(float(num_items_in_batch), 1.0)
        else:
            raise ValueError(f"num_items_in_batch must be a positive number or tensor, "
                             f"got {num_items_in_batch!r}")
    backend = dispatch.resolve_backend(backend, logits.device)
    if backend == "reference":
        return _reference(b, logits, cfg, group_size, old_logps, ref_logps, lam, n_conf, num_items_in_batch)

    if cfg.use_conflict_mask and (b.lam is None or
                                  (b.n_conf is None and cfg.loss_agg == "gtpo-official")):
        group_size = checks.check_group_size(group_size, b.B)
        lam_c, n_conf_c = _conflict_flat(b, group_size, cfg, out_dtype(logits), backend == "triton")
        b.lam = b.lam if b.lam is not None else lam_c
        b.n_conf = b.n_conf if b.n_conf is not None else n_conf_c
    if b.lam is not None:  # ignored where masked out, as everything else
        b.lam = torch.where(b.counted, b.lam, torch.ones_like(b.lam))

    loss, logps, entropy, per_token, res = _fused_loss(b, cfg, backend, inplace, validate, num_items_in_batch)
    if validate and cfg.entropy_threshold is not None and not bool(res["kept"].any()) and bool(b.counted.any()):
        warnings.warn(
            f"gtpo_loss: the entropy filter dropped every completion (mean entropy above entropy_threshold="
            f"{float(cfg.entropy_threshold):.3g}), so the loss and its gradient are zero. A model more uncertain than "
            f"that from the start needs GTPOConfig(initial_entropy=<its mean entropy>) (the paper's gate) or "
            f"entropy_threshold=None; out.metrics['filtered_frac'] tracks it.", stacklevel=2)
    dt = out_dtype(logits)
    lam_out = torch.ones(b.tok_shape, dtype=dt, device=logits.device) if b.lam is None else \
        b.lam.to(dt).reshape(b.tok_shape)
    n_conf_out = torch.ones(b.B, dtype=dt, device=logits.device) if b.n_conf is None else b.n_conf.to(dt)
    return GTPOOutput(loss=loss, logps=logps, entropy=entropy, per_token_loss=per_token, lam=lam_out,
                      n_conf=n_conf_out, kept=res["kept"], seq_entropy=res["seq_entropy"],
                      metrics=res["metrics"])


def _fused_loss(b, cfg, backend, inplace, validate, num_items):
    """Forward pass -> O(N) surrogate -> the loss value with the backward pass attached."""
    dt = out_dtype(b.logits3)
    with torch.no_grad():
        temperature = autograd.as_tensor_param(cfg.temperature)
        logp, ent, stats, bad = autograd.vocab_fwd(b.logits3.detach(), b.ids, b.counted, temperature,
                                                    b.logits_start, backend)
        if validate:
            checks.raise_on_flags(bad, b.tok_shape)
        res = surrogate(logp.to(dt), ent.to(dt), b.counted, b.seg, b.B, b.adv, cfg, old=b.old, ref=b.ref,
                        lam=b.lam, n_conf=b.n_conf, num_items=num_items, max_len=b.max_len)
        weighted = res["weight"] * res["loss_tok"]
        value = weighted.reshape(b.tok_shape) if cfg.loss_agg == "none" else \
            weighted.sum(dtype=torch.float64).to(weighted.dtype)
        cdt = stats.dtype  # the kernel's coefficients in its accumulation dtype
        c = res["c"].to(cdt)
        e = None if res["e"] is None else res["e"].to(cdt)
    args = (b.logits3, value, b.ids, stats, ent, c, e, temperature, b.logits_start, backend)
    loss = autograd.attach_grad(*args, inplace)
    return (loss, res["logp"].reshape(b.tok_shape), res["ent"].reshape(b.tok_shape),
            res["loss_tok"].reshape(b.tok_shape), res)


def conflict_weights(completion_ids, completion_mask, advantages, group_size, *, config=None,
                     cu_seqlens=None, max_seqlen=None, dtype=torch.float32, backend="auto"):
    """Conflict-token weights (spec section 3) -> (lam, n_conf).

    Call it once per batch when the advantages are computed (groups must be whole), then pass
    `lam=lam[rows], n_conf=n_conf[rows]` to `gtpo_loss` for any micro-batch of rows. lam has the shape
    of completion_ids ((B, T), or (N,) packed) and n_conf is (B,). Weights come from `config`
    (default GTPOConfig(): w_pos = 2.0, w_neg = 0.0). backend: 'auto' (a Triton kernel on CUDA, sort-based
    torch ops on the CPU), 'triton' or 'torch'; neither syncs with the host (packed form: give max_seqlen).
    """
    cfg = GTPOConfig() if config is None else as_config(config)
    if advantages is None:
        raise TypeError("advantages is required: a (B,) tensor, one advantage per completion")
    b = checks.prepare_tokens(completion_ids, completion_mask, advantages, cu_seqlens=cu_seqlens,
                              max_seqlen=max_seqlen, validate=True)
    group_size = checks.check_group_size(group_size, b.B)
    use_triton = dispatch.resolve_backend(backend, completion_ids.device) == "triton"
    lam, n_conf = _conflict_flat(b, group_size, cfg, dtype, use_triton)
    return lam.reshape(b.tok_shape), n_conf


def _conflict_flat(b, group_size, cfg, dtype, use_triton=False):
    """lam (N,) flat and n_conf (B,) for a prepared batch (padded or packed)."""
    if b.packed:
        L, pos = _packed_layout(b)
        ids, m = _pad(b, b.ids.long(), L, pos), _pad(b, b.counted, L, pos)
    else:
        ids, m = b.ids.reshape(b.tok_shape), b.counted.reshape(b.tok_shape)
    conf_f, conf_b = conflict.conflict_runs(ids, m, b.adv, group_size, use_triton)
    lam, n_conf = conflict.weights_from_runs(conf_f, conf_b, b.adv, cfg.conflict_pos_weight,
                                             cfg.conflict_neg_weight, dtype)
    return (lam[b.seg, pos] if b.packed else lam.reshape(-1)), n_conf


def _packed_layout(b):
    """Packed form: the padded length L (max_seqlen, or the longest completion: a host read) and
    pos[k], the position of token k inside its completion."""
    cu = b.cu_seqlens.long()
    L = b.max_seqlen if b.max_seqlen is not None else int((cu[1:] - cu[:-1]).max())
    return L, torch.arange(b.ids.numel(), device=b.ids.device) - cu[b.seg]


def _pad(b, x, L, pos, fill=0):
    """Packed per-token values (N,) -> padded (B, L), `fill` elsewhere."""
    out = torch.full((b.B, L), fill, dtype=x.dtype, device=x.device)
    out[b.seg, pos] = x.reshape(-1)
    return out


def token_logprobs(logits, completion_ids, temperature=1.0, completion_mask=None, *, logits_start=0,
                   cu_seqlens=None, max_seqlen=None, validate=True, backend="auto"):
    """Forward-only log-probs and entropies (no autograd), e.g. for the old-policy and reference
    passes: -> (logps, entropy), each of completion_ids' shape, float32 (float64 for float64 logits),
    0 where masked out. Nothing of size tokens x vocabulary is allocated."""
    GTPOConfig(temperature=temperature)  # validates the temperature
    t_param = autograd.as_tensor_param(temperature)
    b = checks.prepare(logits, completion_ids, completion_mask, cu_seqlens=cu_seqlens,
                       max_seqlen=max_seqlen, logits_start=logits_start, validate=validate)
    backend = dispatch.resolve_backend(backend, logits.device)
    dt = out_dtype(logits)
    if backend == "reference":
        return _reference_logprobs(b, logits, temperature)
    with torch.no_grad():
        logp, ent, _, bad = autograd.vocab_fwd(b.logits3.detach(), b.ids, b.counted, t_param,
                                                  b.logits_start, backend)
    if validate:
        checks.raise_on_flags(bad, b.tok_shape)
    zero = torch.zeros((), dtype=dt, device=logits.device)
    logp = torch.where(b.counted, logp.to(dt), zero)
    ent = torch.where(b.counted, ent.to(dt), zero)
    return logp.reshape(b.tok_shape), ent.reshape(b.tok_shape)


# ---- the reference backend (the oracle, for validation): padded inputs, the same outputs ----

def _padded_window(b, logits):
    """For the reference: the logits rows that predict tokens as (B, L, V), ids (B, L), mask (B, L),
    `unpad` (a padded (B, L) result -> the caller's token shape) and `pad` (the reverse)."""
    if not b.packed:
        T = b.tok_shape[1]
        same = (lambda x: x)
        return (logits[:, b.logits_start:b.logits_start + T], b.ids.reshape(b.tok_shape),
                b.counted.reshape(b.tok_shape), same, same)
    L, pos = _packed_layout(b)
    rows = torch.arange(b.ids.numel(), device=logits.device) + b.logits_start
    return (logits[_pad(b, rows, L, pos, fill=b.logits_start)], _pad(b, b.ids.long(), L, pos),
            _pad(b, b.counted, L, pos), (lambda x: x[b.seg, pos]), (lambda x: _pad(b, x, L, pos)))


def _reference_logprobs(b, logits, temperature):
    import gtpo_reference
    lg, ids, m, unpad, _ = _padded_window(b, logits)
    lp, ent = gtpo_reference.token_logprobs(lg, ids, float(temperature), m)
    dt = out_dtype(logits)
    return unpad(lp).to(dt), unpad(ent).to(dt)


def _reference(b, logits, cfg, group_size, old_logps, ref_logps, lam, n_conf, num_items):
    import gtpo_reference
    kw = {k: float(v) if isinstance(v, torch.Tensor) else v for k, v in dataclasses.asdict(cfg).items()}
    lg, ids, m, unpad, pad = _padded_window(b, logits)
    opt = (lambda x: None if x is None else pad(x))
    if b.packed and kw["max_completion_length"] is None:
        kw["max_completion_length"] = int(b.max_len)  # the longest completion
    r = gtpo_reference.gtpo_loss(lg, ids, b.adv, m, group_size=group_size, old_logps=opt(old_logps),
                                 ref_logps=opt(ref_logps), lam=opt(lam), n_conf=n_conf,
                                 num_items_in_batch=num_items, **kw)
    dt = out_dtype(logits)  # the reference computes in float64; the contract's outputs are float32
    loss = unpad(r["loss"]) if cfg.loss_agg == "none" else r["loss"]
    return GTPOOutput(loss=loss.to(dt), logps=unpad(r["logps"]).to(dt), entropy=unpad(r["entropy"]).to(dt),
                      per_token_loss=unpad(r["per_token_loss"]).to(dt), lam=unpad(r["lam"]).to(dt),
                      n_conf=r["n_conf"].to(dt), kept=r["kept"], seq_entropy=r["seq_entropy"].to(dt),
                      metrics={k: v.to(dt) for k, v in r["metrics"].items()})
