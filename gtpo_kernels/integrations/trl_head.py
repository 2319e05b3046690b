"""The TRL adapter's LM head: the loss and the old-policy / reference log-probs without the logits.

- `_add_gtpo_head`: patches the model's forward (TRL's fused-head forward, or the model's own) with a
  backbone-only mode, `model(..., gtpo_head=fn)`, that hands `fn` the backbone's last hidden states and
  the LM head's weight and bias as TRL's fused head reads them (`get_output_embeddings()` per call, an
  FSDP2 DTensor gathered with `full_tensor()`, a ZeRO-3 weight gathered by `maybe_gather_lm_head_ctx`),
  the logit scale and softcap of the model's config (`_head_scaling`), and the MoE load-balancing loss
  (`_router_aux_loss`); `_base_model`: the module it goes into (PEFT's base model);
- `_fused_loss`: `linear_gtpo_loss` on the hidden states before the completion tokens (`_completion_rows`,
  a view) in the head's compute dtype (`_head_dtypes`), a tile of `_memory_budget` bytes at a time;
- `_logits_loss`: gtpo_head='logits', for debugging: the model's logits (logits_to_keep = T + 1), gtpo_loss;
- `_fused_logps_and_entropies`: TRL's old-policy / reference pass through `linear_token_logprobs`, in
  TRL's row chunks (`GTPOTrainer._get_per_token_logps_and_entropies` chooses it or TRL's own);
  `_logits_logps_and_entropies`: the same pass with gtpo_head='logits' and kept sets on (the model's
  logits and `token_logprobs`).
Every pass takes the same kept-set keywords (trl_config._replay_kwargs: the sampler's top_k / top_p /
min_p, or the rollout's recorded sampling_mask), so old, reference and current log-probs are over the
sampler's sets (spec 13).
"""
from __future__ import annotations

import functools
import types
from contextlib import nullcontext

import torch

try:  # FSDP2 shards parameters as DTensors
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = ()
try:  # DeepSpeed ZeRO-3: gathers the head's partitioned weight for a direct read (TRL >= 1.16)
    from trl.trainer.utils import maybe_gather_lm_head_ctx
except ImportError:  # pragma: no cover - older TRL
    def maybe_gather_lm_head_ctx(*params):
        return nullcontext()

from .. import gtpo_loss, linear_gtpo_loss, linear_token_logprobs, token_logprobs
from .trl_config import _replay_kwargs


class _HeadOutput:
    """What a forward with gtpo_head=fn returns: fn's result and the MoE load-balancing loss (or None).
    A plain object, so that wrappers converting output tensors (accelerate's fp32 outputs) leave it alone."""

    def __init__(self, value, aux_loss):
        self.value, self.aux_loss = value, aux_loss


def _base_model(model):
    """The module TRL patches with its fused head: PEFT's base model, else the model."""
    from accelerate.utils import is_peft_model
    return model.get_base_model() if is_peft_model(model) else model


def _head_scaling(text_config):
    """(logit_scale, logit_softcap) of a model's config, read as TRL 1.16's add_fused_lm_head reads them:
    Gemma's final_logit_softcapping; logit_scale, output_multiplier, lm_head_multiplier, or Granite /
    MiniCPM3's 1 / logits_scaling (HyperCLOVA X multiplies by it)."""
    cap = getattr(text_config, "final_logit_softcapping", None)
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        ls = text_config.logits_scaling
        scale = ls if getattr(text_config, "model_type", None) == "hyperclovax" else 1 / ls
    return (1.0 if scale is None else float(scale)), (None if cap is None else float(cap))


