"""gtpo-kernels: the GTPO policy-gradient loss as fused Triton kernels.

    from gtpo_kernels import gtpo_loss, GTPOConfig, conflict_weights, token_logprobs

The specification is docs/GTPO_SPEC.md; `gtpo_reference` (installed alongside) is the pure-PyTorch
oracle.
"""
from .api import GTPOOutput, conflict_weights, gtpo_loss, token_logprobs
from .config import LOSS_AGGS, PRESETS, GTPOConfig

__all__ = ["gtpo_loss", "GTPOConfig", "GTPOOutput", "conflict_weights", "token_logprobs", "LOSS_AGGS",
           "PRESETS"]
__version__ = "0.1.0"
