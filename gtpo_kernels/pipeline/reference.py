"""backend='reference': the float64 oracle (`gtpo_reference`) behind the public calls' contract, for
validation. It takes the padded window of the logits and returns the public calls' outputs."""
from __future__ import annotations

import dataclasses
import math

import torch

from ..core import checks
from ..core.flags import NonFiniteRowError, nan_where, tau_or_nan
from ..core.layout import float_dtype_for, padded_window
from ..kernels.vocab_torch import nonfinite_rows, row_flags
from ..objective import conflict, verl_modes


def kept_window(b, logits, tau, sampling_mask, rules, validate):
    """backend='reference' replay (spec 13): a (n, V) bool, each counted token's kept set (recorded, or
    rebuilt by gtpo_reference.gtpo_sampling's statement of vLLM's rules from the same logits), True on
    every entry of an uncounted token; with the metrics of the replay. A counted token whose set is invalid
    or whose rule value is out of its range (unvalidated) gets an empty row: _kept makes it NaN, with its
    gradient, and the metrics are NaN (never a finite number from a set that means nothing)."""
    from gtpo_reference import gtpo_sampling
    from ..core.sampling import check_sampling_mask_flat, segment_of
    from ..kernels.replay import replay_metrics
    from .replay import _any, at
    V = logits.shape[-1]
    flat = logits.reshape(-1, V) if b.packed else logits[:, b.logits_start:b.logits_start + b.tok_shape[1]].reshape(-1, V)
    if b.packed:
        flat = flat[b.logits_start:b.logits_start + b.counted.numel()]
    pos = b.counted.reshape(-1).nonzero().squeeze(1)
    if sampling_mask is not None:
        token_ids, offsets, invalid = check_sampling_mask_flat(sampling_mask, b.ids, b.counted, V, validate)
        offsets = offsets[torch.cat([pos, pos.new_full((1,), b.counted.numel())])]  # over the counted tokens
        restored = None
    else:
        (top_k, top_p, min_p), rule_bad = rules
        invalid = _any(*rule_bad)
        t = 1.0 if tau is None else tau
        token_ids, offsets, restored = gtpo_sampling.kept_sets(flat[pos].detach(), at(t, pos), at(top_k, pos),
                                                               at(top_p, pos), at(min_p, pos),
                                                               b.ids.reshape(-1)[pos].long())
        # a row holding NaN or +inf (unvalidated): the rules' set means nothing there (the oracle's statement
        # would pass over a NaN), its outputs NaN as the other backends make them
        nf = torch.zeros(b.counted.numel(), dtype=torch.bool, device=flat.device)
        nf[pos] = nonfinite_rows(flat[pos].detach())
        invalid = _any(invalid, nf)
    keep = torch.ones(flat.shape, dtype=torch.bool, device=flat.device)
    keep[pos] = False
    seg = segment_of(offsets, token_ids.numel())
    keep[pos[seg], token_ids.clamp(0, V - 1)] = True
    if isinstance(tau, torch.Tensor) and tau.numel() > 1:  # a per-token tau NaN where invalid (call_temperature)
        invalid = _any(invalid, torch.isnan(tau.reshape(-1)))
    bad = None if invalid is None else invalid.reshape(-1) & b.counted.reshape(-1)
    if bad is not None:  # (unvalidated) an empty row: NaN outputs
        keep[bad] = False
    if sampling_mask is not None:
        return keep, replay_metrics(offsets, restored, bad=bad)
    # rebuilt by the rules: kept_mass too, each set's mass under the full softmax at its temperature
    t = at(t, pos)
    t = t.reshape(-1, 1).to(torch.float64) if isinstance(t, torch.Tensor) else float(t)
    full = torch.softmax(flat[pos].detach().to(torch.float64) / t, -1)
    return keep, replay_metrics(offsets, restored, kept_mass=(full * keep[pos]).sum(-1), bad=bad)


def _kept(b, lg, keep):
    """The window's logits with every entry outside a kept set at -inf (the same distribution); the
    packed form's padding rows keep everything; an empty set (an invalid one) NaN on the whole row, so
    that the row's outputs and its gradient are NaN."""
    import torch
    from ..core.layout import packed_layout, pad
    if b.packed:
        L, pos = packed_layout(b, longest=True)
        N = keep.shape[0]
        ext = torch.cat([keep, keep.new_ones(1, keep.shape[1])])
        k = ext[pad(b, torch.arange(N, device=keep.device), L, pos, fill=N)]
    else:
        k = keep.reshape(*b.tok_shape, -1)
    empty = ~k.any(-1, keepdim=True)
    nan = torch.where(empty, float("nan"), 0.0).to(torch.float64)
    return torch.where(k | empty, lg.double() + nan, float("-inf"))


