"""Vocabulary-parallel logits over torch.distributed (spec 12).

Rank r of the process group holds the r-th contiguous slice of the vocabulary (sizes may differ; ids
are global). Each rank runs the forward pass on its slice with its local ids (a token whose id lies
elsewhere is simply not its target), and the per-slice statistics are merged exactly:

    M = max_r m_r                                  (all-reduce MAX, 4 bytes per token)
    w_r = exp((m_r - M) / tau),  S = sum_r w_r S_r,  U = sum_r w_r (U_r + S_r (m_r - M) / tau)
    R = S - 1 summed without cancellation: the slices at the maximum add R_r, the others w_r S_r, plus
        (number of slices at the maximum - 1)
    (z_y - M) / tau from the slice that owns y;  whether y sits at the global maximum;  non-finite flags
                                                   (all-reduce SUM of 7 numbers, 28 bytes per token)

then log S = log1p(R), H = log S - U / S, logp = (z_y - M) / tau - log S and q = 1 - p_y exactly as on
one device: 32 bytes per token in all. When every slice starts at a multiple of VOCAB_BLOCK (spec 14) the
row statistics instead travel from rank to rank, each folding its blocks in global block order with the
single-process pass's own merge (vp_blocks): bitwise the single-process outputs, 32 bytes per token too.
Every rank ends with the same per-token statistics, so the loss, the outputs and the metrics are
identical on every rank; the backward pass runs on each slice with them and communicates nothing (each rank's gradient is its slice of the single-process gradient).

Before any of that, `vocab_layout` makes the one small collective (agree.py): every rank's error flag,
slice size, shapes, options and a digest of its tokens, so that a rank that failed its checks, ranks
that disagree, or ids outside the whole vocabulary make every rank raise the same error.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..core.flags import BAD_ID, BAD_NONFINITE, BAD_TARGET_NEG_INF
from ..core import checks, vocab_block
from ..kernels import dispatch, ops
from . import agree

BYTES_PER_TOKEN = 4 + 7 * 4  # the two all-reduces of vp_forward (float32 statistics)
KEY = 8  # the shapes a rank brings to the agreement, padded to this many int64


REPLAY = ("sampling_mask", "top_k", "top_p", "min_p")  # compared one by one: a difference is named


def summary(g, b, V_local, key, host, options, replay=(None,) * 4):
    """Inside the guard, last: what this rank brings to the one small collective (its slice size, the
    shapes `key`, a fingerprint of `host` (validate) and the `options` that shape the collectives, the
    tokens' digest; the sampler's `replay` arguments, REPLAY, each on its own). Nothing without a group."""
    if g.group is not None:
        g.batch, g.host = b, host
        g.fields = [V_local, *key, *(0,) * (KEY - len(key)), agree.fingerprint((host, *options)),
                    *agree.input_digests(b), *(agree.fingerprint((x,)) for x in replay), *agree.token_digest(b)]


def vocab_layout(g, device, where):
    """The one small collective, before any other (spec 12): every rank's error flag, slice size,
    shapes, options and tokens -> VocabParallel (this slice's first id, the whole vocabulary's size, the
    largest slice). A rank that failed its checks, ranks that disagree, or (validating) counted ids
    outside the whole vocabulary: every rank raises the same error (none is left waiting)."""
    rows = agree.agree(g, 1 + KEY + 4 + len(agree.INPUTS) + len(REPLAY), device, where)  # 27 int64 with the flag
    sizes = [row[0] for row in rows]
    agree.disagree(where, [tuple(row[1:1 + KEY]) for row in rows], "the shapes of the per-token inputs "
                   "(tokens, logits rows, logits_start or D, packed)", "every rank must pass the same tokens, "
                   "with its own slice of the vocabulary")
    agree.disagree(where, [row[1 + KEY] for row in rows], "the options (compared by value: dtype, backend, "
                   "validate, the config; the head's schedule and memory_budget)", "pass the same options on "
                   "every rank")
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
                   "of completion_ids, completion_mask and cu_seqlens)", "every rank must pass the same "
                   "tokens (its own slice of the vocabulary)")
    for i, name in enumerate(agree.INPUTS):  # compared by value (spec 12)
        agree.disagree(where, [row[2 + KEY + i] for row in rows], name, "every rank of a vocabulary-parallel "
                       "group holds the same tokens and must pass the same per-token and per-completion inputs")
    for i, name in enumerate(REPLAY):  # the sampler's kept sets and rules (spec 13), by value
        agree.disagree(where, [row[2 + KEY + len(agree.INPUTS) + i] for row in rows], name,
                       "every rank replays the same kept sets: pass the same sampling_mask / top_k / top_p / min_p")
    rank = dist.get_rank(g.group)
    return VocabParallel(g.group, sum(sizes[:rank]), V, max(sizes), tuple(int(x) for x in sizes))


def local_ids(ids, vocab_start):
    """Global ids -> this slice's ids (outside [0, V_local) where another rank owns the id)."""
    return ids.long() - vocab_start


