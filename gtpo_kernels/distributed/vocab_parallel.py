"""Vocabulary-parallel logits over torch.distributed (spec 12).

Rank r of the process group holds the r-th contiguous slice of the vocabulary (sizes may differ; ids
are global). Each rank runs the forward pass on its slice with its local ids (a token whose id lies
elsewhere is simply not its target), and the per-slice statistics are merged exactly around two
all-reduces (kernels/vp_merge: the global row maximum, 4 bytes per token, then 7 sums, 28 bytes) into
log S, H, logp and q as on one device: 32 bytes per token in all. When every slice starts at a multiple of VOCAB_BLOCK (spec 14) the
row statistics instead travel from rank to rank, each folding its blocks in global block order with the
single-process pass's own merge (vp_blocks): bitwise the single-process outputs, 32 bytes per token too.
Every rank ends with the same per-token statistics, so the loss, the outputs and the metrics are
identical on every rank; the backward pass runs on each slice with them and communicates nothing (each rank's gradient is its slice of the single-process gradient).

Before any other collective, `vocab_layout` makes the one small collective (agree.py): every rank's error flag,
slice size, shapes, options and a digest of its tokens, so that a rank that failed its checks, ranks
that disagree, or ids outside the whole vocabulary make every rank raise the same error. The loss's merged
sums (`Pending`) form that row in the forward kernel's launch, which runs first (kernels/vp_first_triton: it
reads only this rank's tensors; the merge's sums kernel reads the target logit once the slice's first id is
known).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..core import checks, vocab_block
from ..core.config import GTPOConfig
from ..core.flags import nan_at_flags
from ..kernels import dispatch, ops, vp_merge
from ..objective import verl_modes
from . import agree, digest

BYTES_PER_TOKEN = 4 + 7 * 4  # the two all-reduces of vp_forward (float32 statistics)
KEY = 8  # the shapes a rank brings to the agreement, padded to this many int64


REPLAY = ("sampling_mask", "top_k", "top_p", "min_p")  # compared one by one: a difference is named


def summary(g, b, V_local, key, host, options, replay=(None,) * 4):
    """Inside the guard, last: what this rank brings to the one small collective (its slice size, the
    shapes `key`, a fingerprint of `host` (validate) and the `options` that shape the collectives, the
    tokens' digest; the sampler's `replay` arguments, REPLAY, each on its own). Nothing without a group."""
    if g.group is not None:
        g.batch, g.host = b, host
        options = (*options, *_draw_states(options, b.given["ids"].device))
        opts = digest.fingerprint_field((host, vocab_block.VOCAB_BLOCK, *options))  # (the merge: by blocks or not)
        g.fields = [V_local, *key, *(0,) * (KEY - len(key)), opts,
                    *digest.input_digests(b), *(digest.fingerprint_field((x,)) for x in replay), *digest.token_fields(b)]


def _draw_states(options, device):
    """clip_cov's generator state for each config among the options (nested in tuples too): every rank must
    draw the same numbers (verl_modes.draw_state)."""
    for o in options:
        if isinstance(o, GTPOConfig):
            yield verl_modes.draw_state(o, device)
        elif isinstance(o, (tuple, list)):
            yield from _draw_states(o, device)


WIDTH = 1 + KEY + 4 + len(digest.INPUTS) + len(REPLAY)  # the agreement's fields: 28 int64 with the flag and key


def vocab_layout(g, device, where, row=None):
    """The one small collective, before any other (spec 12): every rank's error flag, slice size,
    shapes, options and tokens -> VocabParallel (this slice's first id, the whole vocabulary's size, the
    largest slice). A rank that failed its checks, ranks that disagree, or (validating) counted ids
    outside the whole vocabulary: every rank raises the same error (none is left waiting). row: this rank's
    row, formed already (Pending)."""
    rows = agree.agree(g, WIDTH, device, where, row)
    sizes = [row[0] for row in rows]
    agree.disagree(where, [tuple(row[1:1 + KEY]) for row in rows], "the shapes of the per-token inputs "
                   "(tokens, logits rows, logits_start or D, packed)", "every rank must pass the same tokens, "
                   "with its own slice of the vocabulary")
    agree.disagree(where, [row[1 + KEY] for row in rows], "the options (compared by value: dtype, backend, "
                   "validate, the config; the head's schedule and memory_budget; clip_cov's random generator's "
                   "state; gtpo_kernels.VOCAB_BLOCK)", "pass the same options on every rank (clip_cov: seed its "
                   "generator alike on every rank; GTPO_VOCAB_BLOCK: the same environment on every rank)")
    V = sum(sizes)
    out = [r for r, row in enumerate(rows) if row[-1] >= V]
    if g.host and out:  # (validate is the same on every rank: in the options)
        cause = None
        try:
            checks.check_ids_in_range(g.batch.ids, g.batch.counted, V)
        except ValueError as e:
            cause = e
        raise ValueError(f"{where}: completion_ids must lie in [0, V) = [0, {V}) at counted positions (V: the "
                         f"whole vocabulary over the group); rank(s) {out} hold counted ids up to "
                         f"{[rows[r][-1] for r in out]}; every rank raises this error") from cause
    agree.disagree(where, [tuple(row[-3:-1]) for row in rows], "the counted tokens (their number, a checksum "
                   "of completion_ids and completion_mask)", "every rank must pass the same "
                   "tokens (its own slice of the vocabulary)")
    for i, name in enumerate(digest.INPUTS):  # compared by value (spec 12)
        agree.disagree(where, [row[2 + KEY + i] for row in rows], name, "every rank of a vocabulary-parallel "
                       "group holds the same tokens and must pass the same per-token and per-completion inputs")
    for i, name in enumerate(REPLAY):  # the sampler's kept sets and rules (spec 13), by value
        agree.disagree(where, [row[2 + KEY + len(digest.INPUTS) + i] for row in rows], name,
                       "every rank replays the same kept sets: pass the same sampling_mask / top_k / top_p / min_p")
    rank = dist.get_rank(g.group)
    return VocabParallel(g.group, sum(sizes[:rank]), V, max(sizes), tuple(int(x) for x in sizes))


class Pending:
    """A call's agreement before its first launch (spec 8): the row with its constants (`plan`: agree.row_to_fold's
    (row, program), or None where it cannot fold), formed by the launch of this slice's forward pass
    (vp_first_triton, in vp_sums), then made (`made`: vocab_layout, the same collective and host read) -> `vp`."""

    def __init__(self, g, device, where):
        self.g, self.device, self.where, self.group, self.vp = g, device, where, g.group, None
        self.plan = agree.row_to_fold(g, WIDTH, device)

    def made(self, row=None):
        self.vp = vocab_layout(self.g, self.device, self.where, row)
        return self.vp


def local_ids(ids, vocab_start):
    """Global ids -> this slice's ids (outside [0, V_local) where another rank owns the id)."""
    return ids.long() - vocab_start


