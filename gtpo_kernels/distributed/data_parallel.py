"""conflict_weights(process_group=...): groups split across data-parallel ranks (spec 12).

A group's completions may sit on several ranks: one small all-gather of every rank's shapes comes first
(ranks that disagree, or a batch that groups cannot split evenly, raise the same error on every rank
instead of leaving one waiting), then one all-gather of the token ids, the mask and the advantages'
signs (all the weights depend on, spec 3; 16 bytes per token and 8 per completion, padded to the longest
rank); the weights are computed on the whole batch in rank order and each rank keeps its own rows."""
from __future__ import annotations

import pickle
import types

import torch

from ..core import batch, checks
from ..core.config import GTPOConfig, as_config
from ..kernels import dispatch
from ..objective.conflict import ID_LIMIT, conflict_flat
from ..objective.grouping import group_codes, group_layout
from . import agree, digest

_KEYS_NONE, _KEYS_TENSOR, _KEYS_OBJECTS = 0, 1, 2


def _key_kind(group_ids):
    if group_ids is None:
        return _KEYS_NONE
    if isinstance(group_ids, torch.Tensor) and not (group_ids.dtype.is_floating_point or group_ids.dtype.is_complex):
        return _KEYS_TENSOR
    return _KEYS_OBJECTS


def _local_keys(group_ids, B):
    """This rank's keys as a plain list for all_gather_object (numpy scalars and 0-d tensors unwrapped)."""
    if isinstance(group_ids, torch.Tensor):
        return group_ids.reshape(-1).tolist()
    return [k.item() if hasattr(k, "item") else k for k in group_ids]


def dp_conflict_weights(completion_ids, completion_mask, advantages, group_size, group_ids, config, cu_seqlens,
                         max_seqlen, dtype, validate, backend, group):
    import torch.distributed as dist
    where = "conflict_weights(process_group=...)"
    with agree.guard(group) as g:  # 1. this rank's own arguments: an error is held until every rank knows
        g.local = _local(completion_ids, completion_mask, advantages, group_size, group_ids, config,
                         cu_seqlens, max_seqlen, validate, backend, dtype)
        if cu_seqlens is not None and not g.local.host:  # unvalidated: flagged on the device, read below
            N = completion_ids.shape[0]
            agree.fail_if(g, batch.cu_malformed(cu_seqlens, N), ValueError(
                f"cu_seqlens must start at 0, never decrease and end at N = {N} (completion_ids' length)"))
        g.fields = g.local.fields
    rows = agree.agree(g, 6, agree.collective_device(group, completion_ids), where, raw=6)  # 2. 64 bytes per rank
    packed, Bs, Ts, options, gs, kinds = (list(c) for c in zip(*rows))
    _check_agreed(packed, Bs, gs, kinds, where)
    agree.disagree(where, options, "the options (compared by value: the config, dtype, validate, backend)",
                   "pass the same options on every rank")
    loc = g.local
    whole, all_keys = _gather_batch(loc, group_ids, packed[0], Bs, Ts, kinds, group)  # 3.
    layout, group_size = None, gs[0]
    if kinds[0] != _KEYS_NONE:
        if all_keys is None:  # arbitrary keys (or a mix of kinds): gathered as Python objects
            keys = [None] * dist.get_world_size(group)
            dist.all_gather_object(keys, _local_keys(group_ids, loc.b.B) if loc.keys is None else loc.keys,
                                   group=group)
            all_keys = [k for part in keys for k in part]
        layout, group_size = group_layout(all_keys, sum(Bs), device=loc.b.ids.device), None
    lam, n_conf = conflict_flat(whole, group_size, loc.cfg, dtype,
                                "torch" if loc.backend == "reference" else loc.backend, layout=layout)
    b, rank = loc.b, dist.get_rank(group)
    first = sum(Bs[:rank])
    if packed[0]:
        start = sum(Ts[:rank])
        return lam[start:start + loc.T], n_conf[first:first + b.B]
    return lam.reshape(sum(Bs), max(Ts))[first:first + b.B, :loc.T], n_conf[first:first + b.B]


def _local(completion_ids, completion_mask, advantages, group_size, group_ids, config, cu_seqlens, max_seqlen,
           validate, backend, dtype):
    """This rank's checks (the same as one process), inside the guard -> a namespace: cfg, host, b,
    backend, T, keys (picklable, for the object gather), fields [packed, B, T, options, group_size, key
    kind]. max_seqlen is this rank's own: the whole batch's padded length is read from its lengths."""
    cfg = GTPOConfig() if config is None else as_config(config)
    checks.require_advantages(advantages)
    checks.check_float_dtype("dtype", dtype)
    host = checks.host_checks(validate)
    b = batch.prepare_tokens(completion_ids, completion_mask, advantages, cu_seqlens=cu_seqlens,
                             max_seqlen=max_seqlen, validate=host, allow_empty=True)  # any number of rows
    if host:  # as one process: unvalidated, a completion with such an id gets lam = NaN (objective/conflict.py)
        checks.check_ids_in_range(b.ids, b.counted, ID_LIMIT)
    kind, keys = _key_kind(group_ids), None
    if group_ids is not None:
        if group_size is not None:
            raise TypeError("pass group_size (contiguous groups) or group_ids (a group key per row), not both")
        group_codes(group_ids, b.B, "group_ids", b.ids.device)  # the same checks as one process
        if kind == _KEYS_OBJECTS:  # an unpicklable key fails here, not inside the object gather
            keys = _local_keys(group_ids, b.B)
            pickle.dumps(keys)
    else:  # a positive int (the local row count need not be a multiple: groups may straddle ranks)
        group_size = checks.check_group_size(group_size, 0)
    backend = dispatch.resolve_backend(backend, completion_ids.device)
    T = b.ids.numel() if b.packed else b.tok_shape[1]
    options = digest.fingerprint_field((str(dtype), host, backend, cfg))
    fields = [int(b.packed), b.B, T, options, 0 if group_size is None else group_size, kind]
    return types.SimpleNamespace(cfg=cfg, host=host, b=b, backend=backend, T=T, keys=keys, fields=fields)


