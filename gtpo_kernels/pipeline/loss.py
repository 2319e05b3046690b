"""The loss between the public calls and the passes: shared by gtpo_loss, gtpo_loss_from_logps and the
fused LM head. Config-dependent checks, the conflict weights the loss uses, the forward pass with its
flags (whole vocabulary or vocabulary-parallel), the O(N) surrogate, the loss value with the backward
attached, and the output."""
from __future__ import annotations


import torch

from ..core import checks
from ..core.config import is_zero
from ..core.flags import nan_at_flags, nan_where
from ..core.layout import float_dtype_for
from ..core.output import GTPOOutput
from ..distributed import agree
from ..distributed import vocab_parallel as parallel
from ..kernels import autograd  # noqa: F401  (registers attach_grad's backward)
from ..kernels import ops
from ..objective.conflict import conflict_flat
from ..objective.mismatch import rollout_metrics
from ..objective.surrogate import surrogate


def check_loss_args(b, cfg, num_items_in_batch, dt, validate=True, raw=False):
    """Checks that depend on the config; returns num_items_in_batch as the surrogate takes it (raw: as the
    epilogue kernel takes it, see checks.check_num_items)."""
    if b.ref is None and not is_zero(cfg.beta):
        raise ValueError("config.beta > 0 (or a tensor beta) needs ref_logps (the reference model's "
                         "log-probs, shape of completion_ids); or set beta=0")
    if cfg.loss_agg == "none" and cfg.importance_sampling_level == "sequence":
        raise ValueError("loss_agg='none' with importance_sampling_level='sequence' is refused: each token's "
                         "loss then depends on every token of its completion, so a per-token upstream "
                         "gradient has no per-token meaning; aggregate the loss instead")
    if num_items_in_batch is not None and cfg.local_count and cfg.loss_agg == "token-mean":
        raise ValueError("num_items_in_batch with config local_count=True (the 'bnpo' preset): bnpo divides by this "
                         "call's count of tokens, never by num_items_in_batch (spec 9); pass config='dapo', or "
                         "GTPOConfig(loss_agg='token-mean'), to divide by num_items_in_batch")
    return checks.check_num_items(num_items_in_batch, cfg.loss_agg, b.given["ids"].device, dt, validate, raw)


def conflicts_for(b, cfg, group_size, dt, backend, epilogue=False, defer=False):
    """The conflict weights the loss uses: given (b.lam / b.n_conf) or computed here; 1 off the mask.
    epilogue: for the epilogue kernel, which reads them only where counted: with number weights, one
    kernel on the call's tensors as given (b.given; the batch's derived fields are never formed); defer:
    that kernel's launch deferred (b.conflicts, a conflict_triton.Deferred: a split vocabulary's sums launch
    runs it, spec 8)."""
    if cfg.use_conflict_mask and (b.lam is None or
                                  (b.n_conf is None and cfg.loss_agg == "gtpo-official")):
        group_size = checks.check_group_size(group_size, b.B)
        w = (cfg.conflict_pos_weight, cfg.conflict_neg_weight)
        if epilogue and not any(isinstance(x, torch.Tensor) for x in w):
            g = b.given
            args = (g["ids"].contiguous(), None if b.mask is None else b.mask.contiguous(), g["adv"].contiguous(),
                    None if g["cu_seqlens"] is None else g["cu_seqlens"].contiguous(),
                    0 if b.packed else b.tok_shape[1], group_size, float(w[0]), float(w[1]))
            if defer:
                from ..kernels.conflict_triton import Deferred
                b.conflicts = Deferred(*args)
                lam_c, n_conf_c = b.conflicts.lam, b.conflicts.n_conf
            else:
                lam_c, n_conf_c = ops.conflict_weights(*args)
        else:
            lam_c, n_conf_c = conflict_flat(b, group_size, cfg, dt, backend)
        b.lam = b.lam if b.lam is not None else lam_c
        b.n_conf = b.n_conf if b.n_conf is not None else n_conf_c
    if b.lam is not None and not epilogue:  # ignored where masked out, as everything else
        b.lam = torch.where(b.counted, b.lam, torch.ones_like(b.lam))