def block_bytes_per_token(itemsize=4):
    """Bytes per token the block merge (vp_blocks) brings to a rank, at most: the statistics from the rank
    before it and the last rank's, 4 numbers each (float32; itemsize 8: float64 logits, torch backend)."""
    return 2 * 4 * itemsize


def vp_forward(b, ids_loc, temperature, backend, group, V_global, scale=1.0, softcap=None, sizes=None):
    """The forward pass on this rank's slice, merged over the group -> (logp, H, stats, flags) per
    token as ops.vocab_fwd returns them for the whole vocabulary (flags from the merged statistics).
    scale, softcap: the tile's transforms (spec 11), applied by the kernel to this slice. sizes: every
    rank's slice size; when every boundary is a multiple of VOCAB_BLOCK the blocks' statistics are
    gathered and merged in global block order (vp_blocks: bitwise the single-process outputs), else
    (or None) the 32-byte all-reduce merge below."""
    if sizes is not None and vocab_block.aligned(sizes):
        return vp_blocks(b, ids_loc, temperature, backend, group, V_global, sizes, scale, softcap)
    logp_r, ent_r, stats_r, bad_r = ops.vocab_fwd(b.logits3.detach(), ids_loc, b.counted,
                                                  ops.temperature_param(temperature, b.logits3, backend),
                                                  b.logits_start, scale, softcap, backend)
    inv_t = 1.0 / temperature  # a number or a 0-d tensor (no host read)
    ninf = torch.tensor(float("-inf"), dtype=stats_r.dtype, device=stats_r.device)
    m_r, ls_r = stats_r[:, 0], stats_r[:, 1]
    S_r = torch.exp(ls_r)
    nonfinite = ((bad_r & BAD_NONFINITE) != 0) | torch.isnan(ls_r) | torch.isnan(m_r)
    # a slice all at -inf (banned) adds nothing, nor does an empty slice (whatever its pass returns for it)
    live = (S_r > 0) & ~torch.isnan(ent_r) & ~nonfinite & (b.V > 0)
    m_eff = torch.where(live, m_r, ninf)
    M = m_eff.clone()
    dist.all_reduce(M, op=dist.ReduceOp.MAX, group=group)
    M_safe = torch.where(torch.isfinite(M), M, torch.zeros_like(M))
    zero = torch.zeros_like(S_r)
    delta = torch.where(live, (m_eff - M_safe) * inv_t, zero)
    w = torch.where(live, torch.exp(delta), zero)
    at_max = live & (m_eff == M)
    R_r = torch.expm1(ls_r)
    U_r = torch.where(live, (ls_r - ent_r) * S_r, zero)
    owned = b.counted & (ids_loc >= 0) & (ids_loc < b.V)
    t_r = logp_r + ls_r  # (z_y - m_r) / tau on the owner
    vec = torch.stack([
        torch.where(live, w * S_r, zero),                           # S
        torch.where(live, w * (U_r + S_r * delta), zero),           # U
        torch.where(at_max, R_r, torch.where(live, w * S_r, zero)),  # R, less (slices at the max - 1)
        torch.where(owned, t_r + delta, zero),                      # (z_y - M) / tau
        at_max.to(S_r.dtype),                                       # slices at the maximum
        (owned & at_max & (t_r == 0)).to(S_r.dtype),                # the target at the global maximum
        (nonfinite & b.counted).to(S_r.dtype),
    ], 1)
    dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=group)
    S, U, R = vec[:, 0], vec[:, 1], vec[:, 2] + (vec[:, 4] - 1).clamp(min=0)
    log_s = torch.log1p(R)
    ent = log_s - U / S
    logp = vec[:, 3] - log_s
    top = vec[:, 5] > 0
    q = torch.where(top, R / S, -torch.expm1(torch.where(top, torch.zeros_like(logp), logp)))
    ids = b.ids.long()
    bad = torch.where((vec[:, 6] > 0) | (M == float("inf")), BAD_NONFINITE, 0)
    bad = bad | torch.where(logp == float("-inf"), BAD_TARGET_NEG_INF, 0)
    bad = bad | torch.where((ids < 0) | (ids >= V_global), BAD_ID, 0)
    bad = torch.where(b.counted, bad, 0).to(torch.int8)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp, ent, q = (torch.where(b.counted, x, zero) for x in (logp, ent, q))
    return logp, ent, torch.stack([M_safe, torch.where(b.counted, log_s, zero), q], 1), bad