def block_bytes_per_token(itemsize=4):
    """Bytes per token the block merge (vp_blocks) brings to a rank, at most: the statistics from the rank
    before it and the last rank's, 4 numbers each (float32; itemsize 8: float64 logits, torch backend)."""
    return 2 * 4 * itemsize


def vp_forward(b, ids_loc, temperature, backend, group, V_global, scale=1.0, softcap=None, sizes=None, id_start=0,
               nan_flagged=False, outs=None, rows=None):
    """The forward pass on this rank's slice, merged over the group -> (logp, H, stats, flags) per
    token as ops.vocab_fwd returns them for the whole vocabulary (flags from the merged statistics).
    scale, softcap: the tile's transforms (spec 11), applied by the kernel to this slice; temperature: a
    tensor, or a number (by value on the Triton backend). sizes: every
    rank's slice size; when every boundary is a multiple of VOCAB_BLOCK the blocks' statistics are
    gathered and merged in global block order (vp_blocks: bitwise the single-process outputs), else
    (or None) the 32-byte all-reduce merge below. id_start: ids_loc - id_start are this slice's ids (the
    kernels subtract it as they read an id: no launch for the slice's ids). nan_flagged: logp and H NaN at a
    flagged counted token (the finish kernel writes them so). outs: the four outputs written into these
    tensors (the finish kernel's own stores on the Triton backend), which are returned. rows (the Triton
    backend's all-reduce merge; with outs): the token of each row of b.logits3 = (1, rows, V_local), the LM
    head's tile: ids_loc, b.ids, a per-token temperature and `outs` are the call's, read and written at
    them by the kernels (no gather or scatter around them)."""
    if rows is not None and (backend != "triton" or outs is None or (sizes is not None and vocab_block.aligned(sizes))):
        raise ValueError("rows: the Triton backend's all-reduce merge only, written into the call's `outs`")
    if sizes is not None and vocab_block.aligned(sizes):
        res = vp_blocks(b, ids_loc, temperature, backend, group, V_global, sizes, scale, softcap, id_start)
        res = (*nan_at_flags(*res[:2], res[3]), *res[2:]) if nan_flagged else res
        return res if outs is None else _into(outs, res)
    backend = dispatch.resolve_backend(backend, b.logits3.device, b.logits3.dtype)
    vec, M = vp_sums(b, ids_loc, temperature, backend, group, scale, softcap, id_start, rows)
    if backend == "triton":
        return vp_merge.select(backend).finish(vec, M, b.ids, _counted(b, backend), V_global, nan_flagged, outs,
                                               **({} if rows is None else dict(rows=rows)))
    res = vp_merge.finish(vec, M, b.ids, _counted(b, backend), V_global, nan_flagged)
    return res if outs is None else _into(outs, res)


