"""The policy loss on an advantage per token: what trainers with token-level losses hand over (verl's
policy-loss functions, SkyRL, OpenRLHF: (B, T) log-probs, old log-probs and token advantages, no token ids
nor groups), with GTPO's conflict weights and entropy control folded into the advantages beforehand
(api.advantages.gtpo_token_advantages).

    loss, clip_frac = token_terms(cfg, logps, old_logps, token_adv, mask, rollout_w=None, backend="auto")

Each token's advantage replaces Ahat in its term; the completions are the rows of the (B, T) batch, so a
sequence-level term (geo_mean) and a per-completion aggregation see them. On Triton, for the token-level terms
and geo_mean (nothing in them reads a completion's advantage: no entropy shaping, off-policy mask, sequence-level
ratio or vespo; geo_mean's clip takes each token's sign), the epilogue kernel reads the advantages per token (its
TOK_ADV switch): the loss in
gtpo_loss_from_logps' launches, no host read; everything else, and the torch backend, runs the eager
surrogate on the same batch (its token_adv), the kernel's twin. Unvalidated, as the trainers' own losses,
non-finite inputs at counted tokens give NaN where they reach; validate=True checks them on the host first
(one host read) and raises an error that names the argument.
"""
from __future__ import annotations

import torch

from ..core import batch, checks
from ..core.config import is_zero
from ..core.layout import Lazy, float_dtype_for
from ..kernels import dispatch
from . import logps_epilogue
from .loss import logps_loss


def in_kernel(cfg):
    """Whether the epilogue kernel computes cfg's loss on token advantages (see the docstring)."""
    return (cfg.policy_loss != "vespo" and cfg.importance_sampling_level == "token"
            and cfg.off_policy_mask_threshold is None and is_zero(cfg.entropy_penalty))


def token_terms(cfg, logps, old_logps, token_adv, mask, rollout_w=None, backend="auto", validate=False):
    """(loss, clip_frac): the loss as cfg.loss_agg aggregates it ('none': (B, T) per token, differentiable
    w.r.t. logps), and the clipped fraction of the counted tokens (0-d). logps (B, T); old_logps, token_adv
    (B, T) (not differentiated); mask (B, T) of any dtype (nonzero: counted); rollout_w (B, T) per token,
    (B, 1) per completion, or None."""
    checks.check_float_tensor("logps", logps)
    if logps.dim() != 2:
        raise ValueError(f"logps must be (B, T), got shape {tuple(logps.shape)}")
    for name, x in (("old_logps", old_logps), ("token_advantages", token_adv), ("mask", mask)):
        if not isinstance(x, torch.Tensor) or x.shape != logps.shape or x.device != logps.device:
            got = f"{tuple(x.shape)} on {x.device}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a (B, T) tensor like logps, {tuple(logps.shape)} on {logps.device}; "
                             f"got {got}")
    B, T = logps.shape
    dev, dt = logps.device, float_dtype_for(logps)
    # these batches have no token ids and no completion advantages: unvalidated, the batch holds storage of
    # their shapes, never read (the epilogue kernel reads the mask as given, nonzero = counted, and the token
    # advantages), and zeros made on first use (the eager surrogate's b.ids, b.adv): no launch
    new = torch.zeros if validate else torch.empty
    with checks.one_host_read():  # validating: the values read on the host together, once
        b = batch.prepare_tokens(new((B, T), dtype=torch.long, device=dev),
                                 mask != 0 if validate and mask.dtype != torch.bool else mask,
                                 new(B, dtype=dt, device=dev), device=dev, validate=validate, allow_empty=True)
        batch.add_extras(b, dev, validate=validate, old_logps=old_logps.detach(), rollout_is_weights=rollout_w)
        if not validate:
            b.ids_ = Lazy(lambda: torch.zeros(B * T, dtype=torch.long, device=dev))
            b.adv_ = Lazy(lambda: torch.zeros(B, dtype=dt, device=dev))
        b.token_adv = token_adv.detach().reshape(-1)
        if validate:
            checks.check_finite("token_advantages", b.token_adv, b.counted)
            checks.check_finite("logps", logps.detach(), b.counted)
    backend = dispatch.resolve_backend(backend, dev, logps.dtype)
    if in_kernel(cfg) and logps_epilogue.uses_epilogue(cfg, backend, logps.dtype):
        out = logps_epilogue.logps_loss(b, cfg, logps, None, None, False)
        return out.loss, out.metrics["clip_frac"]
    loss, res = logps_loss(b, cfg, logps, None, None, float_dtype_for(logps), False)
    return loss, res["metrics"]["clip_frac"]
