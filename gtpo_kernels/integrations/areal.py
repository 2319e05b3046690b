"""GTPO inside AReaL (1.0): a `loss_fn(logprobs, entropy, data)` for `engine.train_batch`, and the
conflict weights at advantage time.

AReaL's train engines compute the current policy's log-probs and entropies from the logits and call
`loss_fn(logprobs, entropy, mb_input, **extras)` on each micro-batch (packed: 1-D tensors with
`cu_seqlens`; AReaL's convention: position t holds the log-prob of `input_ids[t + 1]`, and the
advantage step has rolled `loss_mask`, `logprobs` and `advantages` the same way), then scale each
micro-batch's loss by `loss_weight_fn(mb) / total`. `make_loss_fn` returns both functions:

    from gtpo_kernels.integrations import areal as gtpo_areal
    data = actor.compute_advantages(data)                       # AReaL's GRPO advantages
    gtpo_areal.add_conflict_weights(data, group_size=n_samples)  # GTPO's lam, carried as data["gtpo_lam"]
    loss_fn, loss_weight_fn = gtpo_areal.make_loss_fn(eps_clip=0.2, config="gtpo")
    engine.train_batch(data, loss_fn=loss_fn, loss_weight_fn=loss_weight_fn)

The loss is `gtpo_loss_from_logps` on the micro-batch's completions: the token ids, the mask, the old
(proximal) log-probs, the per-sample advantage, AReaL's entropies (the current policy's: the entropy
filter and shaping of spec 2 are exact), and `lam` from the data. The conflict weights (spec 3) need
a whole group, which a micro-batch need not hold, so `add_conflict_weights` computes them on the
batch at advantage time (groups: `group_size` consecutive rows, AReaL's grouping of a prompt's
samples) and AReaL's own packing carries them to the loss like any per-token key. Aggregation:
`token-mean` (AReaL's: the counted tokens of the whole batch) or `seq-mean-token-mean` (GTPO's:
`loss_weight_fn` then counts completions). With GTPO's options off it is AReaL's `grpo_loss_fn`
(AReaL's dual clip `c_clip` is `make_loss_fn(c_clip=...)`; no decoupled loss, no rejection sampling).
"""
from __future__ import annotations

import torch

from ..api.advantages import outcome_rows
from ..api.logps import gtpo_loss_from_logps
from ..api.weights import conflict_weights
from ..core.config import as_config
from .rows import first_counted, shift_left, shift_right
from .token_ppo import peer_names

AGGS = ("token-mean", "seq-mean-token-mean")


def targets(input_ids):
    """The token each position's log-prob scores: AReaL's labels, input_ids rolled by one."""
    return torch.roll(input_ids, shifts=-1, dims=-1)


def add_conflict_weights(data: dict, group_size: int, config="gtpo") -> dict:
    """After AReaL's advantage step on a padded batch (input_ids, loss_mask, advantages (B, T), groups
    of `group_size` consecutive rows): data["gtpo_lam"] = GTPO's conflict weights (B, T)."""
    cfg = as_config(config)
    mask = data["loss_mask"].bool()
    adv = _per_row(data["advantages"], mask)
    offset = first_counted(mask)  # a completion starts after its prompt: aligned at its first token
    lam, _ = conflict_weights(shift_left(targets(data["input_ids"]), offset), shift_left(mask, offset), adv,
                              group_size, config=cfg, dtype=torch.float32)
    data["gtpo_lam"] = shift_right(lam, offset)
    return data


def _per_row(advantages, mask):
    """(B, T) advantages holding one value per row at its counted tokens -> (B,)."""
    return outcome_rows(advantages, mask, "advantages must hold one value per sample at its counted tokens (a "
                        "GRPO-family outcome advantage: discount = gae_lambda = 1, kl_ctl = 0); GAE advantages "
                        "cannot be GTPO-shaped")


def _per_completion(advantages, mask, cu_seqlens):
    """Packed advantages (N,) -> (B,) the value of each completion's counted tokens (checked)."""
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    B = lens.numel()
    seg = torch.repeat_interleave(torch.arange(B, device=mask.device), lens)
    T = int(lens.max()) if B else 0
    pos = torch.arange(mask.numel(), device=mask.device) - cu[:-1][seg]
    pad_adv = advantages.new_zeros(B, T).index_put((seg, pos), advantages)
    pad_mask = torch.zeros(B, T, dtype=torch.bool, device=mask.device).index_put((seg, pos), mask)
    return _per_row(pad_adv, pad_mask)


def make_loss_fn(eps_clip: float = 0.2, eps_clip_higher=None, config="gtpo", loss_agg: str = "token-mean",
                 c_clip=None):
    """-> (loss_fn, loss_weight_fn) for AReaL's `engine.train_batch` (module docstring). `config`: a
    GTPOConfig or preset whose conflict weights and entropy control are used; the clip range is AReaL's
    (`eps_clip`, `eps_clip_higher`), and `c_clip` its dual clip (> 1; None: off)."""
    if loss_agg not in AGGS:
        raise ValueError(f"loss_agg must be one of {AGGS}, got {loss_agg!r}")
    if c_clip is not None and not (isinstance(c_clip, (int, float)) and not isinstance(c_clip, bool) and c_clip > 1):
        raise ValueError(f"c_clip must be a number > 1 (AReaL's dual clip) or None, got {c_clip!r}")
    with peer_names(dict(eps_low="eps_clip", eps_high="eps_clip_higher (or eps_clip)")):
        cfg = as_config(config).replace(eps_low=float(eps_clip), loss_agg=loss_agg,
                                        eps_high=float(eps_clip if eps_clip_higher is None else eps_clip_higher),
                                        dual_clip_c=None if c_clip is None else float(c_clip))

    def loss_fn(logprobs, entropy, input_data, **unused):
        mask = input_data["loss_mask"].bool()
        cu = input_data.get("cu_seqlens")
        if cu is None and logprobs.dim() != 2:
            raise ValueError("AReaL's packed micro-batch needs 'cu_seqlens' (1-D inputs), or pass (B, T) inputs")
        adv = input_data["advantages"]
        adv = _per_completion(adv, mask, cu) if cu is not None else _per_row(adv, mask)
        old = input_data.get("prox_logp")
        old = input_data["logprobs"] if old is None else old
        lam = input_data.get("gtpo_lam")
        if cfg.use_conflict_mask and lam is None:
            raise KeyError("this GTPOConfig uses the conflict weights: run add_conflict_weights(data, group_size) "
                           "after AReaL's compute_advantages, so that data['gtpo_lam'] reaches the loss")
        # (this micro-batch's count; bnpo's local_count takes it as its own: none passed)
        n_items = mask.sum().clamp(min=1) if loss_agg == "token-mean" and not cfg.local_count else None
        out = gtpo_loss_from_logps(logprobs, targets(input_data["input_ids"]), adv, mask,
                                   entropy=entropy.detach(), old_logps=old.detach(), config=cfg,
                                   lam=lam if cfg.use_conflict_mask else None, cu_seqlens=cu,
                                   max_seqlen=None, num_items_in_batch=n_items)
        return out.loss

    def loss_weight_fn(mb):
        mask = mb["loss_mask"].bool()
        if loss_agg == "token-mean":
            return mask.count_nonzero()
        cu = mb.get("cu_seqlens")  # seq-mean-token-mean: the package's mean is over the micro-batch's completions
        return torch.tensor(mask.shape[0] if cu is None else cu.numel() - 1, device=mask.device)

    return loss_fn, loss_weight_fn


__all__ = ["make_loss_fn", "add_conflict_weights", "targets", "AGGS"]
