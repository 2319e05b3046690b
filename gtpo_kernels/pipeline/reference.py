"""backend='reference': the float64 oracle (`gtpo_reference`) behind the public calls' contract, for
validation. It takes the padded window of the logits and returns the public calls' outputs."""
from __future__ import annotations

import dataclasses

from ..core.layout import float_dtype_for, padded_window


def _scaled(b, lg, pad, tau):
    """A per-token temperature (n,) as the oracle takes it: the window's logits divided row by row (in
    autograd: the gradient reaches the logits through the division), then temperature 1."""
    return lg.double() / pad(tau.reshape(b.tok_shape)).double()[..., None]


def token_logprobs(b, logits, temperature):
    import gtpo_reference
    lg, ids, m, unpad, pad = padded_window(b, logits)
    if hasattr(temperature, "dim") and temperature.numel() > 1:
        lg, temperature = _scaled(b, lg, pad, temperature), 1.0
    lp, ent = gtpo_reference.token_logprobs(lg, ids, float(temperature), m)
    dt = float_dtype_for(logits)
    return unpad(lp).to(dt), unpad(ent).to(dt)


def gtpo_loss(b, logits, cfg, group_size, extras, num_items, output_type, tau=None):
    """tau: a per-token (n,) temperature in place of cfg's, or None."""
    import gtpo_reference
    kw = {k: float(v) if hasattr(v, "dim") else v for k, v in dataclasses.asdict(cfg).items()}
    kw["generator"] = cfg.generator  # the caller's (asdict copies it; clip_cov's draw advances it)
    lg, ids, m, unpad, pad = padded_window(b, logits)
    if tau is not None:
        lg, kw["temperature"] = _scaled(b, lg, pad, tau), 1.0
    opt = (lambda x: None if x is None else pad(x))
    if b.packed and kw["max_completion_length"] is None:
        kw["max_completion_length"] = int(b.max_len)  # the longest completion
    w = extras["rollout_is_weights"]
    if w is not None and tuple(w.shape) != tuple(b.tok_shape):
        w = w.reshape(-1)  # per completion
    elif w is not None:
        w = pad(w)
    r = gtpo_reference.gtpo_loss(lg, ids, b.adv, m, group_size=group_size, old_logps=opt(extras["old_logps"]),
                                 ref_logps=opt(extras["ref_logps"]), lam=opt(extras["lam"]), n_conf=extras["n_conf"],
                                 num_items_in_batch=num_items, rollout_is_weights=w,
                                 rollout_logps=opt(extras["rollout_logps"]), **kw)
    dt = float_dtype_for(logits)  # the reference computes in float64; the contract's outputs are float32
    loss = unpad(r["loss"]) if cfg.loss_agg == "none" else r["loss"]
    return output_type(loss=loss.to(dt), logps=unpad(r["logps"]).to(dt), entropy=unpad(r["entropy"]).to(dt),
                       per_token_loss=unpad(r["per_token_loss"]).to(dt), lam=unpad(r["lam"]).to(dt),
                       n_conf=r["n_conf"].to(dt), kept=r["kept"], seq_entropy=r["seq_entropy"].to(dt),
                       metrics={k: v.to(dt) for k, v in r["metrics"].items()})
