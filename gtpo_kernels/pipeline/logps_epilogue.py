"""The loss from per-token log-probs and entropies computed elsewhere, with its O(B) / O(N) steps in the
epilogue kernel (spec 8) instead of the eager surrogate (loss.logps_loss, its twin in tests):
gtpo_loss_from_logps on the caller's log-probs, and gtpo_loss over the sampler's kept sets (spec 13).

    from the caller's log-probs    2 launches (kernels/logps_ops.logps_epilogue), 1 in backward
    recorded kept sets             4 launches (logps_ops.replay_epilogue: the sets' layout, the replay, their
                                   checks, the epilogue), 2 in backward (and the gradient's zeros)
    recorded sets with a           the replay's own (pipeline/replay.py), then logps_epilogue (kept sets
    temperature per token          rebuilt by rules take epilogue.loss: kernels/kept_rule_triton.py)

plus autograd's seed of a scalar loss (and the top-entropy mask's key and sort, two more forward:
kernels/top_entropy.py). It takes the Triton backend on one process, a config the epilogue
covers (epilogue.covers) and log-probs that are not float64; whatever else keeps the eager path. Rollout
weights go to the epilogue as it reads them, per token (N,) or per completion (B,) (never spread on the
tokens: core/batch.rollout_weights). Unvalidated invalid input gives what the eager path gives (spec 6): a
non-finite entropy, or a kept set or row that is invalid, at a counted token makes every output NaN,
malformed cu_seqlens too; an invalid rollout weight at a counted token makes the policy term NaN.
Validating, the kernels make the value checks (the caller's log-probs and recorded sets: the batch is then
prepared without them; the sets rebuilt by rules were checked by the replay) and the status word is the call's
one host read; a failure runs the host checks to raise the error that names the argument (the eager path's).
"""
from __future__ import annotations

import torch

from ..core import checks
from ..core.sampling import unpack_mask
from ..kernels import logps_ops, loss_ops
from . import epilogue


def uses_epilogue(cfg, backend, dtype):
    """Whether the epilogue computes the loss of a call on log-probs of `dtype` (see the docstring); on a
    split vocabulary too, on the merged log-probs, alike on every rank."""
    return backend == "triton" and dtype != torch.float64 and epilogue.covers(cfg)


def _arguments(b, cfg, num_items, kernel_checks=False):
    """The epilogue's (floats, flags): the packed form on the cu_seqlens the first kernel writes; the input
    checks in the kernel when `kernel_checks` (else the call made them on the host when validating)."""
    floats, flags = epilogue.arguments(b, cfg, num_items, 1.0, kernel_checks)
    flags[loss_ops.FLAGS.index("PACKED")] = 1
    if not kernel_checks:  # (the kernel reads max_seqlen only to check it)
        flags[loss_ops.FLAGS.index("MAX_SEQLEN")] = -1
    return floats, flags


def _common(b, cfg, num_items, kernel_checks=False):
    floats, flags = _arguments(b, cfg, num_items, kernel_checks)
    mask, adv, old, ref, lam, n_conf, cu, roll, rw, hp, draws = epilogue.tensors(b, cfg, kernel_checks)
    n_items = num_items if isinstance(num_items, torch.Tensor) else None
    T = 0 if b.packed else b.tok_shape[1]
    return dict(mask=mask, cu=cu, adv=adv, old=old, ref=ref, lam=lam, n_conf=n_conf, num_items=n_items,
                roll=roll, floats=floats, flags=flags, B=b.B, T=T, rw=rw, hp=hp, draws=draws)


def logps_loss(b, cfg, logps, entropy, num_items, host, replay_metrics=None, revalidate=None, nan_all=True):
    """GTPOOutput of the loss on differentiable per-token logps (and entropies, or None: zeros and no
    entropy terms) of the tokens' shape or flat. Validating: with `revalidate` the value checks are the
    kernels' (the batch was prepared without them; a failure runs revalidate() to raise the error that names
    the argument), else they were made on the host. nan_all: unvalidated, a non-finite entropy at a counted
    token makes every output NaN (the caller's entropies); else only what reads that token is NaN (the kept
    sets' replay, which NaNs a flagged token; loss.logps_loss alike)."""
    in_kernel = host and revalidate is not None
    kw = _common(b, cfg, num_items, in_kernel)
    ids = b.given["ids"].reshape(-1) if in_kernel else None
    outs = logps_ops.logps_epilogue(logps, entropy, check=not host and entropy is not None and nan_all, ids=ids,
                                    **kw)
    # (checked in the kernels, the prep kernel's flags are input checks that revalidate() names, not rows)
    out = epilogue.output(outs[:12], None if in_kernel else outs[12], b, cfg, host, revalidate)
    return epilogue.with_metrics(out, {k: v.to(out.loss.dtype) for k, v in (replay_metrics or {}).items()})


def recorded_sets(b, cfg, tau, sampling_mask, num_items, host, revalidate=None):
    """GTPOOutput of gtpo_loss over the kept sets the engine recorded (spec 13), differentiable w.r.t. the
    logits. tau: the call's per-token temperature (n,), or None for the config's. Validating, the kernels
    check the sets and the inputs (the batch was prepared without its value checks): a nonzero status word
    (one host read) runs revalidate() (the call's input checks), then check_sampling_mask's on the host,
    to raise the error that names the argument, and a row that is not finite raises with the flags."""
    device = b.logits3.device
    if host:
        def recheck():
            revalidate()
            from ..core.sampling import check_sampling_mask_flat
            with checks.one_host_read():
                check_sampling_mask_flat(sampling_mask, b.ids, b.counted, b.logits3.shape[-1], True)
    token_ids, offsets = unpack_mask(sampling_mask, None, device)
    tau = cfg.temperature if tau is None else tau
    tau_value = 1.0
    if not isinstance(tau, torch.Tensor):
        tau, tau_value = None, float(tau)
    elif tau.numel() == 1 and tau.device != device:  # a host schedule: read without a device sync
        tau, tau_value = None, float(tau)
    kw = _common(b, cfg, num_items, host)
    outs = logps_ops.replay_epilogue(b.logits3, b.given["ids"], token_ids, offsets,
                                     None if tau is None else tau.reshape(-1), tau_value, b.logits_start, **kw)
    out = epilogue.output(outs[:12], outs[12], b, cfg, host, recheck if host else None)
    met = outs[18]
    return epilogue.with_metrics(out, {"mean_kept_size": met[0], "replay_restored_frac": met[1]})