def run_surrogate(b, cfg, logp, ent, num_items, dt, totals=None):
    """The O(N) surrogate on the batch's tokens (totals: the whole batch's counts when b is a slice of
    it, the fused LM head's tile). An unvalidated malformed cu_seqlens: every metric NaN too."""
    res = surrogate(logp.to(dt), ent.to(dt), b.counted, b.seg, b.B, b.adv, cfg, old=b.old, ref=b.ref,
                    lam=b.lam, n_conf=b.n_conf, num_items=num_items, max_len=b.max_len,
                    rollout_w=b.rollout_w, rollout_w_seq=b.rollout_w_seq, rollout_logps=b.rollout_logps,
                    totals=totals, token_adv=b.token_adv)
    if b.malformed is not None:
        res["metrics"] = nan_where(b.malformed, res["metrics"])
    return res


def value_and_coefficients(b, cfg, logp, ent, num_items, dt, cdt):
    """Surrogate -> (res, the loss value, c, e in the kernels' dtype cdt), without autograd: what the
    logits path and the fused LM head attach their backward to."""
    with torch.no_grad():
        res = run_surrogate(b, cfg, logp, ent, num_items, dt)
        value = loss_value(b, cfg, res)
        c = res["c"].to(cdt)
        e = None if res["e"] is None else res["e"].to(cdt)
    return res, value, c, e


def logps_loss(b, cfg, logps, entropy, num_items, dt, host, nan_all=True):
    """The loss from per-token log-probs (and entropies) differentiable elsewhere: the O(N) surrogate,
    then the value with d/dlogps = c and d/dentropy = e attached (x - sg(x) is 0 with gradient 1).
    Unvalidated malformed cu_seqlens, or with `nan_all` a non-finite entropy at a counted token (the
    caller's entropies): every output NaN. Without (the kept sets, recorded or rebuilt by rules: NaN at a
    flagged token) only what reads that token is NaN, as on the logits path and the Triton replay.
    -> (loss, res)."""
    zero = torch.zeros((), dtype=dt, device=logps.device)
    raw = logps.reshape(-1).to(dt)
    # a log-prob that is not finite (+-inf, unvalidated): NaN, and so its gradient, as the kernels make it
    raw = raw + torch.where(torch.isfinite(raw.detach()), zero, torch.full_like(zero, float("nan")))
    lp = torch.where(b.counted, raw, zero)  # gradient only where counted
    ent = zero.expand(lp.shape) if entropy is None else torch.where(b.counted, entropy.reshape(-1).to(dt), zero)
    with torch.no_grad():
        res = run_surrogate(b, cfg, lp.detach(), ent.detach(), num_items, dt)
        value = loss_value(b, cfg, res)
        poisoned = b.malformed
        if entropy is not None and not host and nan_all:  # an unvalidated non-finite entropy reaches the filter, the
            bad = (b.counted & ~torch.isfinite(ent)).any()  # quantile and the bonus: every output NaN (spec 6)
            poisoned = bad if poisoned is None else poisoned | bad
        if poisoned is not None:  # unvalidated malformed cu_seqlens or entropy: every output and gradient NaN
            nan = torch.full((), float("nan"), dtype=dt, device=lp.device)  # (a masked-out token keeps its 0s)
            at_tokens = poisoned & b.counted
            for k in ("logp", "ent", "c", "loss_tok", "seq_entropy") + (("e",) if res["e"] is not None else ()):
                res[k] = torch.where(poisoned if k == "seq_entropy" else at_tokens, nan, res[k])
            value = torch.where(poisoned, nan, value)
            res["metrics"] = nan_where(poisoned, res["metrics"])
    # the value, with d/dlogps = c and d/dentropy = e attached (x - sg(x) is 0 with gradient 1)
    attach = res["c"] * (lp - lp.detach())
    if res["e"] is not None:
        attach = attach + res["e"] * (ent - ent.detach())
    loss = value + (attach.reshape(b.tok_shape) if cfg.loss_agg == "none" else attach.sum())
    return loss, res