def _add_gtpo_head(model):
    """Patches model.forward (TRL's fused-head forward, or the model's own) so that
    `model(..., gtpo_head=fn)` runs the backbone only and returns `_HeadOutput(fn(hidden, weight, bias,
    logit_scale, logit_softcap), aux_loss)`: hidden the backbone's last hidden states (B, L, D) on the
    head's device, weight / bias the LM head's (an FSDP2 DTensor gathered with full_tensor, a ZeRO-3
    partitioned one gathered for the call), as TRL's fused head does. Without gtpo_head the previous
    forward runs (generation, TRL's own calls). Idempotent."""
    if getattr(model, "_gtpo_head_added", False):
        return
    import transformers
    from packaging.version import Version

    previous = model.forward
    text_config = model.config.get_text_config()
    logit_scale, logit_softcap = _head_scaling(text_config)
    # as TRL: before transformers 5, vision-language models expose their language backbone as `model`
    backbone_attr = "base_model"
    if text_config is not model.config and Version(transformers.__version__) < Version("5.0.0"):
        backbone_attr = "model"

    @functools.wraps(type(model).forward)  # keeps the signature: generate validates its kwargs against it
    def _gtpo_forward(self, *args, gtpo_head=None, **kwargs):
        if gtpo_head is None:
            return previous(*args, **kwargs)
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        backbone_out = getattr(self, backbone_attr)(*args, **kwargs)
        lm_head = self.get_output_embeddings()  # looked up per call: FSDP and PEFT replace modules
        weight, bias = lm_head.weight, lm_head.bias
        hidden = backbone_out.last_hidden_state.to(weight.device)
        if isinstance(weight, DTensor):  # FSDP2: gather the sharded head (differentiable)
            weight = weight.full_tensor()
            if bias is not None:
                bias = bias.full_tensor()
        with maybe_gather_lm_head_ctx(weight, bias):
            value = gtpo_head(hidden, weight, bias, logit_scale, logit_softcap)
        aux = None
        if kwargs.get("output_router_logits"):
            aux = _router_aux_loss(self, text_config, backbone_out.router_logits, kwargs.get("attention_mask"))
        return _HeadOutput(value, aux)

    model.forward = types.MethodType(_gtpo_forward, model)
    model._gtpo_head_added = True


def _router_aux_loss(model, text_config, router_logits, attention_mask):
    """The MoE load-balancing loss as TRL 1.16's fused head computes it (Mixtral's)."""
    import transformers
    from packaging.version import Version
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    v = Version(transformers.__version__)
    if v < Version("5.0.0") or (text_config.model_type == "gpt_oss" and v < Version("5.6.0")):
        num_experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
        num_experts = text_config.num_experts if num_experts is None else num_experts
        top_k = text_config.num_experts_per_tok if top_k is None else top_k
    else:
        num_experts, top_k = text_config.num_experts, text_config.num_experts_per_tok
    return load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)


def _completion_rows(hidden, T):
    """The rows predicting the last T tokens: positions L-T-1 .. L-2 of (B, L, D), a view."""
    L = hidden.size(1)
    if L < T + 1:
        raise RuntimeError(f"the backbone returned {L} positions for {T} completion tokens")
    return hidden[:, L - T - 1:L - 1]


def _head_dtypes(hidden, weight, bias, fp32):
    """The head's compute dtype, as TRL's fused head: float32 with cast_lm_head_to_fp32, else autocast's
    dtype when autocast is on, else the hidden states'. Returns hidden, weight, bias in it and a context
    that turns autocast off for the call (the kernels choose their own accumulation dtypes)."""
    dev = hidden.device.type
    on = torch.is_autocast_enabled(dev)
    dt = torch.float32 if fp32 else (torch.get_autocast_dtype(dev) if on else hidden.dtype)

    def cast(x):
        return x if x is None or x.dtype == dt else x.to(dt)
    return cast(hidden), cast(weight), cast(bias), (torch.autocast(dev, enabled=False) if on else nullcontext())


def _memory_budget(budget, hidden, weight):
    """gtpo_memory_budget, or by default TRL's fused-head tile (4096 tokens x min(V, 32768) vocabulary
    entries in the compute dtype) for the tile and its gradient: no tile holds more logits than TRL's."""
    if budget is not None:
        return int(budget)
    try:
        from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE as tokens
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as vocab
    except ImportError:  # pragma: no cover - another TRL: its 1.16 values
        tokens, vocab = 4096, 32768
    return 2 * int(tokens) * min(int(vocab), weight.shape[0]) * hidden.element_size()


