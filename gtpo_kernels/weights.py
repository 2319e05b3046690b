"""conflict_weights: the public call for the conflict-token weights of spec section 3 (the kernels are
conflict.py and conflict_triton.py)."""
from __future__ import annotations

import torch

from . import checks, conflict, dispatch
from .config import GTPOConfig, as_config
from .layout import pad, packed_layout

def conflict_weights(completion_ids, completion_mask, advantages, group_size=None, *, group_ids=None, config=None,
                     cu_seqlens=None, max_seqlen=None, dtype=torch.float32, validate=True, backend="auto"):
    """Conflict-token weights (spec section 3) -> (lam, n_conf).

    Call it once per batch when the advantages are computed (groups must be whole), then pass
    `lam=lam[rows], n_conf=n_conf[rows]` to `gtpo_loss` for any micro-batch of rows. lam has the shape
    of completion_ids ((B, T), or (N,) packed) and n_conf is (B,). Weights come from `config`
    (default GTPOConfig(): w_pos = 2.0, w_neg = 0.0). backend: 'auto' (a Triton kernel on CUDA, sort-based
    torch ops on the CPU), 'triton' or 'torch'; neither syncs with the host when validate=False (packed
    form: give max_seqlen too).

    Groups: `group_size` consecutive rows, or `group_ids` (instead): one hashable key per row (verl's
    `uid`: strings, ints, a numpy object array, or a 1-D integer tensor), rows of a group in any order,
    groups of any sizes. Grouping by key costs one host sync (the largest group's size).
    """
    cfg = GTPOConfig() if config is None else as_config(config)
    if advantages is None:
        raise TypeError("advantages is required: a (B,) tensor, one advantage per completion")
    b = checks.prepare_tokens(completion_ids, completion_mask, advantages, cu_seqlens=cu_seqlens,
                              max_seqlen=max_seqlen, validate=checks.host_checks(validate))
    layout = None
    if group_ids is not None:
        if group_size is not None:
            raise TypeError("pass group_size (contiguous groups) or group_ids (a group key per row), not both")
        from .grouping import group_layout
        layout = group_layout(group_ids, b.B, device=b.counted.device)
    else:
        group_size = checks.check_group_size(group_size, b.B)
    backend = dispatch.resolve_backend(backend, completion_ids.device)
    lam, n_conf = conflict_flat(b, group_size, cfg, dtype, "torch" if backend == "reference" else backend,
                                 layout=layout)
    return lam.reshape(b.tok_shape), n_conf


def conflict_flat(b, group_size, cfg, dtype, backend, layout=None):
    """lam (N,) flat and n_conf (B,) for a prepared batch (padded or packed). With a
    grouping.GroupLayout, rows are first moved to contiguous groups of layout.size slots."""
    if b.packed:
        L, pos = packed_layout(b)
        ids, m = pad(b, b.ids.long(), L, pos), pad(b, b.counted, L, pos)
    else:
        ids, m = b.ids.reshape(b.tok_shape), b.counted.reshape(b.tok_shape)
    if layout is None:
        conf_f, conf_b = conflict.conflict_runs(ids, m, b.adv, group_size, backend)
    else:  # padding slots: masked out, advantage 0 (inactive): they change no weight
        conf_f, conf_b = conflict.conflict_runs(layout.to_slots(ids), layout.to_slots(m, False),
                                                layout.to_slots(b.adv), layout.size, backend)
        conf_f, conf_b = conf_f[layout.slot], conf_b[layout.slot]
    lam, n_conf = conflict.weights_from_runs(conf_f, conf_b, b.adv, cfg.conflict_pos_weight,
                                             cfg.conflict_neg_weight, dtype)
    return (lam[b.seg, pos] if b.packed else lam.reshape(-1)), n_conf
