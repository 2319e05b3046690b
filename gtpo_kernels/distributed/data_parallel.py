"""conflict_weights(process_group=...): groups split across data-parallel ranks (spec 12).

A group's completions may sit on several ranks: one small all-gather of every rank's shapes comes first
(ranks that disagree, or a batch that groups cannot split evenly, raise the same error on every rank
instead of leaving one waiting), then one all-gather of the token ids, the mask and the advantages'
signs (all the weights depend on, spec 3; 16 bytes per token and 8 per completion, padded to the longest
rank); the weights are computed on the whole batch in rank order and each rank keeps its own rows."""
from __future__ import annotations

import torch

from ..core import batch, checks
from ..core.config import GTPOConfig, as_config
from ..core.layout import packed_layout
from ..kernels import dispatch
from ..objective.conflict import conflict_flat
from ..objective.grouping import group_codes, group_layout

_KEYS_NONE, _KEYS_TENSOR, _KEYS_OBJECTS = 0, 1, 2


def _key_kind(group_ids):
    if group_ids is None:
        return _KEYS_NONE
    if isinstance(group_ids, torch.Tensor) and not (group_ids.dtype.is_floating_point or group_ids.dtype.is_complex):
        return _KEYS_TENSOR
    return _KEYS_OBJECTS


def _collective_device(group, completion_ids):
    import torch.distributed as dist
    device = completion_ids.device if isinstance(completion_ids, torch.Tensor) else torch.device("cpu")
    if device.type == "cpu" and dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _local_keys(group_ids, B):
    """This rank's keys as a plain list for all_gather_object (numpy scalars and 0-d tensors unwrapped)."""
    if isinstance(group_ids, torch.Tensor):
        return group_ids.reshape(-1).tolist()
    return [k.item() if hasattr(k, "item") else k for k in group_ids]


