"""GTPO folded into token-level advantages, for trainers whose policy loss sees neither the token ids
nor the entropies (verl's policy-loss registry, other PPO-style trainers).

For lambda >= 0 the conflict weights (spec 3) and the entropy filter and shaping (spec 2) fold into the
advantage exactly: `-lambda * min(r A, clip(r) A) = -min(r (lambda A), clip(r) (lambda A))`, and so does
any positive per-completion factor (the `1 / n_conf` of the gtpo-official aggregation). A plain PPO
clip on `gtpo_token_advantages(...)` is then GTPO's policy term.
"""
from __future__ import annotations

import torch

from ..core import checks
from ..core.config import as_config
from ..objective.conflict import ID_LIMIT
from ..objective.grouping import group_layout
from ..objective.surrogate import entropy_control
from .weights import conflict_weights


def outcome_rows(advantages, mask, error):
    """(B, T) advantages holding one value per row at its counted tokens (`mask` (B, T) bool) -> (B,),
    0 for a row with none; a row whose counted tokens hold different values raises ValueError(error)
    (one host read)."""
    T = mask.shape[1]
    first = torch.where(mask, torch.arange(T, device=mask.device), T).amin(dim=1).clamp(max=max(T - 1, 0))
    row = advantages.gather(1, first[:, None]).squeeze(1)
    row = torch.where(mask.any(dim=1), row, torch.zeros_like(row))
    if bool(((advantages != row[:, None]) & mask).any()):
        raise ValueError(error)
    return row


def batch_entropy(batch, cfg, missing):
    """gtpo_token_advantages' `entropy` from a trainer's batch (a dict or TensorDict): batch['entropy'] as
    float32 when the config's entropy filter or shaping needs it, else None; absent, KeyError(missing)."""
    if not cfg.shapes_advantages:
        return None
    if "entropy" not in batch.keys():
        raise KeyError(missing)
    return batch["entropy"].float()


def _row_advantages(advantages, mask, B, T):
    """(B,), (B, 1) or (B, T) with one value per row (verl) -> (B,)."""
    if not isinstance(advantages, torch.Tensor):
        advantages = torch.as_tensor(advantages)
    if not advantages.dtype.is_floating_point:
        advantages = advantages.to(torch.float32)
    if advantages.dim() == 2 and advantages.shape == (B, T) and T != 1:
        if T == 0:  # no token: every row is inactive (its advantage multiplies nothing)
            return advantages.new_zeros(B)
        # verl's outcome advantages: the row's value at its counted tokens (0 elsewhere)
        checks.check_finite("advantages", advantages, mask.reshape(-1))
        return outcome_rows(advantages, mask, "advantages (B, T) must hold one value per row at its counted "
                            "tokens (an outcome advantage, as verl's GRPO-family estimators give); token-varying "
                            "advantages (GAE) cannot be GTPO-shaped")
    if advantages.numel() != B or advantages.dim() > 2 or (advantages.dim() == 2 and advantages.shape[1] != 1):
        raise ValueError(f"advantages must be (B,), (B, 1) or (B, T) = ({B}, {T}) like responses, got shape "
                         f"{tuple(advantages.shape)}")
    return advantages.reshape(B)