def shape_key(b, *rows):
    """The vocabulary-parallel agreement's shapes (spec 12): the tokens' shape, what the per-token rows
    are read from (`rows`), and the packed flag."""
    return [*b.tok_shape, *(0,) * (2 - len(b.tok_shape)), *rows, int(b.packed)]


def loss_value(b, cfg, res):
    """The loss value without gradient: sum_k w_k l_k, or w_k l_k per token with loss_agg='none'."""
    weighted = res["weight"] * res["loss_tok"]
    return weighted.reshape(b.tok_shape) if cfg.loss_agg == "none" else \
        weighted.sum(dtype=torch.float64).to(weighted.dtype)


def _report(b, cfg, res):
    """Validating, after the whole forward was queued: one host read of the kernel's flags (when
    fused_loss left them in res['flags']) and of whether the entropy filter dropped every completion."""
    bad, filtering = res.get("flags"), cfg.entropy_threshold is not None
    if bad is None and not filtering:
        return
    no = torch.zeros((), dtype=torch.bool, device=b.counted.device)
    flagged, all_dropped = torch.stack([(bad != 0).any() if bad is not None else no,
                                        (~res["kept"].any() & b.counted.any()) if filtering else no]).tolist()
    if flagged:
        checks.raise_on_flags(bad, b.tok_shape)
    if all_dropped:
        warn_all_dropped(cfg.entropy_threshold)


def warn_all_dropped(threshold):
    """The entropy filter dropped every completion of a call (validating), said at the trainer's line."""
    checks.warn_at_caller(
        f"gtpo_loss: the entropy filter dropped every completion (mean entropy above entropy_threshold="
        f"{float(threshold):.3g}), so the loss and its gradient are zero. A model more uncertain than "
        f"that from the start needs GTPOConfig(initial_entropy=<its mean entropy>) (the paper's gate) or "
        f"entropy_threshold=None; out.metrics['filtered_frac'] tracks it.")


def make_output(b, cfg, loss, res, dt, host):
    if host:
        _report(b, cfg, res)
    dev = b.counted.device
    lam_out = torch.ones(b.tok_shape, dtype=dt, device=dev) if b.lam is None else b.lam.to(dt).reshape(b.tok_shape)
    n_conf_out = torch.ones(b.B, dtype=dt, device=dev) if b.n_conf is None else b.n_conf.to(dt)
    if b.rollout_logps is not None:  # spec 14: the rollout/training mismatch of the logp the loss used
        res["metrics"].update(rollout_metrics(res["logp"], b.rollout_logps, b.counted, dt))
    return GTPOOutput(loss=loss, logps=res["logp"].reshape(b.tok_shape), entropy=res["ent"].reshape(b.tok_shape),
                      per_token_loss=res["loss_tok"].reshape(b.tok_shape), lam=lam_out, n_conf=n_conf_out,
                      kept=res["kept"], seq_entropy=res["seq_entropy"], metrics=res["metrics"])


def forward(b, temperature, backend, host, vp=None):
    """The forward pass: per token (logp, H, stats, flags), with flagged counted tokens' logp and H set
    to NaN (so that invalid input unchecked on the host gives NaN, never a finite wrong number); host:
    the flags are read (and a flagged row raises) here. vp: the vocabulary-parallel layout
    (parallel.VocabParallel), or None."""
    if vp is not None:  # (this slice's ids: b.ids - vp.start; a number tau by value, no fill or copy)
        logp, ent, stats, bad = parallel.vp_forward(b, b.ids, ops.tau_arg(temperature, b.logits3, backend), backend,
                                                    vp.group, vp.V, sizes=vp.sizes, id_start=vp.start,
                                                    nan_flagged=True)
        if host:
            checks.raise_on_flags(bad, b.tok_shape)
        return logp, ent, stats, bad
    temperature = ops.temperature_param(temperature, b.logits3, backend)  # once per call
    logp, ent, stats, bad = ops.vocab_fwd(b.logits3.detach(), b.ids, b.counted, temperature,
                                          b.logits_start, backend=backend)
    if host:
        checks.raise_on_flags(bad, b.tok_shape)
    return (*nan_at_flags(logp, ent, bad), stats, bad)