def _into(outs, res):
    """res copied into outs (the same shapes) -> outs."""
    for out, x in zip(outs, res):
        out.copy_(x)
    return tuple(outs)


def vp_sums(b, ids_loc, temperature, backend, group, scale=1.0, softcap=None, id_start=0, rows=None, tau_seq=0,
            pending=None, conflicts=None):
    """vp_forward's all-reduce merge up to its finish (the epilogue kernel may finish it itself): the merged
    sums (n, 7) and the global row maxima (n,), the same on every rank (backend resolved). rows: vp_forward's
    (n = its length). tau_seq (the Triton backend): temperature holds one tau per completion, read at each
    token's row (1, padded) or found in the cu_seqlens given (2, packed). pending (a Pending with a plan; the
    Triton backend, no rows, no transform): this slice's pass and the agreement's row in one launch, then the
    agreement (group, id_start: its); None where its layout merges by blocks (this slice's pass was spent).
    conflicts (the Triton backend): the call's deferred conflict weights (conflict_triton.Deferred), run by the
    sums' launch (no launch of their own)."""
    merge, counted = vp_merge.select(backend), _counted(b, backend)  # (Triton: the sums' and finish's launches)
    cu = b.given["cu_seqlens"] if tau_seq == 2 else None
    # on the Triton backend the forward kernel stores the slice's maximum too (vp_merge.local_max's values)
    n = ids_loc.numel() if rows is None else rows.numel()
    M = torch.empty(n, dtype=torch.float32, device=b.logits3.device) if backend == "triton" else None
    tau = ops.tau_arg(temperature, b.logits3, backend)
    if pending is not None:
        from ..kernels.vp_first_triton import vp_first
        try:
            logp_r, ent_r, stats_r, bad_r = vp_first(b.logits3.detach(), counted, tau, b.logits_start, M,
                                                     *pending.plan, tau_seq, cu)
        except Exception as e:  # noqa: BLE001 - held as this rank's failure: the agreement raises on every rank
            pending.g.error = e
            pending.made()
        vp = pending.made(pending.plan[0])  # (every rank raises here alike if the ranks disagree)
        if vp.blockwise:
            return None
        group, id_start = vp.group, vp.start
    elif rows is None:
        logp_r, ent_r, stats_r, bad_r = dispatch.vocab_fwd(backend, b.logits3.detach(), ids_loc.reshape(-1), counted,
                                                           tau, b.logits_start, scale, softcap, id_start, M, tau_seq,
                                                           cu)
    else:  # the tile's own statistics, each row's id, mask and tau read at its token
        from ..kernels import vocab_triton
        dispatch.check_transforms(scale, softcap)
        logp_r, ent_r, stats_r, bad_r = vocab_triton.vocab_fwd(
            b.logits3.detach(), ids_loc.reshape(-1), counted, tau, b.logits_start, scale, softcap, rows=rows,
            local_max=M, id_start=id_start, out_at_row=True)
    if M is None:
        M = merge.local_max(stats_r, ent_r, bad_r, b.V)
    dist.all_reduce(M, op=dist.ReduceOp.MAX, group=group)
    target = backend == "triton" and rows is None and scale == 1.0 and softcap is None  # (the owner reads z_y)
    vec = merge.local_sums(logp_r, ent_r, stats_r, bad_r, ids_loc, counted, M, temperature, b.V, id_start,
                           **({} if rows is None else dict(rows=rows)),
                           **({} if not tau_seq else dict(cu=cu) if cu is not None else
                              dict(row_length=b.tok_shape[1])),
                           **(dict(target=(b.logits3.detach(), b.logits_start)) if target else {}),
                           **({} if conflicts is None else dict(conflicts=conflicts)))
    dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=group)
    return vec, M


def _counted(b, backend):
    """Which tokens count, as the passes read it: on the Triton backend the caller's mask as given (any
    dtype, nonzero counts; the kernels read it at stride 1: a strided view is copied, no launch otherwise)
    or None (every token); else the Batch's bool `counted`."""
    if backend != "triton":
        return b.counted
    return None if b.mask is None else b.mask.contiguous()