def dp_conflict_weights(completion_ids, completion_mask, advantages, group_size, group_ids, config, cu_seqlens,
                         max_seqlen, dtype, validate, backend, group):
    import torch.distributed as dist
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = _collective_device(group, completion_ids)
    # 1. this rank's own arguments; an error is held until every rank knows (no rank left waiting)
    err, b = None, None
    try:
        cfg = GTPOConfig() if config is None else as_config(config)
        checks.require_advantages(advantages)
        b = batch.prepare_tokens(completion_ids, completion_mask, advantages, cu_seqlens=cu_seqlens,
                                  max_seqlen=max_seqlen, validate=checks.host_checks(validate))
        if group_ids is not None:
            if group_size is not None:
                raise TypeError("pass group_size (contiguous groups) or group_ids (a group key per row), not both")
            group_codes(group_ids, b.B, "group_ids", b.ids.device)  # the same checks as one process
        else:  # a positive int (the local row count need not be a multiple: groups may straddle ranks)
            group_size = checks.check_group_size(group_size, 0)
        backend = dispatch.resolve_backend(backend, completion_ids.device)
    except (TypeError, ValueError) as e:
        err = e
    ok = err is None
    kind = _key_kind(group_ids)
    T = (b.ids.numel() if b.packed else b.tok_shape[1]) if ok else 0
    L = (packed_layout(b)[0] if b.packed else T) if ok else 0
    mine = torch.tensor([int(ok), int(ok and b.packed), b.B if ok else 0, T, L,
                         group_size if ok and group_size is not None else 0, kind], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)  # 2. the one small collective: 56 bytes per rank
    every = torch.stack(every).cpu()
    okr, packed, Bs, Ts, Ls, gs, kinds = every.T.tolist()
    where = "conflict_weights(process_group=...)"
    if not ok:
        raise err
    if not all(okr):
        raise ValueError(f"{where}: rank(s) {[r for r in range(world) if not okr[r]]} refused their arguments "
                         f"(their own error says why); every rank raises")
    if len(set(packed)) > 1:
        raise ValueError(f"{where}: the ranks disagree on the form: packed (cu_seqlens) on ranks "
                         f"{[r for r in range(world) if packed[r]]}, padded on the others; use one form everywhere")
    if len(set(gs)) > 1 or len({k == _KEYS_NONE for k in kinds}) > 1:
        raise ValueError(f"{where}: the ranks disagree on the grouping: group_size per rank "
                         f"{[g if k == _KEYS_NONE else 'group_ids' for g, k in zip(gs, kinds)]}; pass the same "
                         f"group_size (or group_ids) on every rank")
    B_tot = sum(Bs)
    if kinds[0] == _KEYS_NONE and B_tot % gs[0]:
        raise ValueError(f"{where}: a group split unevenly: the ranks hold {Bs} completions, {B_tot} in all, "
                         f"not a multiple of group_size = {gs[0]} (groups are group_size consecutive completions "
                         f"in rank order)")
    # 3. one all-gather of ids, mask and advantages' signs (int64 keys too), padded to the longest rank
    ids, m = b.ids.long(), b.counted.long()
    sign = torch.sign(b.adv.detach()).nan_to_num(0.0).long()
    tensor_keys = kinds[0] == _KEYS_TENSOR and len(set(kinds)) == 1
    key_col = [group_ids.reshape(-1).to(ids.device, torch.int64)] if tensor_keys else []
    T_max, B_max = max(Ts), max(Bs)
    if packed[0]:
        cu = b.cu_seqlens.long()
        fields = [(ids, T_max), (m, T_max), (cu[1:] - cu[:-1], B_max), (sign, B_max)] + [(k, B_max) for k in key_col]
        payload = torch.cat([torch.nn.functional.pad(x, (0, n - x.numel())) for x, n in fields])
    else:
        rows = torch.cat([ids.reshape(b.tok_shape), m.reshape(b.tok_shape)], 1) if T_max == T else torch.cat(
            [torch.nn.functional.pad(x.reshape(b.tok_shape), (0, T_max - T)) for x in (ids, m)], 1)
        payload = torch.cat([rows, sign[:, None]] + [k[:, None] for k in key_col], 1)
        payload = torch.nn.functional.pad(payload, (0, 0, 0, B_max - b.B)).reshape(-1)
    gathered = [torch.empty_like(payload) for _ in range(world)]
    dist.all_gather(gathered, payload.to(device), group=group)
    gathered = [g.to(ids.device) for g in gathered]
    if packed[0]:
        parts = []
        for r, g in enumerate(gathered):
            o = [0, T_max, 2 * T_max, 2 * T_max + B_max, 2 * T_max + 2 * B_max]
            parts.append((g[:Ts[r]], g[o[1]:o[1] + Ts[r]], g[o[2]:o[2] + Bs[r]], g[o[3]:o[3] + Bs[r]],
                          g[o[4]:o[4] + Bs[r]] if key_col else None))
        lengths = torch.cat([p[2] for p in parts])
        all_cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        all_ids, all_m = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]).bool()
        all_sign = torch.cat([p[3] for p in parts])
        all_keys = torch.cat([p[4] for p in parts]) if key_col else None
        whole = batch.prepare_tokens(all_ids, all_m, all_sign.float(), cu_seqlens=all_cu, max_seqlen=max(Ls),
                                      validate=False)
    else:
        width = 2 * T_max + 1 + len(key_col)
        rows = torch.cat([g.reshape(B_max, width)[:Bs[r]] for r, g in enumerate(gathered)])
        all_ids, all_m, all_sign = rows[:, :T_max], rows[:, T_max:2 * T_max].bool(), rows[:, 2 * T_max]
        all_keys = rows[:, 2 * T_max + 1] if key_col else None
        whole = batch.prepare_tokens(all_ids, all_m, all_sign.float(), validate=False)
    layout = None
    if kinds[0] != _KEYS_NONE:
        if all_keys is None:  # arbitrary keys (or a mix of kinds): gathered as Python objects
            keys = [None] * world
            dist.all_gather_object(keys, _local_keys(group_ids, b.B), group=group)
            all_keys = [k for part in keys for k in part]
        layout = group_layout(all_keys, B_tot, device=ids.device)
        group_size = None
    else:
        group_size = gs[0]
    lam, n_conf = conflict_flat(whole, group_size, cfg, dtype, "torch" if backend == "reference" else backend,
                                layout=layout)
    first = sum(Bs[:rank])
    if packed[0]:
        start = sum(Ts[:rank])
        return lam[start:start + T], n_conf[first:first + b.B]
    return lam.reshape(B_tot, T_max)[first:first + b.B, :T], n_conf[first:first + b.B]