def vp_blocks(b, ids_loc, temperature, backend, group, V_global, sizes, scale=1.0, softcap=None):
    """The block merge (spec 14), for slices whose boundaries are all multiples of VOCAB_BLOCK: the row
    statistics travel from rank to rank in rank order (= global block order) and each folds its own
    blocks into them with the single-process pass's own merge (dispatch.vocab_merge); the last rank's
    are broadcast and every rank finishes them -> bitwise the single-process outputs, on every rank,
    whatever the number of ranks. A message is 4 numbers per token (m, r, u and the owner's target
    logit; a non-finite slice marks r = -1): a rank receives at most 2 of them, block_bytes_per_token."""
    backend = dispatch.resolve_backend(backend, b.logits3.device, b.logits3.dtype)
    tau = ops.temperature_param(temperature, b.logits3, backend)
    blocks, zy, nonfinite = dispatch.vocab_blocks(backend, b.logits3.detach(), ids_loc, b.counted, tau,
                                                  b.logits_start, V_global, scale, softcap)
    n, acc, dev = blocks.shape[0], blocks.dtype, blocks.device
    W, r = dist.get_world_size(group), dist.get_rank(group)
    ids = b.ids.long()
    start = sum(sizes[:r])
    msg = torch.empty((n, 4), dtype=acc, device=dev)
    state, z_y, bad = None, torch.full((n,), float("nan"), dtype=acc, device=dev), nonfinite
    if r > 0:  # the statistics of every block before this rank's
        dist.recv(msg, src=dist.get_global_rank(group, r - 1), group=group)
        state, z_y, bad = _unpack(msg, bad)
    state = dispatch.vocab_merge(backend, blocks, zy, bad, b.ids, b.counted, tau, V_global, state=state, fold=True)
    z_y = torch.where((ids >= start) & (ids < start + sizes[r]), zy, z_y)  # the owner's bits, selected
    msg = torch.cat([state[:, :1], torch.where(bad, -1.0, state[:, 1])[:, None], state[:, 2:], z_y[:, None]], 1)
    if r < W - 1:
        dist.send(msg, dst=dist.get_global_rank(group, r + 1), group=group)
    if W > 1:
        dist.broadcast(msg, src=dist.get_global_rank(group, W - 1), group=group)
    state, z_y, bad = _unpack(msg, nonfinite)
    return dispatch.vocab_merge(backend, blocks[:, :0], z_y, bad, b.ids, b.counted, tau, V_global, state=state)


def _unpack(msg, bad):
    """A message's (state (n, 3), z_y, non-finite: marked by r = -1 (r = S - 1 >= 0 otherwise), or `bad`)."""
    marked = msg[:, 1] < 0
    state = torch.stack([msg[:, 0], torch.where(marked, 0.0, msg[:, 1]), msg[:, 2]], 1)
    return state, msg[:, 3], marked | bad


def unwrap_dtensor(logits, process_group):
    """A DTensor sharded on its last dimension -> (its local shard, the mesh dimension's group)."""
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
