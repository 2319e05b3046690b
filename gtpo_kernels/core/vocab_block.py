"""VOCAB_BLOCK: the width of the vocabulary blocks whose statistics the forward pass merges in order (spec 14).

Every forward pass over a row of logits (Triton kernel and torch path alike) computes, for each block of
VOCAB_BLOCK consecutive vocabulary entries in order (the last one partial), the block's own statistics
(its maximum m_b, R_b = S_b - 1 and U_b relative to m_b) and folds them into the row's in block order with
one merge. A vocabulary-parallel call whose slice boundaries are all multiples of VOCAB_BLOCK has every
rank compute the statistics of its own blocks, gathers them and runs the very same merge over the blocks
in global order, so its logp and entropy are bitwise the single-process ones, whatever the number of ranks.

A power of two, fixed per process: 8192 by default, or the environment variable GTPO_VOCAB_BLOCK read
once when the package is imported (a power of two >= 16; tests use small values so that small
vocabularies span several blocks). It is never a per-call or per-batch size.
"""
from __future__ import annotations

import os

DEFAULT = 8192


def _from_env() -> int:
    raw = os.environ.get("GTPO_VOCAB_BLOCK", "")
    if raw == "":
        return DEFAULT
    try:
        v = int(raw)
    except ValueError:
        v = 0
    if v < 16 or v & (v - 1):
        raise ValueError(f"GTPO_VOCAB_BLOCK must be a power of two >= 16, got {raw!r}")
    return v


VOCAB_BLOCK = _from_env()


def n_blocks(V: int) -> int:
    """Blocks of VOCAB_BLOCK entries that a vocabulary (or a slice) of V entries spans."""
    return -(-int(V) // VOCAB_BLOCK)


def aligned(sizes) -> bool:
    """Whether every slice of a split with these slice sizes (rank order) starts at a multiple of VOCAB_BLOCK
    (an empty slice holds no block: its place does not matter)."""
    start = 0
    for s in sizes:
        if int(s) and start % VOCAB_BLOCK:
            return False
        start += int(s)
    return True