def call_temperature(temperature, b, dtype, validate, in_kernels=False, spread=True):
    """A call's `temperature=` (spec 13) as the passes take it: None stays None (the config's number),
    a number is checked and kept, a tensor per completion (B,) / (B, 1) or per token becomes (n,) in
    `dtype`, its invalid tokens (not finite, or <= 0) refused when validating, NaN when not (their
    outputs are then NaN); in_kernels: unvalidated, left as they are for the Triton vocabulary kernels,
    which read such a tau as NaN themselves (the epilogue path: no launch for it); with spread=False
    too, one per completion stays (B,) (token_logprobs' kernel reads it at each token's completion; validating,
    it is checked so, where a process group's agreement row reads it)."""
    if temperature is None:
        return None
    from ..core.sampling import check_temperature
    T = None if b.packed else b.tok_shape[1]
    unchecked = in_kernels and not validate  # the derived batch fields are then never formed (no launch)
    # the spread reads cu_seqlens as given (clamped in bounds; malformed: refused validating, else the kernels
    # make everything NaN), so no stand-in is made for it
    cu = b.given["cu_seqlens"] if b.packed else None
    tau, bad = check_temperature(temperature, b.B, T, b.given["ids"].numel(), b.given["ids"].device, cu,
                                 None if unchecked else (lambda: b.counted), validate, dtype, flag=not unchecked,
                                 spread=spread or not (unchecked or validate), where=b.mask)  # (the mask as given)
    return tau if bad is None else torch.where(bad, torch.full_like(tau, float("nan")), tau)


def fused_loss(b, cfg, backend, inplace, host, num_items, vp=None, tau=None):
    """Forward pass -> O(N) surrogate -> the loss value with the backward pass attached. tau: the call's
    temperature (call_temperature), None for the config's."""
    dt = float_dtype_for(b.logits3)
    with torch.no_grad():
        temperature = ops.temperature_param(cfg.temperature if tau is None else tau, b.logits3, backend)
        # one process validating: the flags are read with the rest in make_output, once the loss is queued
        logp, ent, stats, bad = forward(b, temperature, backend, host and vp is not None, vp)
    cdt = stats.dtype  # the kernel's coefficients in its accumulation dtype
    res, value, c, e = value_and_coefficients(b, cfg, logp, ent, num_items, dt, cdt)
    loss = ops.attach_grad(b.logits3, value, b.ids, stats, ent.to(cdt), c, e, temperature, b.logits_start,
                           backend=backend, inplace=inplace, id_start=0 if vp is None else vp.start)  # (a slice's ids)
    if host and vp is None:
        res["flags"] = bad
    return loss, res


def vocab_summary(g, b, logits, host, backend, temperature, replay=(None,) * 4):
    """Inside the guard, last: this rank's part of the agreement (vocabulary-parallel only, spec 12)."""
    key = shape_key(b, *b.logits3.shape[:2], b.logits_start)
    parallel.summary(g, b, logits.shape[-1], key, host, (str(logits.dtype), backend, temperature), replay)


def vocab_parallel(g, logits, where, first=False):
    """The vocabulary-parallel layout (spec 12) after the one small collective, or None without a group:
    if any rank failed its checks (held by the guard g) or the ranks disagree, every rank raises. first: a
    Pending agreement instead, made by the first launch (epilogue_attached.first)."""
    if g.group is None:
        return None
    if first:
        return parallel.Pending(g, agree.collective_device(g.group, logits), where)
    return parallel.vocab_layout(g, agree.collective_device(g.group, logits), where)
