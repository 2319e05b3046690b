"""gtpo_reference: the float64 pure-PyTorch oracle of the GTPO loss (see gtpo_reference.py; the conflict
weights of spec 3 in gtpo_conflict.py; the GRPO family of spec 9 in gtpo_family.py; the sampler's distribution of
spec 13 in gtpo_sampling.py)."""
from .gtpo_reference import (LOSS_AGGS, POLICY_LOSSES, ROLLOUT_IS_MODES, conflict_weights, gtpo_loss,
                             rollout_is_weights, token_logprobs)
from .gtpo_sampling import (kept_set_row, kept_sets, per_token, replay_logprobs, replay_token_logprobs,
                            sampling_metrics)

__all__ = ["LOSS_AGGS", "POLICY_LOSSES", "ROLLOUT_IS_MODES", "token_logprobs", "conflict_weights",
           "gtpo_loss", "rollout_is_weights", "per_token", "kept_set_row", "kept_sets", "replay_logprobs",
           "sampling_metrics", "replay_token_logprobs"]
