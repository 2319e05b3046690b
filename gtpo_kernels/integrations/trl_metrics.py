"""The TRL adapter's metrics of the loss beyond TRL's own, aggregated over all processes.

- `_log_mismatch`: spec 14's rollout/training mismatch (`gtpo/rollout_*`), when TRL keeps the engine's
  log-probs;
- `_logged_kl`: TRL's own `kl` metric's per-token values (the bias correction included);
- `_log_replay`: spec 13's kept-set metrics (`gtpo/kept_mass` when the sets are rebuilt by the sampler's
  rules, `gtpo/mean_kept_size`, `gtpo/replay_restored_frac`), when the loss replays kept sets.

Each mean is weighted by the tokens of each process it averages over, summed with the accelerator's
`reduce(..., reduction="sum")`, and appended to the trainer's metric lists (`trainer._metrics[mode]`).
No TRL import.
"""
from __future__ import annotations

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
    old = inputs.get("old_per_token_logps")
    if cfg.use_bias_correction_kl and old is not None:
        lr = torch.where(m, logps - old.to(logps.dtype), torch.zeros_like(logps))
        if cfg.importance_sampling_level == "sequence":
            lr = lr.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
        kl = kl * torch.exp(lr)
    return torch.where(m, kl, torch.zeros_like(kl)).detach()