def _zero3():
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:  # pragma: no cover
        return False
    return bool(is_deepspeed_zero3_enabled())




def _fused_loss(trainer, model, model_kwargs, inputs, mask, T, loss_kw):
    """The model's backbone-only forward with linear_gtpo_loss as its head -> (the loss's output, the
    _HeadOutput, whose aux_loss is the MoE load-balancing loss). Inside the model's forward (as TRL's fused head: FSDP / ZeRO-3 / DDP hooks armed),
    the hidden states of the T positions before each completion token and the LM head's weight go to
    linear_gtpo_loss, a tile of logits at a time."""
    fp32 = bool(getattr(trainer.args, "cast_lm_head_to_fp32", False))
    completion_ids = inputs["completion_ids"]

    def head(hidden, weight, bias, logit_scale, logit_softcap):
        h = _completion_rows(hidden, T)
        h, w, b, no_autocast = _head_dtypes(h, weight, bias, fp32)
        dev = w.device
        budget = _memory_budget(trainer.gtpo_memory_budget, h, w)
        kw = {k: _to(v, dev) for k, v in loss_kw.items()}
        # ZeRO-3 re-partitions the weight after the forward: only the schedule that forms the
        # gradient in the forward can run there
        schedule = "fused" if _zero3() else "auto"
        try:
            with no_autocast, _head_replays(kw):
                return linear_gtpo_loss(h, w, completion_ids.to(dev), inputs["advantages"].to(dev),
                                        mask.to(dev), bias=b, logit_scale=logit_scale,
                                        logit_softcap=logit_softcap, memory_budget=budget,
                                        schedule=schedule, **kw)
        except ValueError as e:
            if schedule == "fused" and "schedule='fused'" in str(e):
                raise ValueError("under DeepSpeed ZeRO-3 the fused LM head needs a loss whose gradient "
                                 "is formed in the forward (" + str(e) + "); set gtpo_head='logits' "
                                 "or raise gtpo_memory_budget") from e
            raise

    with trainer.accelerator.autocast():
        outputs = model(**model_kwargs, gtpo_head=head)
    return outputs.value, outputs


def _to(v, dev):
    """A tensor, or a sampling_mask pair of them, on `dev`."""
    if isinstance(v, torch.Tensor):
        return v.to(dev)
    if isinstance(v, tuple):
        return tuple(_to(x, dev) for x in v)
    return v


class _head_replays:
    """Around a fused-head call with kept-set keywords: a head that does not replay the sampler's kept
    sets yet (a "does not replay" ValueError, or no such keyword) is reported with the adapter's way out."""

    def __init__(self, kw):
        self.given = [k for k in ("sampling_mask", "top_k", "top_p", "min_p") if kw.get(k) is not None]

    def __enter__(self):
        return self

    def __exit__(self, typ, e, tb):
        if not self.given or e is None:
            return False
        msg = str(e)
        if (typ is ValueError and "does not replay" in msg) or (typ is TypeError and "unexpected keyword" in msg):
            raise NotImplementedError(
                f"the fused LM head does not take the sampler's kept sets ({', '.join(self.given)}) in this "
                f"version of gtpo_kernels ({msg}); set gtpo_head='logits' (the model's logits and gtpo_loss, "
                "which replay them), or turn the sampler's top_k / top_p / min_p off") from e
        return False


def _logits_loss(trainer, model, model_kwargs, inputs, mask, T, loss_kw):
    """gtpo_head='logits' (for debugging): the model's own forward and gtpo_loss on its logits ->
    (the loss's output, the model's outputs)."""
    # Logits of the last T + 1 positions: row t (the position before completion token t) predicts
    # completion token t; the last row predicts past the end and gets a zero gradient.
    with trainer.accelerator.autocast():
        outputs = model(**model_kwargs, logits_to_keep=T + 1, use_cache=False)
    logits = outputs.logits
    logits_start = logits.size(1) - T - 1  # 0 unless the model ignored logits_to_keep
    if logits_start < 0:
        raise RuntimeError(f"the model returned {logits.size(1)} logit rows for {T} completion tokens")
    out = gtpo_loss(logits, inputs["completion_ids"], inputs["advantages"], mask, logits_start=logits_start,
                    **loss_kw)
    return out, outputs