def _scaled(b, lg, pad, tau, m):
    """A per-token temperature (n,) as the oracle takes it: the window's logits divided row by row (in
    autograd: the gradient reaches the logits through the division), then temperature 1. Rows that do not
    count (m False: masked out, the packed form's padding) divide by 1: a tau there is not read, and a 0 or
    NaN would send NaN into that row's gradient."""
    if not b.packed:
        t = pad(tau.reshape(b.tok_shape)).double()
    else:
        from ..core.layout import pad as pad_rows, packed_layout
        L, pos = packed_layout(b, longest=True)
        t = pad_rows(b, tau.reshape(-1), L, pos, fill=1.0).double()
    return lg.double() / torch.where(m, t, 1.0)[..., None]


def _window(b, logits, validate, keep=None):
    """padded_window(b, logits), with keep (kept_window's sets) every entry outside a set -inf (_kept);
    validating, the rows the other backends refuse first raise their error (vocab_torch.row_flags,
    checks.raise_on_flags): a counted row holding NaN or +inf (within its kept set: a recorded set reads only
    its own logits), or giving its own target a logit of -inf (the oracle would return NaN or -inf)."""
    lg, ids, m, unpad, pad = padded_window(b, logits)
    if keep is not None:
        lg = _kept(b, lg, keep)
    if lg.shape[-1]:
        z_y = lg.gather(-1, ids.long().clamp(0, lg.shape[-1] - 1)[..., None]).squeeze(-1)
        flags = row_flags(nonfinite_rows(lg.detach()), z_y.detach()) * m
        if validate:
            checks.raise_on_flags(unpad(flags).reshape(-1), b.tok_shape)
        else:  # such a row NaN, as the other backends flag it (the oracle would give -inf or a finite loss); added,
            # not selected, so that its gradient row is NaN too
            lg = lg + torch.where(flags != 0, float("nan"), 0.0).to(lg.dtype)[..., None]
    return lg, ids, m, unpad, pad


def token_logprobs(b, logits, temperature, keep=None, validate=False):
    import gtpo_reference
    lg, ids, m, unpad, pad = _window(b, logits, validate, keep)
    if hasattr(temperature, "dim") and temperature.numel() > 1:
        lg, temperature = _scaled(b, lg, pad, temperature, m), 1.0
    lp, ent = gtpo_reference.token_logprobs(lg, ids, float(temperature), m)
    dt = float_dtype_for(logits)
    return unpad(lp).to(dt), unpad(ent).to(dt)


def config_tau(b, cfg, tau, validate):
    """The oracle's per-token temperature: the call's `tau` (n,), or None for the config's number. A config's 0-d
    tensor (a schedule) changed in place to a value not > 0 since the config checked it (read here: it lives on
    the host) is refused validating (NonFiniteRowError: the entry point names it), else NaN at every token (every
    output NaN, as the kernels make it; the oracle itself refuses such a value)."""
    t = cfg.temperature
    if tau is not None or not isinstance(t, torch.Tensor) or not math.isnan(tau_or_nan(float(t))):
        return tau
    if validate:
        raise NonFiniteRowError("the config's temperature is no longer > 0")
    return torch.full((math.prod(b.tok_shape),), float("nan"), dtype=torch.float64, device=b.given["ids"].device)


