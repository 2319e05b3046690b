"""conflict_weights: the public call for the conflict-token weights of spec section 3 (the math:
objective/conflict.py; groups split across ranks: distributed/data_parallel.py)."""
from __future__ import annotations

import torch

from ..core import batch, checks, entry
from ..core.config import GTPOConfig, as_config
from ..distributed.data_parallel import dp_conflict_weights
from ..kernels import dispatch
from ..objective.conflict import ID_LIMIT, conflict_flat
from ..objective.grouping import group_layout

@entry.backend_kernels
def conflict_weights(completion_ids, completion_mask, advantages, group_size=None, *, group_ids=None, config=None,
                     cu_seqlens=None, max_seqlen=None, dtype=torch.float32, validate=True, backend="auto",
                     process_group=None):
    """Conflict-token weights (spec section 3) -> (lam, n_conf).

    Call it once per batch when the advantages are computed (groups must be whole), then pass
    `lam=lam[rows], n_conf=n_conf[rows]` to `gtpo_loss` for any micro-batch of rows. lam has the shape
    of completion_ids ((B, T), or (N,) packed) and n_conf is (B,). Weights come from `config`
    (default GTPOConfig(): w_pos = 2.0, w_neg = 0.0). Counted ids must lie in [0, 2**31) and the
    advantages be finite (checked when validating; unvalidated, a completion holding another id gets
    lam = NaN, and a NaN advantage its whole group, whose conflicts its sign decides). backend: 'auto' (a
    Triton kernel on CUDA, sort-based torch ops on the CPU), 'triton' or 'torch'; neither syncs with the
    host when validate=False (packed form: give max_seqlen too).

    Groups: `group_size` consecutive rows, or `group_ids` (instead): one hashable key per row (verl's
    `uid`: strings, ints, a numpy object array, or a 1-D integer tensor), rows of a group in any order,
    groups of any sizes. Grouping by key costs one host sync (the largest group's size).

    process_group (data parallelism): this rank's rows are its part of one batch whose groups may
    straddle ranks. The batch is the ranks' rows concatenated in rank order (each rank may hold any
    number of rows, padded rows of any length T, or packed rows); with `group_size`, groups are
    `group_size` consecutive rows of that concatenation (its total must be a multiple of group_size;
    a rank's own count need not be); with `group_ids`, the keys are gathered too (integer tensors by
    an all-gather, other keys, e.g. strings, with `all_gather_object`, which on NCCL needs
    `torch.cuda.set_device` done) and a group is the rows with the same key on any rank. Returns this
    rank's rows: lam of its completion_ids' shape and n_conf (B,), equal to a single process's call on
    the concatenated batch. Every rank must call it (collectives); it syncs with the host.
    """
    if process_group is not None:
        return dp_conflict_weights(completion_ids, completion_mask, advantages, group_size, group_ids, config,
                                    cu_seqlens, max_seqlen, dtype, validate, backend, process_group)
    checks.check_float_dtype("dtype", dtype)  # (the weights hold NaN where unvalidated input is invalid)
    cfg = GTPOConfig() if config is None else as_config(config)
    checks.require_advantages(advantages)
    host = checks.host_checks(validate)
    b = batch.prepare_tokens(completion_ids, completion_mask, advantages, cu_seqlens=cu_seqlens,
                              max_seqlen=max_seqlen, validate=host)
    if host:  # unvalidated, a completion with such an id gets lam = NaN (objective/conflict.py)
        checks.check_ids_in_range(b.ids, b.counted, ID_LIMIT)
    layout = None
    if group_ids is not None:
        if group_size is not None:
            raise TypeError("pass group_size (contiguous groups) or group_ids (a group key per row), not both")
        layout = group_layout(group_ids, b.B, device=b.counted.device)
    else:
        group_size = checks.check_group_size(group_size, b.B)
    backend = dispatch.resolve_backend(backend, completion_ids.device)
    lam, n_conf = conflict_flat(b, group_size, cfg, dtype, "torch" if backend == "reference" else backend,
                                 layout=layout)
    return lam.reshape(b.tok_shape), n_conf
