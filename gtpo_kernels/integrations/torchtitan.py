"""GTPO inside torchtitan (0.3): a loss for its RL trainer that runs the fused LM head on the hidden
states, so the (tokens x vocabulary) logits are never materialized.

torchtitan's RL trainer (`torchtitan.experiments.rl.actors.trainer.PolicyTrainer`) builds its loss from
`config.loss` (a `BaseLoss.Config`); when the loss is a `ChunkedLossWrapper` it hands it the model's
`lm_head` (`set_lm_head`) and makes the model return hidden states (`_skip_lm_head`). `GTPOLoss` is
such a loss (a subclass of `ChunkedLossWrapper`, so the trainer wires it the same way), but instead of
applying the head chunk by chunk it calls `linear_gtpo_loss` on the hidden states and the head's
weight. The trainer calls it as any RL loss:
`loss_fn(pred, labels, num_global_valid_tokens, generator_logprobs=..., advantages=..., loss_mask=...)`.

The loss: the PPO clip against the generator's log-probs, summed over the counted tokens (`loss_mask`
and a finite generator log-prob, as torchtitan's GRPO/DAPO losses) and divided by torchtitan's
`global_valid_tokens` (GTPO's `token-mean` with `num_items_in_batch`; without it, by 1: a sum, as
torchtitan's losses), plus GTPO's entropy filter and shaping (spec 2) with the current policy's entropies,
which the fused head computes on the way. One difference: torchtitan's DAPOLoss clamps log r to
[-10, 10] before exp; the fused head's ratio is not clamped, so the two differ on a token with
|log r| > 10 (r above e^10 ~ 22026: a rollout/training mismatch that torchtitan's clamp hides).
The completions are the runs of counted tokens in each packed row (one sample's completion; a sample
whose completion is split by masked tokens, e.g. multi-turn, counts as several completions).
What torchtitan does not carry to its loss: group ids. So GTPO's conflict weights (spec 3) are off
here (`use_conflict_mask=False`); torchtitan's advantages are one value per sample, which the loss
checks. With `entropy_threshold=None, entropy_penalty=0` it is torchtitan's `DAPOLoss`/`GRPOLoss`.

    from gtpo_kernels.integrations.torchtitan import GTPOLoss
    config.trainer.loss = GTPOLoss.Config(eps_low=0.2, eps_high=0.28, entropy_threshold=0.693)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor

from ..api.linear import linear_gtpo_loss
from ..core.config import GTPOConfig

from torchtitan.components.loss import BaseLoss, ChunkedLossWrapper  # noqa: E402  (torchtitan is required)


_DEFAULT = GTPOConfig()  # the loss's defaults are GTPOConfig's


class GTPOLoss(ChunkedLossWrapper):
    """torchtitan RL loss: GTPO through the fused LM head (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        """The GTPOConfig fields this loss takes, with GTPOConfig's defaults, and the head's budget."""
        eps_low: float = _DEFAULT.eps_low
        """PPO clip: the ratio is clamped to ``[1 - eps_low, 1 + eps_high]``."""
        eps_high: float = _DEFAULT.eps_high
        entropy_threshold: Optional[float] = _DEFAULT.entropy_threshold
        """GTPO's entropy filter h_max (None: off)."""
        entropy_penalty: float = _DEFAULT.entropy_penalty
        """GTPO's shaping gamma in Ahat = delta * (A - gamma * Hbar) (0: off)."""
        initial_entropy: Optional[float] = _DEFAULT.initial_entropy
        temperature: float = _DEFAULT.temperature
        memory_budget: Optional[int] = None
        """Bytes for one tile of logits and its gradient (default: the package's, 1 GiB)."""

    def __init__(self, config: Config, *, compile_config=None):
        del compile_config  # the fused head is Triton kernels; nothing to compile here
        self.gtpo_config = GTPOConfig.preset(
            "grpo", eps_low=config.eps_low, eps_high=config.eps_high, entropy_threshold=config.entropy_threshold,
            entropy_penalty=config.entropy_penalty, initial_entropy=config.initial_entropy,
            temperature=config.temperature, loss_agg="token-mean")
        self.memory_budget = config.memory_budget
        self.lm_head = None
        self.num_chunks = 1

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens=None, *,
                 generator_logprobs: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor,
                 **unused: Any):
        if self.lm_head is None:
            raise RuntimeError("GTPOLoss needs the model's lm_head: the trainer calls set_lm_head(model.lm_head) "
                               "for a ChunkedLossWrapper loss; call it yourself outside torchtitan's trainer")
        weight = self.lm_head.weight
        bias = getattr(self.lm_head, "bias", None)
        if isinstance(pred, DTensor) or isinstance(weight, DTensor):
            raise NotImplementedError("GTPOLoss takes plain tensors (no DTensor: tensor or sequence parallelism "
                                      "of the LM head is not supported)")
        if pred.dim() != 3 or tuple(labels.shape) != tuple(pred.shape[:2]):
            raise ValueError(f"pred must be the hidden states (B, L, D) and labels (B, L), got {tuple(pred.shape)} "
                             f"and {tuple(labels.shape)}")
        B, L, D = pred.shape
        counted = loss_mask.bool() & torch.isfinite(generator_logprobs)
        cu, adv = completions(counted, advantages)
        old = torch.where(counted, generator_logprobs, torch.zeros_like(generator_logprobs))
        # torchtitan's divisor: max(global_valid_tokens, 1), and 1 (a sum) without it, as its DAPOLoss
        n = 1.0 if global_valid_tokens is None else max(float(global_valid_tokens), 1.0)
        out = linear_gtpo_loss(pred.reshape(B * L, D), weight, labels.reshape(-1).long(), adv, counted.reshape(-1),
                               bias=bias, old_logps=old.reshape(-1), config=self.gtpo_config,
                               cu_seqlens=cu, max_seqlen=L, num_items_in_batch=n,
                               memory_budget=self.memory_budget)
        with torch.no_grad():
            metrics = {"loss/mean": out.loss.detach().float(),
                       "trainer/entropy/mean": (out.entropy.reshape(B, L).float() * counted).sum() / n}
            metrics.update(_ratio_metrics(out.logps.reshape(B, L).float(), old.float(), counted, n,
                                          self.gtpo_config.eps_low, self.gtpo_config.eps_high))
        return out.loss, metrics


