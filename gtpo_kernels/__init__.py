"""gtpo-kernels: the GTPO policy-gradient loss as fused Triton kernels.

    from gtpo_kernels import gtpo_loss, GTPOConfig, conflict_weights, token_logprobs
    from gtpo_kernels import gtpo_loss_from_logps, rollout_is_weights   # spec sections 9-10
    from gtpo_kernels import rollout_mismatch   # spec section 14: the rollout/training mismatch
    from gtpo_kernels import gtpo_token_advantages   # GTPO folded into token advantages (verl)
    from gtpo_kernels import linear_gtpo_loss, linear_token_logprobs    # spec section 11

The specification is docs/GTPO_SPEC.md; `gtpo_reference` (installed alongside) is the pure-PyTorch
oracle. The layers, each importing only those below it: api (the public calls) > pipeline (what they
run) > distributed (torch.distributed protocols) > objective (the O(N) loss math) > kernels (the
vocabulary and conflict passes, custom ops) > core (config, batch layout, checks, flags, output).
"""
from .api.advantages import gtpo_token_advantages
from .api.linear import linear_gtpo_loss, linear_token_logprobs
from .api.logits import gtpo_loss, token_logprobs
from .api.logps import gtpo_loss_from_logps
from .api.rollout import ROLLOUT_IS_MODES, rollout_is_weights, rollout_mismatch
from .api.weights import conflict_weights
from .core.config import IS_LEVELS, LOSS_AGGS, POLICY_LOSSES, PRESETS, GTPOConfig
from .core.output import GTPOOutput
from .core.vocab_block import VOCAB_BLOCK

__all__ = ["gtpo_loss", "gtpo_loss_from_logps", "linear_gtpo_loss", "linear_token_logprobs", "token_logprobs",
           "conflict_weights", "rollout_is_weights", "rollout_mismatch", "gtpo_token_advantages", "GTPOConfig", "GTPOOutput",
           "LOSS_AGGS", "POLICY_LOSSES", "IS_LEVELS", "PRESETS", "ROLLOUT_IS_MODES",
           "VOCAB_BLOCK"]
__version__ = "0.1.0"