def _fused_logps_and_entropies(trainer, model, input_ids, attention_mask, logits_to_keep, batch_size,
                               compute_entropy, rows=None):
    """TRL's old-policy and reference log-probs (no gradient, text only) through the fused head:
    linear_token_logprobs on the backbone's hidden states, chunked over rows as TRL does, over the
    sampler's kept sets when they are on (rows: the rollout's recorded sets, one per completion) ->
    (logps, entropies or None, None) as TRL 1.16's _get_per_token_logps_and_entropies."""
    fp32 = bool(getattr(trainer.args, "cast_lm_head_to_fp32", False))
    K = logits_to_keep
    tau = trainer.gtpo_config.temperature  # the sampler's (generation_kwargs may override GRPOConfig's)
    batch_size = batch_size or input_ids.size(0)
    all_logps, all_ent = [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids = input_ids[start:start + batch_size]
        am = attention_mask[start:start + batch_size]
        replay = _replay_kwargs(trainer, None if rows is None else rows[start:start + batch_size], am[:, -K:],
                                am[:, -K:])

        def head(hidden, weight, bias, logit_scale, logit_softcap, ids=ids, am=am, replay=replay):
            h, w, b, no_autocast = _head_dtypes(_completion_rows(hidden, K), weight, bias, fp32)
            dev = w.device
            kw = {k: _to(v, dev) for k, v in replay.items()}
            with no_autocast, _head_replays(kw):
                return linear_token_logprobs(h, w, ids[:, -K:].to(dev), tau, am[:, -K:].to(dev),
                                             bias=b, logit_scale=logit_scale, logit_softcap=logit_softcap,
                                             memory_budget=_memory_budget(trainer.gtpo_memory_budget, h, w),
                                             validate=trainer.gtpo_validate, backend=trainer.gtpo_backend, **kw)

        with trainer.accelerator.autocast():
            lp, ent = model(input_ids=ids, attention_mask=am, gtpo_head=head).value
        trainer._gtpo_logprob_calls += 1
        all_logps.append(lp)
        all_ent.append(ent)
    return torch.cat(all_logps, 0), (torch.cat(all_ent, 0) if compute_entropy else None), None


def _logits_logps_and_entropies(trainer, model, input_ids, attention_mask, logits_to_keep, batch_size,
                                compute_entropy, rows=None):
    """The old-policy and reference pass of gtpo_head='logits' with the sampler's kept sets on: the
    model's logits of the last K + 1 positions (as _logits_loss) and token_logprobs over the kept sets,
    chunked over rows as TRL does -> (logps, entropies or None, None)."""
    K = logits_to_keep
    tau = trainer.gtpo_config.temperature
    batch_size = batch_size or input_ids.size(0)
    all_logps, all_ent = [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids = input_ids[start:start + batch_size]
        am = attention_mask[start:start + batch_size]
        replay = _replay_kwargs(trainer, None if rows is None else rows[start:start + batch_size], am[:, -K:],
                                am[:, -K:])
        with trainer.accelerator.autocast():
            logits = model(input_ids=ids, attention_mask=am, logits_to_keep=K + 1, use_cache=False).logits
        logits_start = logits.size(1) - K - 1
        if logits_start < 0:
            raise RuntimeError(f"the model returned {logits.size(1)} logit rows for {K} completion tokens")
        dev = logits.device
        lp, ent = token_logprobs(logits, ids[:, -K:].to(dev), tau, am[:, -K:].to(dev), logits_start=logits_start,
                                 validate=trainer.gtpo_validate, backend=trainer.gtpo_backend,
                                 **{k: _to(v, dev) for k, v in replay.items()})
        trainer._gtpo_logprob_calls += 1
        all_logps.append(lp)
        all_ent.append(ent)
    return torch.cat(all_logps, 0), (torch.cat(all_ent, 0) if compute_entropy else None), None
