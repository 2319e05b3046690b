"""The TRL adapter's backbone-only forward: the model's forward with the LM head handed to a function.

- `_add_gtpo_head`: patches the model's forward (TRL's fused-head forward, or the model's own) with a
  backbone-only mode, `model(..., gtpo_head=fn)`, that hands `fn` the backbone's last hidden states and
  the LM head's weight and bias as TRL's fused head reads them (`get_output_embeddings()` per call, an
  FSDP2 DTensor gathered with `full_tensor()`, a ZeRO-3 weight gathered by `maybe_gather_lm_head_ctx`),
  the logit scale and softcap of the model's config (`_head_scaling`), and the MoE load-balancing loss
  (`_router_aux_loss`); `_base_model`: the module it goes into (PEFT's base model).
The functions it is handed, the loss and the old-policy / reference passes, are in trl_head.
"""
from __future__ import annotations

import functools
import types
from contextlib import nullcontext

try:  # FSDP2 shards parameters as DTensors
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = ()
try:  # DeepSpeed ZeRO-3: gathers the head's partitioned weight for a direct read (TRL >= 1.16)
    from trl.trainer.utils import maybe_gather_lm_head_ctx
except ImportError:  # pragma: no cover - older TRL
    def maybe_gather_lm_head_ctx(*params):
        return nullcontext()


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