def gtpo_loss(b, logits, cfg, group_size, extras, num_items, output_type, tau=None, keep=None, validate=False):
    """tau: a per-token (n,) temperature in place of cfg's, or None; keep: kept_window's sets, or None;
    validate: the rows the other backends refuse are refused (_window)."""
    import gtpo_reference
    kw = {k: float(v) if hasattr(v, "dim") else v for k, v in dataclasses.asdict(cfg).items()}
    kw["generator"] = cfg.generator  # the caller's (asdict copies it; clip_cov's draw advances it)
    lg, ids, m, unpad, pad = _window(b, logits, validate, keep)
    if tau is not None:
        lg, kw["temperature"] = _scaled(b, lg, pad, tau, m), 1.0
    extras, adv = _unchecked(b, extras)
    opt = (lambda x: None if x is None else pad(x))
    if b.packed and cfg.policy_loss == "clip-cov":  # the draws one per packed token, as the other backends make them
        kw["generator"] = pad(verl_modes.uniform_draws(cfg, b.ids.numel(), logits.device))
    if b.packed and kw["max_completion_length"] is None:
        kw["max_completion_length"] = int(b.max_len)  # the longest completion
    if (extras["lam"] is None or extras["n_conf"] is None) and cfg.use_conflict_mask and group_size is not None:
        made = _conflicts(ids, m, adv, group_size, cfg, unpad)  # (what the caller gave is kept)
        extras = dict(extras, **{k: v for k, v in made.items() if extras[k] is None})
    w = extras["rollout_is_weights"]
    if w is not None and tuple(w.shape) != tuple(b.tok_shape):
        w = w.reshape(-1)  # per completion
    elif w is not None:
        w = pad(w)
    r = gtpo_reference.gtpo_loss(lg, ids, adv, m, group_size=group_size, old_logps=opt(extras["old_logps"]),
                                 ref_logps=opt(extras["ref_logps"]), lam=opt(extras["lam"]), n_conf=extras["n_conf"],
                                 num_items_in_batch=num_items, rollout_is_weights=w,
                                 rollout_logps=opt(extras["rollout_logps"]), **kw)
    dt = float_dtype_for(logits)  # the reference computes in float64; the contract's outputs are float32
    loss = unpad(r["loss"]) if cfg.loss_agg == "none" else r["loss"]
    if b.malformed is not None:  # an unvalidated malformed cu_seqlens: no completion is known, every metric NaN
        r["metrics"] = nan_where(b.malformed, r["metrics"])
    return output_type(loss=loss.to(dt), logps=unpad(r["logps"]).to(dt), entropy=unpad(r["entropy"]).to(dt),
                       per_token_loss=unpad(r["per_token_loss"]).to(dt), lam=unpad(r["lam"]).to(dt),
                       n_conf=r["n_conf"].to(dt), kept=r["kept"], seq_entropy=r["seq_entropy"].to(dt),
                       metrics={k: v.to(dt) for k, v in r["metrics"].items()})


def _conflicts(ids, m, adv, group_size, cfg, unpad):
    """The oracle's conflict weights with the package's unvalidated contract (objective/conflict.conflict_flat):
    a completion with a counted id outside [0, 2**31) gets lam and n_conf NaN (its invalid tokens in no one's
    conflicts), and a NaN advantage, whose sign decides every member's conflicts, its whole group's."""
    import gtpo_reference
    bad_tok = conflict.invalid_ids(ids, m)
    lam, n_conf = gtpo_reference.conflict_weights(ids, m & ~bad_tok, adv, group_size, cfg.conflict_pos_weight,
                                                  cfg.conflict_neg_weight)  # (it checked that group_size divides B)
    nan_group = torch.isnan(adv.reshape(-1, group_size)).any(1).repeat_interleave(group_size)
    bad = bad_tok.any(-1).to(nan_group.device) | nan_group
    lam = torch.where(bad[:, None].to(lam.device), float("nan"), lam)
    return dict(lam=unpad(lam), n_conf=torch.where(bad.to(n_conf.device), float("nan"), n_conf))


def _unchecked(b, extras):
    """(extras, advantages) with what validation refuses NaN, as objective/surrogate.py makes it unvalidated
    (validated, nothing changes): an old / ref log-prob or lam that is not finite at a counted token, a rollout
    weight not >= 0 and finite (at a counted token, or per completion), an n_conf not finite and >= 1, an
    advantage not finite. The oracle then gives NaN wherever they reach (never a finite number)."""
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    c = b.counted.reshape(-1)

    def fix(x, ok, tokens=True):
        if x is None:
            return None
        v = x.detach().reshape(-1).to(torch.float64)  # (constants of the loss on every backend: no gradient)
        bad = ~ok(v) & (c if tokens and v.numel() == c.numel() else True)
        return torch.where(bad, nan.to(v.device), v).reshape(x.shape)
    finite = torch.isfinite
    out = dict(extras)
    for k in ("old_logps", "ref_logps", "lam"):
        out[k] = fix(extras[k], finite)
    out["rollout_is_weights"] = fix(extras["rollout_is_weights"], lambda v: finite(v) & (v >= 0))
    out["n_conf"] = fix(extras["n_conf"], lambda v: finite(v) & (v >= 1), tokens=False)
    return out, fix(b.adv, finite, tokens=False)
