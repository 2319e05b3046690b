"""The TRL adapter's metrics of the loss beyond TRL's own, aggregated over all processes.

- `_log_mismatch`: spec 14's rollout/training mismatch (`gtpo/rollout_*`), when TRL keeps the engine's
  log-probs;
- `_logged_kl`: TRL's own `kl` metric's per-token values (the bias correction included);
- `_log_clip_ratios`: TRL's own clip metrics of its loss types (`clip_ratio/*` for the PPO term,
  `cispo_clip_ratio`, `vespo/phi_seq_mean`), by TRL's definitions on the loss's ratio;
- `_log_replay`: spec 13's kept-set metrics (`gtpo/kept_mass` when the sets are rebuilt by the sampler's
  rules, `gtpo/mean_kept_size`, `gtpo/replay_restored_frac`), when the loss replays kept sets.

Each mean is weighted by the tokens of each process it averages over, summed with the accelerator's
`reduce(..., reduction="sum")`, and appended to the trainer's metric lists (`trainer._metrics[mode]`).
No TRL import.
"""
from __future__ import annotations

import math

import torch

# spec 13's metrics of a call over kept sets (kernels/replay.py replay_metrics): means over its counted tokens
REPLAY_METRICS = ("kept_mass", "mean_kept_size", "replay_restored_frac")


def _log_mismatch(trainer, mode, met, n_tok):
    """Spec 14's metrics over all processes: each mean weighted by the process's tokens it averages over
    (the counted tokens whose difference is not NaN), the maximum of the maxima."""
    n_ok = n_tok * (1 - met["rollout_nan_frac"].float())
    names = ("rollout_k3", "rollout_abs_diff", "rollout_outside_frac")
    stats = torch.stack([met[k].float() * n_ok for k in names] + [met["rollout_nan_frac"].float() * n_tok, n_ok, n_tok])
    s = trainer.accelerator.reduce(stats.detach(), reduction="sum")
    biggest = trainer.accelerator.gather(met["rollout_max_abs_diff"].detach().float().reshape(1)).max()
    for k, v in zip(names, s[:3]):
        trainer._metrics[mode][f"gtpo/{k}"].append((v / s[4].clamp(min=1.0)).item())
    trainer._metrics[mode]["gtpo/rollout_nan_frac"].append((s[3] / s[5].clamp(min=1.0)).item())
    trainer._metrics[mode]["gtpo/rollout_max_abs_diff"].append(biggest.item())


def _log_replay(trainer, mode, met, n_tok):
    """Spec 13's metrics present in the loss's `met` over all processes: each a mean over the process's
    counted tokens, so weighted by them (`n_tok`). Nothing without kept sets (the loss reports none)."""
    names = [k for k in REPLAY_METRICS if k in met]
    if not names:
        return
    stats = torch.stack([met[k].detach().float() * n_tok for k in names] + [n_tok.detach().float()])
    s = trainer.accelerator.reduce(stats, reduction="sum")
    for k, v in zip(names, s[:-1]):
        trainer._metrics[mode][f"gtpo/{k}"].append((v / s[-1].clamp(min=1.0)).item())


def _logged_kl(cfg, logps, m, inputs):
    """TRL's logged per-token KL over the counted tokens `m` (bool, (B, T)): k3 to the reference, times the
    ratio coef_1 (token or sequence level; 1 on-policy) with use_bias_correction_kl, as TRL multiplies it
    before logging; 0 where not counted."""
    d = inputs["ref_per_token_logps"].to(logps.dtype) - logps
    kl = torch.exp(d) - d - 1
    if cfg.use_bias_correction_kl:
        kl = kl * torch.exp(_log_ratio(logps, m, inputs, logps.dtype, cfg.importance_sampling_level == "sequence"))
    return torch.where(m, kl, torch.zeros_like(kl)).detach()


def _log_ratio(logps, m, inputs, dt, sequence):
    """TRL's log coef_1 in dtype dt: log pi - log pi_old at the counted tokens `m` (B, T), 0 elsewhere and 0
    on-policy (no old log-probs); `sequence`: its mean over each completion's counted tokens (B, 1)."""
    old = inputs.get("old_per_token_logps")
    lr = torch.zeros(m.shape, dtype=dt, device=m.device) if old is None else \
        torch.where(m, logps.detach().to(dt) - old.to(dt), 0.0)
    return lr.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1) if sequence else lr


