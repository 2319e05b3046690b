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


def clip(x, lo=None, hi=None):
    """torch.clamp(x, lo, hi) where a bound may be a 0-d tensor (a schedule): such a bound as maximum /
    minimum, which torch.compile traces with fullgraph=True (clamp with a 0-d tensor bound does not)."""
    if lo is not None:
        x = torch.maximum(x, lo) if isinstance(lo, torch.Tensor) else x.clamp(min=lo)
    if hi is not None:
        x = torch.minimum(x, hi) if isinstance(hi, torch.Tensor) else x.clamp(max=hi)
    return x


def full(x, like):
    """A hyper-parameter (Python number or 0-d tensor) as a tensor of `like`'s shape, dtype and device."""
    return operand(x, like).expand_as(like) if isinstance(x, torch.Tensor) else torch.full_like(like, x)


def times_adv(x, A):
    """x A, exactly 0 where A = 0 and x = inf (a ratio that overflows to inf, log r > 88.7 in float32, times a
    zero advantage or a completion the entropy filter dropped: 0 as for any finite ratio, not NaN); a NaN x (invalid
    input, unvalidated) stays NaN."""
    return torch.where((A == 0) & torch.isinf(x), torch.zeros((), dtype=x.dtype, device=x.device), x * A)


def ppo(r, A, cfg):
    """-min(r1 A, clip(r, 1 - eps_low, 1 + eps_high) A), r1 = r or min(r, delta); clip=False: -r1 A;
    with dual_clip_c (verl's dual clip) at most -A c where A < 0.

    d pg / d log r is that of the branch the minimum takes: -A d r1 (r1 = r: r; r1 = delta: 0) on the
    unclipped one, -A r inside [1 - eps_low, 1 + eps_high] (0 outside) on the clipped one. With
    delta < 1 + eps_high and A < 0 the clipped branch r A is the minimum for delta < r < 1 + eps_high and
    keeps its gradient. `clipped`: the tokens whose gradient the clip, delta or the dual clip removed."""
    return ppo_parts(r, A, cfg)[:4]


def ppo_parts(r, A, cfg):
    """ppo's (pg, d_logr, None, clipped), `on_clip`, where the clipped branch is the minimum (verl's
    clip_by_origin, which clip_cov reads), and the tokens the dual clip capped (None without it)."""
    zero = torch.zeros((), dtype=r.dtype, device=r.device)
    if cfg.delta is None:
        r1, dr1, capped = r, r, torch.zeros_like(r, dtype=torch.bool)
    else:
        delta = operand(cfg.delta, r)
        r1 = clip(r, hi=delta)
        capped = r > delta
        dr1 = torch.where(capped, zero, r)  # d r1 / d log r
    u1 = times_adv(r1, A)
    if not cfg.clip:
        on_clip = torch.zeros_like(r, dtype=torch.bool)
        pg, d_logr, clipped = -u1, -times_adv(dr1, A), capped & (A != 0)
    else:
        lo, hi = operand(1.0 - cfg.eps_low, r), operand(1.0 + cfg.eps_high, r)
        u2 = clip(r, lo, hi) * A
        on_clip = u1 > u2  # the minimum takes the clipped branch
        outside = (r < lo) | (r > hi)  # clip(r) is a constant there
        d_logr = torch.where(on_clip, torch.where(outside, zero, -times_adv(r, A)), -times_adv(dr1, A))
        clipped = torch.where(on_clip, outside, capped) & (A != 0)
        pg = -torch.minimum(u1, u2)
    dual = None
    if cfg.dual_clip_c is not None:  # verl's dual clip: min(pg, -A c) where A < 0
        cap = -A * operand(cfg.dual_clip_c, r)
        dual = (A < 0) & (pg > cap)
        pg, d_logr, clipped = torch.where(dual, cap, pg), torch.where(dual, zero, d_logr), clipped | dual
    return pg, d_logr, None, clipped, on_clip, dual


def cispo(r, A, logp, cfg):
    """-sg(min(r, eps_high)) A logp (eps_high: an absolute bound on the ratio)."""
    coef = clip(r, hi=operand(cfg.eps_high, r))
    return -coef * A * logp, None, -coef * A, torch.zeros_like(r, dtype=torch.bool)


def sapo(r, A, cfg):
    """-(4 / tau_s) sigmoid(tau_s (r - 1)) A, tau_s by the sign of A (spec 9), in r's dtype (a
    torch.where of two Python floats would round the temperatures to float32)."""
    tau = torch.where(A > 0, full(cfg.sapo_temperature_pos, r), full(cfg.sapo_temperature_neg, r))
    x = tau * (r - 1.0)
    sig = torch.sigmoid(x)
    # sigma(x) sigma(-x) r (not 1 - sigma, which rounds to 0 long before it underflows); 0 at r = inf (an
    # overflowing ratio: not NaN); NaN stays
    slope = torch.where(r == math.inf, torch.zeros((), dtype=r.dtype, device=r.device), sig * torch.sigmoid(-x) * r)
    return -(4.0 / tau) * sig * A, -4.0 * slope * A, None, torch.zeros_like(r, dtype=torch.bool)


def vespo_phi(log_r, m, seg_sum, adv, rollout_w, cfg):
    """VESPO's per-completion weight phi[i] (spec 9, as TRL computes it): L = clamp(sum_t m clamp(log r,
    -20, 20) + sum_t log(rollout weight), log 1e-8, 20), w = e^L, log phi = lam + k L - lam w by the sign
    of A; non-finite phi -> 0 (NaN input gives NaN)."""
    lo = math.log(1e-8)
    L = seg_sum(torch.where(m, log_r.clamp(-20.0, 20.0), torch.zeros_like(log_r)))
    if rollout_w is not None:
        L = L + rollout_w
    invalid = torch.isnan(L)  # NaN input (unchecked): NaN, not the 0 of an overflowing phi
    L = L.clamp(lo, 20.0)
    pos = adv >= 0
    k = torch.where(pos, full(cfg.vespo_k_pos, L), full(cfg.vespo_k_neg, L))
    lam = torch.where(pos, full(cfg.vespo_lambda_pos, L), full(cfg.vespo_lambda_neg, L)).clamp(min=1e-4)
    phi = torch.exp(lam + k * L - lam * torch.exp(L))
    phi = torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)
    return torch.where(invalid, torch.full_like(phi, float("nan")), phi)


def vespo(phi_tok, A, logp):
    """-sg(phi) A logp."""
    return -phi_tok * A * logp, None, -phi_tok * A, torch.zeros_like(logp, dtype=torch.bool)
