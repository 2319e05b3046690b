"""gtpo-kernels: the GTPO policy-gradient loss as fused Triton kernels.

    from gtpo_kernels import gtpo_loss, GTPOConfig, conflict_weights, token_logprobs
    from gtpo_kernels import gtpo_loss_from_logps, rollout_is_weights   # spec sections 9-10
    from gtpo_kernels import gtpo_token_advantages   # GTPO folded into token advantages (verl)
    from gtpo_kernels import linear_gtpo_loss, linear_token_logprobs    # spec section 11

The specification is docs/GTPO_SPEC.md; `gtpo_reference` (installed alongside) is the pure-PyTorch
oracle.
"""
from .advantages import gtpo_token_advantages
from .api import gtpo_loss, gtpo_loss_from_logps, token_logprobs
from .api_linear import linear_gtpo_loss, linear_token_logprobs
from .config import IS_LEVELS, LOSS_AGGS, POLICY_LOSSES, PRESETS, GTPOConfig
from .loss import GTPOOutput
from .rollout import ROLLOUT_IS_MODES, rollout_is_weights
from .weights import conflict_weights

__all__ = ["gtpo_loss", "gtpo_loss_from_logps", "linear_gtpo_loss", "linear_token_logprobs", "token_logprobs",
           "conflict_weights", "rollout_is_weights", "gtpo_token_advantages", "GTPOConfig", "GTPOOutput",
           "LOSS_AGGS", "POLICY_LOSSES", "IS_LEVELS", "PRESETS", "ROLLOUT_IS_MODES"]
__version__ = "0.1.0"