def _log_clip_ratios(trainer, mode, cfg, logps, m, inputs):
    """TRL's clip metrics, as its loss logs them, over all processes: for the PPO term (TRL's grpo, bnpo,
    dr_grpo, dapo, luspo) `clip_ratio/{low,high,region}_mean` (counted tokens, or completions at sequence
    level, whose ratio is below 1 - eps_low with A < 0 / above 1 + eps_high with A > 0; the ratio capped at
    delta first when set), `clip_ratio/low_min` and `clip_ratio/high_max` (over the completions' means);
    for cispo `cispo_clip_ratio` (ratio above eps_high with A > 0). m: the counted tokens (bool (B, T))."""
    if cfg.policy_loss not in ("ppo", "cispo", "vespo"):
        return
    with torch.no_grad():
        dt = torch.float32
        mf = m.to(dt)
        if cfg.policy_loss == "vespo":  # (its weight sums the token-level log-ratios over each completion)
            _log_vespo_phi(trainer, mode, cfg, _log_ratio(logps, m, inputs, dt, False), m, inputs)
            return
        r = torch.exp(_log_ratio(logps, m, inputs, dt, cfg.importance_sampling_level == "sequence"))
        adv = inputs["advantages"].to(dt)
        adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
        seq = r.shape[1] == 1
        w = torch.ones_like(r) if seq else mf  # what TRL's global mean counts: completions or counted tokens
        if cfg.policy_loss == "cispo":
            x = ((r > cfg.eps_high) & (adv > 0)).to(dt)
            tot = trainer.accelerator.reduce(torch.stack([(x * w).sum(), w.sum()]), reduction="sum")
            trainer._metrics[mode]["cispo_clip_ratio"].append((tot[0] / tot[1].clamp(min=1.0)).item())
            return
        if cfg.delta is not None:
            r = r.clamp(max=cfg.delta)
        low = ((r < 1 - cfg.eps_low) & (adv < 0)).to(dt)
        high = ((r > 1 + cfg.eps_high) & (adv > 0)).to(dt)
        parts = (low, high, torch.maximum(low, high))
        tot = trainer.accelerator.reduce(torch.stack([(x * w).sum() for x in parts] + [w.sum()]), reduction="sum")
        for name, k in (("low_mean", 0), ("high_mean", 1), ("region_mean", 2)):
            trainer._metrics[mode][f"clip_ratio/{name}"].append((tot[k] / tot[3].clamp(min=1.0)).item())
        per_seq = [x.squeeze(1) if seq else (x * mf).sum(-1) / mf.sum(-1) for x in (low, high)]
        lows, highs = (trainer.accelerator.gather(x) for x in per_seq)
        trainer._metrics[mode]["clip_ratio/low_min"].append(_nan_reduce(lows, torch.min))
        trainer._metrics[mode]["clip_ratio/high_max"].append(_nan_reduce(highs, torch.max))


def _log_vespo_phi(trainer, mode, cfg, lr, m, inputs):
    """TRL's `vespo/phi_seq_mean`: the mean over all processes' completions of VESPO's weight phi, formed as
    the loss forms it (objective.policy.vespo_phi), the engine's importance ratios folded in."""
    from ..objective.policy import vespo_phi
    B = lr.shape[0]
    is_w = inputs.get("importance_sampling_ratio")
    log_w = None
    if is_w is not None:  # per completion: the sum of the clamped logs, as TRL
        lw = torch.log(is_w.to(lr.dtype)).clamp(min=math.log(1e-8), max=20.0)
        log_w = torch.where(m, lw, torch.zeros_like(lw)).sum(-1) if lw.shape == m.shape else lw.reshape(B, -1).sum(-1)
    phi = vespo_phi(lr.reshape(-1), m.reshape(-1), lambda x: x.reshape(B, -1).sum(-1),
                    inputs["advantages"].reshape(B).to(lr.dtype), log_w, cfg)
    tot = trainer.accelerator.reduce(torch.stack([phi.sum(), torch.tensor(float(B), device=phi.device)]),
                                     reduction="sum")
    trainer._metrics[mode]["vespo/phi_seq_mean"].append((tot[0] / tot[1].clamp(min=1.0)).item())


def _nan_reduce(x, fn):
    """fn over the values that are not NaN (NaN where all are), as a number."""
    keep = x[~torch.isnan(x)]
    return float("nan") if keep.numel() == 0 else fn(keep).item()