def _ratio_metrics(logp, old, counted, n, eps_low, eps_high):
    """The ratio and log-prob metrics torchtitan's DAPOLoss logs, by its definitions (pre-normalized by its
    divisor n for a sum over ranks): the mean ratio (log r clamped to [-10, 10], as its loss), the fraction
    moved by the clip, the mean and largest trainer/generator log-prob difference, the fraction of tokens
    whose log-probs differ."""
    c = counted.to(logp.dtype)
    diff = torch.where(counted, logp - old, torch.zeros_like(logp))
    r = torch.exp(diff.clamp(-10.0, 10.0))
    moved = (r - r.clamp(1 - eps_low, 1 + eps_high)).abs() > 1e-6
    return {"loss/ratio_mean": (r * c).sum() / n, "loss/ratio_clipped_frac": (moved * c).sum() / n,
            "bit_wise/logprob_diff/mean": diff.sum() / n,
            "bit_wise/ratio_tokens_different/mean": ((diff.abs() > 1e-6) * c).sum() / n,
            "bit_wise/logprob_diff/max": diff.abs().max()}


def completions(counted: torch.Tensor, advantages: torch.Tensor):
    """The packed layout of (B, L) rows: a completion starts at each run of counted tokens (and at each
    row start, so none spans two rows) -> (cu_seqlens int32, advantages per completion). The advantage
    of a completion is its counted tokens' value, checked to be one value (host read)."""
    B, L = counted.shape
    prev = torch.nn.functional.pad(counted[:, :-1], (1, 0), value=False)
    start = (counted & ~prev)
    start[:, 0] = True
    flat = start.reshape(-1)
    idx = torch.nonzero(flat).reshape(-1)
    cu = torch.cat([idx, idx.new_tensor([B * L])]).to(torch.int32)
    seg = torch.cumsum(flat.long(), 0) - 1
    a = advantages.reshape(-1).to(torch.float64 if advantages.dtype == torch.float64 else torch.float32)
    c = counted.reshape(-1)
    n_seg = idx.numel()
    big = torch.full((n_seg,), float("inf"), dtype=a.dtype, device=a.device)
    lo = big.scatter_reduce(0, seg[c], a[c], "amin", include_self=True)
    hi = (-big).scatter_reduce(0, seg[c], a[c], "amax", include_self=True)
    has = torch.zeros(n_seg, dtype=torch.bool, device=a.device).index_fill_(0, seg[c], True)
    if bool(((hi != lo) & has).any()):
        raise ValueError("advantages must hold one value per sample at its counted tokens (torchtitan's "
                         "group-relative advantages); per-token advantages cannot be GTPO-shaped")
    return cu, torch.where(has, lo, torch.zeros_like(lo))


__all__ = ["GTPOLoss", "completions"]