def vp_blocks(b, ids_loc, temperature, backend, group, V_global, sizes, scale=1.0, softcap=None, id_start=0):
    """The block merge (spec 14), for slices whose boundaries are all multiples of VOCAB_BLOCK: the row
    statistics travel from rank to rank in rank order (= global block order) and each folds its own
    blocks into them with the single-process pass's own merge (dispatch.vocab_merge); the last rank's
    are broadcast and every rank finishes them -> bitwise the single-process outputs, on every rank,
    whatever the number of ranks. A message is 4 numbers per token (m, r, u and the owner's target
    logit; a non-finite slice marks r = -1): a rank receives at most 2 of them, block_bytes_per_token."""
    backend = dispatch.resolve_backend(backend, b.logits3.device, b.logits3.dtype)
    tau, counted = ops.tau_arg(temperature, b.logits3, backend), _counted(b, backend)
    blocks, zy, nonfinite = dispatch.vocab_blocks(backend, b.logits3.detach(), ids_loc, counted, tau,
                                                  b.logits_start, V_global, scale, softcap, id_start)
    n, acc, dev = blocks.shape[0], blocks.dtype, blocks.device
    W, r = dist.get_world_size(group), dist.get_rank(group)
    ids = b.ids.long()
    start = sum(sizes[:r])
    msg = torch.empty((n, 4), dtype=acc, device=dev)
    state, z_y, bad = None, torch.full((n,), float("nan"), dtype=acc, device=dev), nonfinite
    if r > 0:  # the statistics of every block before this rank's
        dist.recv(msg, src=dist.get_global_rank(group, r - 1), group=group)
        state, z_y, bad = _unpack(msg, bad)
    state = dispatch.vocab_merge(backend, blocks, zy, bad, b.ids, counted, tau, V_global, state=state, fold=True)
    z_y = torch.where((ids >= start) & (ids < start + sizes[r]), zy, z_y)  # the owner's bits, selected
    msg = torch.cat([state[:, :1], torch.where(bad, -1.0, state[:, 1])[:, None], state[:, 2:], z_y[:, None]], 1)
    if r < W - 1:
        dist.send(msg, dst=dist.get_global_rank(group, r + 1), group=group)
    if W > 1:
        dist.broadcast(msg, src=dist.get_global_rank(group, W - 1), group=group)
    state, z_y, bad = _unpack(msg, nonfinite)
    return dispatch.vocab_merge(backend, blocks[:, :0], z_y, bad, b.ids, counted, tau, V_global, state=state)


def _unpack(msg, bad):
    """A message's (state (n, 3), z_y, non-finite: marked by r = -1 (r = S - 1 >= 0 otherwise), or `bad`)."""
    marked = msg[:, 1] < 0
    state = torch.stack([msg[:, 0], torch.where(marked, 0.0, msg[:, 1]), msg[:, 2]], 1)
    return state, msg[:, 3], marked | bad


def unwrap_dtensor(logits, process_group, in_order=True):
    """A DTensor sharded on its last dimension -> (its local shard, the mesh dimension's group); in_order: its
    shard must be this rank's place in the group (a rank's own check: run it inside the agreement's guard)."""
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # pragma: no cover - old torch
        return logits, process_group
    if not isinstance(logits, DTensor):
        return logits, process_group
    dims = [i for i, p in enumerate(logits.placements) if isinstance(p, Shard) and p.dim in (-1, logits.dim() - 1)]
    if len(dims) != 1 or any(not p.is_replicate() for i, p in enumerate(logits.placements) if i != dims[0]):
        raise ValueError(f"logits: a DTensor must be sharded on its vocabulary (last) dimension and replicated "
                         f"elsewhere (placements [Shard(-1)]), got {logits.placements}")
    group = logits.device_mesh.get_group(dims[0])
    if process_group is not None and process_group is not group:
        raise ValueError("logits is a DTensor: its mesh gives the process group; do not pass another one")
    at = logits.device_mesh.get_coordinate()[dims[0]]  # the shard's place: slices are laid out in group rank order
    if in_order and at != dist.get_rank(group):
        raise ValueError(f"logits: a DTensor whose mesh lists its group's ranks out of order (this rank, "
                         f"{dist.get_rank(group)} in the group, holds shard {at}) is not supported; build the mesh "
                         "in rank order")
    return logits.to_local(), group


class VocabParallel:
    """This rank's place in the vocabulary: the group, the slice's first id, the whole vocabulary's size,
    the largest slice (tiles are sized by it, so that every rank makes the same tiles), every rank's
    slice size (rank order; `blockwise`: every boundary at a multiple of VOCAB_BLOCK); `ids` (this
    slice's ids of the batch) is set once the batch is prepared."""

    def __init__(self, group, start, V, V_max, sizes=None):
        self.group, self.start, self.V, self.V_max, self.ids = group, start, V, V_max, None
        self.sizes = sizes
        self.blockwise = sizes is not None and vocab_block.aligned(sizes)
