"""The per-token policy terms of the GRPO family (spec sections 4 and 9), O(tokens), no autograd.

Each returns (pg, d_logr, d_logp, clipped): the policy term's value per token before lambda, the masks
and the aggregation weights; its derivative through the ratio's logarithm (d pg / d log r, which the
sequence level then spreads over the completion's tokens); its derivative through logp directly
(the stop-gradient terms sg(coef) * A * logp of cispo and vespo); and the tokens whose gradient the clip
removed (for metrics['clip_frac']).
"""
from __future__ import annotations

import math

import torch


def operand(x, like):
    """A Python number as it is; a 0-d tensor hyper-parameter moved to `like`'s device and dtype."""
    return x.to(like.device, like.dtype) if isinstance(x, torch.Tensor) else x


def ppo(r, A, cfg):
    """-min(r1 A, clip(r, 1 - eps_low, 1 + eps_high) A), r1 = r or min(r, delta); clip=False: -r1 A."""
    zero = torch.zeros((), dtype=r.dtype, device=r.device)
    if cfg.delta is None:
        r1, dr1 = r, r
    else:
        delta = operand(cfg.delta, r)
        r1 = torch.clamp(r, max=delta)
        dr1 = torch.where(r <= delta, r, zero)  # d r1 / d log r
    u1 = r1 * A
    if not cfg.clip:
        return -u1, -dr1 * A, None, torch.zeros_like(r, dtype=torch.bool)
    u2 = torch.clamp(r, operand(1.0 - cfg.eps_low, r), operand(1.0 + cfg.eps_high, r)) * A
    clipped = u1 > u2  # the clipped branch is the minimum: outside the range, no gradient
    return -torch.minimum(u1, u2), torch.where(clipped, zero, -dr1 * A), None, clipped


def cispo(r, A, logp, cfg):
    """-sg(min(r, eps_high)) A logp (eps_high: an absolute bound on the ratio)."""
    coef = torch.clamp(r, max=operand(cfg.eps_high, r))
    return -coef * A * logp, None, -coef * A, torch.zeros_like(r, dtype=torch.bool)


def sapo(r, A, cfg):
    """-(4 / tau_s) sigmoid(tau_s (r - 1)) A, tau_s by the sign of A (spec 9)."""
    tau = torch.where(A > 0, operand(cfg.sapo_temperature_pos, r), operand(cfg.sapo_temperature_neg, r))
    sig = torch.sigmoid(tau * (r - 1.0))
    return -(4.0 / tau) * sig * A, -4.0 * sig * (1.0 - sig) * r * A, None, torch.zeros_like(r, dtype=torch.bool)


def vespo_phi(log_r, m, seg_sum, adv, rollout_w, cfg):
    """VESPO's per-completion weight phi[i] (spec 9, as TRL computes it): L = clamp(sum_t m clamp(log r,
    -20, 20) + sum_t log(rollout weight), log 1e-8, 20), w = e^L, log phi = lam + k L - lam w by the sign
    of A; non-finite phi -> 0."""
    lo = math.log(1e-8)
    L = seg_sum(torch.where(m, log_r.clamp(-20.0, 20.0), torch.zeros_like(log_r)))
    if rollout_w is not None:
        L = L + rollout_w
    L = L.clamp(lo, 20.0)
    pos = adv >= 0
    k = torch.where(pos, operand(cfg.vespo_k_pos, L), operand(cfg.vespo_k_neg, L))
    lam = torch.where(pos, operand(cfg.vespo_lambda_pos, L), operand(cfg.vespo_lambda_neg, L)).clamp(min=1e-4)
    phi = torch.exp(lam + k * L - lam * torch.exp(L))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def vespo(phi_tok, A, logp):
    """-sg(phi) A logp."""
    return -phi_tok * A * logp, None, -phi_tok * A, torch.zeros_like(logp, dtype=torch.bool)
