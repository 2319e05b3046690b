"""gtpo_reference: the float64 pure-PyTorch oracle of the GTPO loss (see gtpo_reference.py)."""
from .gtpo_reference import LOSS_AGGS, conflict_weights, gtpo_loss, token_logprobs

__all__ = ["LOSS_AGGS", "token_logprobs", "conflict_weights", "gtpo_loss"]
