"""GTPOOutput: what every loss call returns (gtpo_loss, gtpo_loss_from_logps, linear_gtpo_loss)."""
from __future__ import annotations

import dataclasses
from typing import Dict

import torch


@dataclasses.dataclass
class GTPOOutput:
    """What `gtpo_loss` returns. Per-token tensors are (B, T) (packed form: (N,)), detached, 0 where
    masked out; `loss` is differentiable (a scalar, or per token with loss_agg='none')."""
    loss: torch.Tensor
    logps: torch.Tensor
    entropy: torch.Tensor
    per_token_loss: torch.Tensor
    lam: torch.Tensor
    n_conf: torch.Tensor
    kept: torch.Tensor
    seq_entropy: torch.Tensor
    metrics: Dict[str, torch.Tensor]
