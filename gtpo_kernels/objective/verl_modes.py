"""verl 0.9.1's policy terms (spec 9, verl/trainer/ppo/core_algos.py), O(tokens), no autograd.

Each returns policy.py's (pg, d_logr, d_logp, clipped) per token; A is the token's advantage (Ahat of its
completion, or verl's token advantages). Where verl clamps the log-ratio to [-20, 20] before exp (dppo,
its cispo) so does this; gpg, dro, geo_mean, clip_cov and kl_cov use the unclamped log-ratio, as verl.
The selections of clip_cov and kl_cov run on the device: ranks from one sort, compared with a count
kept on the device (no host read).
"""
from __future__ import annotations

import math
import zlib

import torch

from .policy import clip, operand, times_adv


def _none(x):
    return torch.zeros_like(x, dtype=torch.bool)


def gpg(A, logp):
    """-A logp."""
    return -A * logp, None, -A, _none(logp)


def dro(A, logp, log_r, cfg):
    """-(logp A - dro_beta / 2 (logp - old)^2)."""
    beta = operand(cfg.dro_beta, logp)
    return -(logp * A - 0.5 * beta * log_r * log_r), beta * log_r, -A, _none(logp)


def verl_cispo(A, logp, log_r, cfg):
    """-sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp (verl's two-sided CISPO)."""
    r = torch.exp(log_r.clamp(-20.0, 20.0))
    coef = clip(r, operand(1.0 - cfg.eps_low, r), operand(1.0 + cfg.eps_high, r))
    return -coef * A * logp, None, -coef * A, _none(logp)


def dppo(A, logp, old, log_r, cfg, kind):
    """DPPO's binary TV ('tv') or KL ('kl') trust region: -A sg(min(r, c)) logp on the valid tokens,
    valid by the sign of A (A > 0: the step up is within eps_high, else the step down within eps_low).
    c = dual_clip_c (None: no cap). `clipped`: the invalid tokens (A != 0)."""
    r = torch.exp(log_r.clamp(-20.0, 20.0))
    coef = r if cfg.dual_clip_c is None else clip(r, hi=operand(cfg.dual_clip_c, r))
    p, p_old = torch.exp(logp), torch.exp(old)
    lo, hi = operand(cfg.eps_low, r), operand(cfg.eps_high, r)
    if kind == "tv":
        up_ok, down_ok = (p - p_old) <= hi, (p - p_old) >= -lo
    else:  # the binary KL between Bernoulli(p_old) and Bernoulli(p), with verl's 1e-8
        kl = p_old * (old - logp) + (1.0 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
        up_ok, down_ok = (kl <= hi) | (p <= p_old), (kl <= lo) | (p >= p_old)
    valid = torch.where(A > 0, up_ok, down_ok)
    coef = torch.where(valid, coef, torch.zeros_like(coef))
    # a non-finite logp or old log-prob (unchecked input) makes its token NaN, not a 0 that the region chose
    # (the clamp of log r and the comparisons would otherwise hide it)
    coef = torch.where(torch.isfinite(logp) & torch.isfinite(old), coef, torch.full_like(coef, float("nan")))
    return -A * coef * logp, None, -A * coef, ~valid & (A != 0)


def geo_mean(A, log_r, m, seg_mean, log_w, cfg):
    """GMPO: R = exp(mean_t y), y = sgn(A) min(sgn(A) log r, sgn(A) clip(log r, -eps_low, eps_high)),
    pg = -A R g per token (g: the completion's geometric mean rollout weight, exp(log_w), or 1).
    Returns pg, d pg / d log R, the tokens through which log R moves with their log r (`spread`) and
    the tokens the clip stopped."""
    s = torch.sign(A)
    xc = clip(log_r, operand(-cfg.eps_low, log_r), operand(cfg.eps_high, log_r))
    y = s * torch.minimum(s * log_r, s * xc)
    log_R = seg_mean(torch.where(m, y, torch.zeros_like(y)))
    if log_w is not None:
        log_R = log_R + log_w
    pg = -A * torch.exp(log_R)
    spread = (s * log_r <= s * xc) & (s != 0)
    return pg, spread, (s * log_r > s * xc) & (s != 0)  # (a NaN log r or advantage: not counted as clipped)


def covariance(A, logp, m, M_safe):
    """(A - mean A)(logp - mean logp), the means over the counted tokens: their sums in float64, rounded to
    logp's dtype, then divided (the epilogue kernel's order: with one advantage for every token A - mean A is
    the rounding alone, and its sign orders the covariances)."""
    dt = logp.dtype
    zero = torch.zeros((), dtype=dt, device=logp.device)
    mean_a = torch.where(m, A, zero).sum(dtype=torch.float64).to(dt) / M_safe
    mean_lp = torch.where(m, logp, zero).sum(dtype=torch.float64).to(dt) / M_safe
    return (A - mean_a) * (logp - mean_lp)


def first_k(key, chosen, k, descending=False):
    """The `chosen` tokens among the first k of `key`'s order (k a 0-d device tensor; no host read)."""
    if key.numel() == 0:
        return chosen
    rank = torch.empty_like(key, dtype=torch.long)
    order = torch.argsort(key, descending=descending, stable=True)
    rank[order] = torch.arange(key.numel(), device=key.device)
    return chosen & (rank < k)


def select_count(ratio, M):
    """max(1, floor(ratio * M)) in float64, as verl's max(int(ratio * M), 1) on the host."""
    r = ratio.to(M.device, torch.float64) if isinstance(ratio, torch.Tensor) else ratio
    return torch.clamp(torch.floor(r * M.to(torch.float64)), min=1.0)


def draw_generator(cfg, device):
    """The generator clip_cov draws from on `device`: cfg.generator, else the device's default one."""
    if cfg.generator is not None:
        return cfg.generator
    if device.type == "cpu":
        return torch.default_generator
    return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]