def gtpo_token_advantages(advantages, responses, response_mask, entropy, uid, config="gtpo"):
    """GTPO's per-token advantage `lambda[i, t] * Ahat[i]` (B, T), 0 where masked out.

    advantages     (B,), (B, 1), or verl's (B, T) holding one value per row: the raw advantages A[i]
                   (their signs define the conflict roles, spec 3).
    responses      (B, T) token ids (any value where masked out).
    response_mask  (B, T) bool/int/float; 1 = the token counts. All-masked rows (padding) get 0.
    entropy        (B, T) per-token entropies of the policy that sampled (or the old policy), for the
                   entropy filter and shaping (spec 2); may be None when the config uses neither.
    uid            one group key per row (strings, ints, a numpy object array, a 1-D integer tensor):
                   rows in any order, groups of any size.
    config         a GTPOConfig or preset name: its conflict weights, entropy_threshold, initial_entropy
                   and entropy_penalty are used; with loss_agg='gtpo-official' the result is also divided
                   by n_conf[i]. Its clipping, KL, entropy bonus and aggregation are the trainer's.

    Returns float32 (float64 for float64 advantages). A PPO clip on these advantages equals GTPO's policy
    term (lambda >= 0 and 1/n_conf > 0 fold into the advantage exactly).
    """
    cfg = as_config(config)
    if uid is None:
        raise ValueError("uid is required: one group key per row (verl's non_tensor_batch['uid']), so that the "
                         "conflict weights compare completions of the same prompt")
    B, T = _check_responses(responses)
    m = _counted(response_mask, responses)
    adv = _row_advantages(advantages, m, B, T).to(responses.device)
    entropy = _entropy_arg(entropy, cfg, B, T, adv.dtype, responses.device)
    if cfg.shapes_advantages:  # (a NaN one would be filtered out: a finite 0)
        checks.check_finite("entropy", entropy, m.reshape(-1))
    checks.check_ids_in_range(responses.reshape(-1), m.reshape(-1), ID_LIMIT, name="responses")
    dt = torch.float64 if adv.dtype == torch.float64 else torch.float32

    # spec 3: conflict weights, grouped by uid (checked here, so that errors name it)
    codes = group_layout(uid, B, device=responses.device, name="uid").code
    if cfg.use_conflict_mask:
        lam, n_conf = conflict_weights(responses, m, adv, group_ids=codes, config=cfg, dtype=dt)
    else:
        lam = torch.ones(B, T, dtype=dt, device=responses.device)
        n_conf = torch.ones(B, dtype=dt, device=responses.device)
    a_hat = _shaped_advantages(adv.to(dt), entropy, m, cfg)
    if cfg.loss_agg == "gtpo-official":
        a_hat = a_hat / n_conf
    out = lam * a_hat[:, None]
    return torch.where(m, out, torch.zeros((), dtype=dt, device=out.device))


def _check_responses(responses):
    """responses must be a (B, T) tensor -> (B, T)."""
    if not isinstance(responses, torch.Tensor) or responses.dim() != 2 or responses.shape[0] == 0:
        raise ValueError(f"responses must be a (B, T) tensor of token ids with B >= 1, got "
                         f"{tuple(responses.shape) if isinstance(responses, torch.Tensor) else type(responses).__name__}")
    return responses.shape


def _counted(response_mask, responses):
    """response_mask (B, T) of any dtype -> the bool mask of counted tokens."""
    B, T = responses.shape
    if response_mask is None:
        raise ValueError("response_mask is required: (B, T) like responses, 1 where the token counts")
    response_mask = torch.as_tensor(response_mask, device=responses.device)
    if tuple(response_mask.shape) != (B, T):
        raise ValueError(f"response_mask must have the shape of responses {(B, T)}, got {tuple(response_mask.shape)}")
    return response_mask.bool() if response_mask.dtype == torch.bool or not response_mask.dtype.is_floating_point \
        else response_mask != 0


def _entropy_arg(entropy, cfg, B, T, dtype, device):
    """The (B, T) entropies, checked; zeros when the config neither filters nor shapes (None given)."""
    if entropy is None:
        if cfg.shapes_advantages:
            raise ValueError("entropy (B, T) is required by this config's entropy filter or shaping "
                             "(entropy_threshold, entropy_penalty); pass the old policy's entropies, or turn "
                             "those off")
        entropy = torch.zeros(B, T, dtype=dtype, device=device)
    checks.check_float_tensor("entropy", entropy)
    if tuple(entropy.shape) != (B, T):
        raise ValueError(f"entropy must have the shape of responses {(B, T)}, got {tuple(entropy.shape)}")
    return entropy


def _shaped_advantages(adv, entropy, m, cfg):
    """Spec 2: Hbar over the counted tokens, the filter and the shaped advantage Ahat (B,) in adv's dtype."""
    B, T = m.shape
    dt = adv.dtype
    seg = torch.arange(B, device=m.device).repeat_interleave(T)
    ent = torch.where(m.reshape(-1), entropy.reshape(-1).to(dt), torch.zeros((), dtype=dt, device=m.device))
    n_safe = m.sum(dim=1).clamp(min=1).to(dt)
    return entropy_control(ent, seg, B, n_safe, adv, cfg)[2]