def _check_agreed(packed, Bs, gs, kinds, where):
    """The same decision on every rank from the gathered rows: the form, the grouping, even groups."""
    world = len(packed)
    if len(set(packed)) > 1:
        raise ValueError(f"{where}: the ranks disagree on the form: packed (cu_seqlens) on ranks "
                         f"{[r for r in range(world) if packed[r]]}, padded on the others; use one form everywhere")
    if len(set(gs)) > 1 or len({k == _KEYS_NONE for k in kinds}) > 1:
        raise ValueError(f"{where}: the ranks disagree on the grouping: group_size per rank "
                         f"{[g if k == _KEYS_NONE else 'group_ids' for g, k in zip(gs, kinds)]}; pass the same "
                         f"group_size (or group_ids) on every rank")
    if sum(Bs) == 0:
        raise ValueError(f"{where}: the batch is empty: no rank holds a completion (each rank may hold any "
                         f"number, zero included, but not every rank none)")
    if kinds[0] == _KEYS_NONE and sum(Bs) % gs[0]:
        raise ValueError(f"{where}: a group split unevenly: the ranks hold {Bs} completions, {sum(Bs)} in all, "
                         f"not a multiple of group_size = {gs[0]} (groups are group_size consecutive completions "
                         f"in rank order)")


def _payload(b, packed, T_max, B_max, key_col):
    """This rank's ids, mask and advantages' signs (int64 keys too) as one int64 vector, padded to the
    longest rank (16 bytes per token and 8 per completion). A NaN advantage's sign travels as 2 (_signs: NaN
    again, so that its group's weights are NaN as in one process)."""
    ids, m = b.ids.long(), b.counted.long()
    adv = b.adv.detach()
    sign = torch.where(torch.isnan(adv), 2.0, torch.sign(adv)).long()
    if packed:
        cu = b.cu_seqlens.long()
        fields = [(ids, T_max), (m, T_max), (cu[1:] - cu[:-1], B_max), (sign, B_max)] + [(k, B_max) for k in key_col]
        return torch.cat([torch.nn.functional.pad(x, (0, n - x.numel())) for x, n in fields])
    T = b.tok_shape[1]
    rows = torch.cat([torch.nn.functional.pad(x.reshape(b.tok_shape), (0, T_max - T)) for x in (ids, m)], 1)
    payload = torch.cat([rows, sign[:, None]] + [k[:, None] for k in key_col], 1)
    return torch.nn.functional.pad(payload, (0, 0, 0, B_max - b.B)).reshape(-1)


def _gather_batch(loc, group_ids, packed, Bs, Ts, kinds, group):
    """One all-gather of every rank's payload -> (the whole batch in rank order, int64 keys or None)."""
    import torch.distributed as dist
    b = loc.b
    tensor_keys = kinds[0] == _KEYS_TENSOR and len(set(kinds)) == 1
    key_col = [group_ids.reshape(-1).to(b.ids.device, torch.int64)] if tensor_keys else []
    T_max, B_max = max(Ts), max(Bs)
    payload = _payload(b, packed, T_max, B_max, key_col)
    gathered = [torch.empty_like(payload) for _ in Bs]
    dist.all_gather(gathered, payload.to(agree.collective_device(group, payload)), group=group)
    gathered = [x.to(b.ids.device) for x in gathered]
    if packed:
        o = [0, T_max, 2 * T_max, 2 * T_max + B_max, 2 * T_max + 2 * B_max]
        part = [[x[o[j]:o[j] + n] for j, n in enumerate((Ts[r], Ts[r], Bs[r], Bs[r], Bs[r]))]
                for r, x in enumerate(gathered)]  # ids, mask, lengths, signs, keys of rank r
        lengths = torch.cat([p[2] for p in part])
        all_cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        whole = batch.prepare_tokens(torch.cat([p[0] for p in part]), torch.cat([p[1] for p in part]).bool(),
                                     _signs(torch.cat([p[3] for p in part])), cu_seqlens=all_cu,
                                     validate=False)
        return whole, torch.cat([p[4] for p in part]) if key_col else None
    width = 2 * T_max + 1 + len(key_col)
    rows = torch.cat([x.reshape(B_max, width)[:Bs[r]] for r, x in enumerate(gathered)])
    whole = batch.prepare_tokens(rows[:, :T_max], rows[:, T_max:2 * T_max].bool(), _signs(rows[:, 2 * T_max]),
                                 validate=False)
    return whole, rows[:, 2 * T_max + 1] if key_col else None


def _signs(x):
    """The gathered signs as the advantages the weights are computed from (_payload's 2: NaN)."""
    return torch.where(x == 2, float("nan"), x.float())