def draw_state(cfg, device):
    """A checksum of clip_cov's generator state (its bytes as the host holds them: a CPU generator's state, a
    CUDA one's seed and offset; no device read), or None for the other policies: the ranks of a vocabulary
    split must draw the same numbers, so the agreement compares it (spec 12)."""
    if cfg.policy_loss != "clip-cov":
        return None
    return zlib.crc32(draw_generator(cfg, device).get_state().numpy().tobytes())


def uniform_draws(cfg, n, device):
    """clip_cov's n uniform draws in [0, 1), float64, from cfg.generator (None: the device's default), on the
    tokens' device (the epilogue kernel's path draws the same ones: pipeline/epilogue.tensors)."""
    gen = cfg.generator
    if gen is not None and gen.device.type != device.type:
        raise ValueError(f"GTPOConfig.generator is on {gen.device}, the tokens on {device}: clip_cov draws "
                         "on the tokens' device; pass a generator of that device")
    return torch.rand(n, dtype=torch.float64, device=device, generator=gen)


def clip_cov(pg, d_logr, dual, on_clip, A, logp, m, M, M_safe, cfg):
    """clip_cov on the PPO term (pg, d_logr from policy.ppo_parts; on_clip: verl's clip_by_origin; dual:
    the tokens its dual clip capped, or None): a uniformly random choice (cfg.generator) of
    max(1, floor(clip_cov_ratio M)) counted, unclipped tokens whose covariance lies in (clip_cov_lb,
    clip_cov_ub) get their term times 0 (value and gradient; NaN stays NaN). The tokens it reports as clipped
    are verl's pg_clipfrac's (its corr == 0): every chosen one, a zero advantage's included (and the dual
    clip's), not those the PPO clip stopped."""
    cov = covariance(A, logp, m, M_safe)
    cand = m & ~on_clip & (cov > operand(cfg.clip_cov_lb, cov)) & (cov < operand(cfg.clip_cov_ub, cov))
    u = uniform_draws(cfg, logp.numel(), logp.device).reshape(logp.shape)
    sel = first_k(torch.where(cand, u, 2.0), cand, select_count(cfg.clip_cov_ratio, M))
    keep = (~sel).to(pg.dtype)  # a product, as verl's pg * corr: a chosen NaN term stays NaN
    return pg * keep, d_logr * keep, sel if dual is None else sel | dual


def kl_cov(A, logp, log_r, m, M, M_safe, cfg):
    """-A r; the max(1, floor(kl_cov_ratio M)) counted tokens of largest covariance add
    ppo_kl_coef |log r|."""
    r = torch.exp(log_r)
    cov = covariance(A, logp, m, M_safe)
    sel = first_k(torch.where(m, cov, -math.inf), m, select_count(cfg.kl_cov_ratio, M), descending=True)
    coef = torch.where(sel, operand(cfg.ppo_kl_coef, r), torch.zeros((), dtype=r.dtype, device=r.device))
    u = times_adv(r, A)  # (0 at A = 0 whatever r: an overflowing ratio too)
    return -u + coef * log_r.abs(), -u + coef * torch.sign(log_r), None, _none(r)
