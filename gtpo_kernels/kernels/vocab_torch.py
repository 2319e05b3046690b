"""The vocabulary passes in plain PyTorch, a fixed number of rows at a time (the CPU path).

Same contract as `vocab_triton.vocab_fwd` / `vocab_bwd` and the same memory behaviour: only a
chunk of rows is ever upcast to float32, the forward keeps O(1) statistics per token, and the backward
recomputes the softmax from them, writing each chunk of the gradient in place.
"""
from __future__ import annotations

import torch

from ..core.flags import BAD_ID, BAD_NONFINITE, BAD_TARGET_NEG_INF, tau_or_nan
from ..core.layout import float_dtype_for
from ..core.vocab_block import VOCAB_BLOCK, n_blocks

# float32 elements upcast at a time (16 MiB): the chunk of rows is CHUNK_ELEMENTS // V rows.
CHUNK_ELEMENTS = 1 << 22


def _rows_per_chunk(V: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(V, 1))


# log p below this is exp-underflow (0) in float32 and float64 alike; clamping -inf there keeps every
# product with p = 0 finite
_LOG_ZERO = -1e4


def _transform(z, scale, softcap):
    """z' of a chunk of raw logits in the accumulation dtype, in place: z * scale, then
    softcap * tanh(z' / softcap) (spec 11; the kernels' vocab_jit does the same in registers)."""
    if scale != 1.0:
        z.mul_(scale)
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    return z


def _transform_grad(z, scale, softcap):
    """(z', dz'/dz) of a chunk of raw logits z (z' in place on z). dz'/dz = scale (1 - tanh^2(x)) with
    x = z * scale / softcap is formed as scale * 4 e / (1 + e)^2, e = exp(-2 |x|), from the raw x: exact
    where the cap saturates (1 - th * th from the rounded th = tanh(x) is 0 there, or a few ulps of 1)."""
    if softcap is None:
        return _transform(z, scale, None), scale
    if scale != 1.0:
        z.mul_(scale)
    x = z.div_(softcap)
    e = torch.exp(x.abs().mul(-2.0))
    dz = e.div(e.add(1.0)).div_(e.add_(1.0)).mul_(4.0 * scale)
    del e
    return x.tanh_().mul_(softcap), dz


def _inv_tau(temperature, idx, dtype):
    """1 / tau as a (rows, 1) column for the token rows `idx`: one value (a number or a one-element
    tensor, NaN unless finite and > 0), or each row's own from a per-token (n,) tensor (loss.call_temperature's)."""
    if isinstance(temperature, torch.Tensor) and temperature.numel() > 1:
        return (1.0 / temperature[idx].to(dtype))[:, None]
    inv = 1.0 / tau_or_nan(temperature)
    return inv.reshape(1, 1).to(dtype) if isinstance(inv, torch.Tensor) else inv


_BIG = 1e30  # |a| clamp of the merge: exp(-BIG) = 0 and 0 * BIG = 0, where 0 * inf would be NaN


def _sentinel(dtype):
    """A block's maximum before it has a finite entry (-FLT_MAX, or float64's): finite, so that two of
    them differ by 0, never inf - inf."""
    return torch.finfo(dtype).min


def _column(inv_t, shape):
    """1 / tau as the rows take it: a number as it is, a one-element tensor as a scalar, else per row."""
    if not isinstance(inv_t, torch.Tensor):
        return inv_t
    return inv_t.reshape(()) if inv_t.numel() == 1 else inv_t.reshape(shape)


def _stats_of(zb, inv_t):
    """(rows, k, w) blocks of transformed logits (consumed) -> their (rows, k, 3) statistics."""
    mx, top = zb.max(-1, keepdim=True)
    empty = mx == float("-inf")
    mx = torch.where(empty, torch.zeros_like(mx), mx)
    # d = (z - m_b) / tau: the difference first, so its accuracy does not depend on |z / tau|
    d = zb.sub_(mx).mul_(inv_t).clamp_(min=_LOG_ZERO)
    ex = torch.exp(d)
    # R_b = S_b without one instance of the block's maximum
    ex.scatter_(2, top, 0.0)
    r = ex.sum(-1)
    ex.scatter_(2, top, 1.0)
    u = d.mul_(ex).sum(-1)
    empty = empty.squeeze(2)
    zero = torch.zeros((), dtype=zb.dtype, device=zb.device)
    m_b = torch.where(empty, torch.full_like(r, _sentinel(zb.dtype)), mx.squeeze(2))
    return torch.stack([m_b, torch.where(empty, zero, r), torch.where(empty, zero, u)], 2)


def block_stats(z, inv_t):
    """The statistics of each block of VOCAB_BLOCK entries of the rows z (rows, V), the transformed logits
    in the accumulation dtype (consumed): (rows, n_blocks(V), 3) = (m_b, r_b = S_b - 1, u_b = sum e^d d)
    relative to the block's own maximum m_b (d = (z - m_b) / tau); a block with no finite entry has
    m_b = the sentinel, r_b = u_b = 0. inv_t: 1 / tau, a number or a (rows, 1) column. Each block is
    reduced on its own (the whole blocks as one (rows, k, VOCAB_BLOCK) view, the partial last one apart),
    so its bits depend only on its entries, never on the row or slice it sits in."""
    rows, V = z.shape
    full = V // VOCAB_BLOCK
    inv_t = _column(inv_t, (rows, 1, 1))
    parts = []
    if full:
        parts.append(_stats_of(z[:, :full * VOCAB_BLOCK].view(rows, full, VOCAB_BLOCK), inv_t))
    if full * VOCAB_BLOCK < V:
        parts.append(_stats_of(z[:, full * VOCAB_BLOCK:].unsqueeze(1), inv_t))
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def merge_blocks(blocks, inv_t, state=None):
    """The rows' statistics (m, r = S - 1, u = sum e^d d) from their blocks' (rows, NB, 3), folded in
    block order: with a = |m_b - m| / tau and x = exp(-a), a block above the row (m_b > m) gives
    r = x (r + 1) + r_b, u = x (u - (r + 1) a) + u_b, any other r = r + x (r_b + 1),
    u = u + x (u_b - (r_b + 1) a). Sums of non-negative terms (u: non-positive), nothing cancels. The one
    merge of the single-process path and of the vocabulary-parallel one (elementwise: each row's bits do
    not depend on the others). inv_t: a number or a (rows, 1) column. state: (m, r, u) the earlier blocks
    were folded into (None: the empty row)."""
    rows, nb = blocks.shape[0], blocks.shape[1]
    inv_t = _column(inv_t, (rows,))
    none = _sentinel(blocks.dtype)  # the maximum of a side without a finite entry
    if state is None:
        m, r, u = blocks.new_full((rows,), none), blocks.new_zeros(rows), blocks.new_zeros(rows)
    else:
        m, r, u = state
    for b in range(nb):
        m_b, r_b, u_b = blocks[:, b, 0], blocks[:, b, 1], blocks[:, b, 2]
        a = ((m_b - m) * inv_t).abs().clamp(max=_BIG)  # NaN stays NaN
        x = torch.exp(-a)
        grew = m_b > m
        r_keep, u_keep = torch.where(grew, r_b, r), torch.where(grew, u_b, u)
        # a side without a finite entry (the start, an all -inf block) moves no mass, whatever x (a huge tau)
        s_move = torch.where(grew, r + (m != none), r_b + (m_b != none))
        u_move = torch.where(grew, u, u_b)
        r = r_keep + x * s_move
        u = u_keep + x * (u_move - s_move * a)
        m = torch.maximum(m, m_b)
    return m, r, u


def finish(m, r, u, z_y, inv_t):
    """Per row from the merged statistics and the transformed target logit z_y (NaN where the id is
    invalid): logp, H, stats (m, log S, q). inv_t: a number or a (rows, 1) column."""
    inv_t = _column(inv_t, m.shape)
    empty = m == _sentinel(m.dtype)  # every entry -inf: S = 0 (a vocabulary slice may be all banned)
    r = torch.where(empty, torch.full_like(r, -1.0), r)
    mx = torch.where(empty, torch.zeros_like(m), m)
    s_tot = 1.0 + r
    log_s = torch.log1p(r)
    # H = log S - U / S with U = sum e^d d <= 0 (no cancellation)
    ent = log_s - u / s_tot
    logp = (z_y - mx) * inv_t - log_s
    # q = 1 - p_y is R / S when y holds the maximum (exact for a confident token), else 1 - p_y
    # with p_y < 1/2
    top_y = z_y == mx
    q = torch.where(top_y, r / s_tot, -torch.expm1(torch.where(top_y, 0.0, logp)))
    return logp, ent, torch.stack([mx, log_s, q], 1)


def _target(z, y, V, acc):
    """(z_y where the id lies in [0, V), else NaN; whether it does)."""
    y_ok = (y >= 0) & (y < V)
    yc = y.clamp(0, max(V - 1, 0))[:, None]
    nan = torch.full((), float("nan"), dtype=acc, device=z.device)
    return torch.where(y_ok, z.gather(1, yc).squeeze(1) if V else nan, nan), y_ok


def nonfinite_rows(z):
    return (torch.isnan(z) | (z == float("inf"))).any(-1)


def row_flags(nonfinite, z_y):
    """Flags (core/flags) of rows with NaN or +inf (`nonfinite`: nonfinite_rows's) and target logits z_y (-inf)."""
    return nonfinite.to(torch.int8) * BAD_NONFINITE | (z_y == float("-inf")).to(torch.int8) * BAD_TARGET_NEG_INF


def _slice_ids(ids, id_start):
    """ids - id_start: the targets in a slice of the vocabulary whose first entry is id_start."""
    return ids if not id_start else ids.long() - id_start


def vocab_fwd(logits3, ids, counted, temperature, logits_start, scale=1.0, softcap=None, id_start=0):
    """Same contract as vocab_triton.vocab_fwd: logp, entropy, stats (m, log S, q), flags of the
    transformed logits z' (scale, softcap). Each row's blocks of VOCAB_BLOCK entries are reduced on their
    own and merged in order (block_stats, merge_blocks), as the vocabulary-parallel path merges them."""
    ids = _slice_ids(ids, id_start)
    B, T_l, V = logits3.shape
    n = ids.numel()
    T = n // B if B else 0
    dev = logits3.device
    acc = float_dtype_for(logits3)  # float32 accumulation, float64 for float64 logits
    logp = torch.zeros(n, device=dev, dtype=acc)
    ent = torch.zeros_like(logp)
    stats = torch.zeros((n, 3), device=dev, dtype=acc)
    bad = torch.zeros(n, device=dev, dtype=torch.int8)
    for idx, inv_t, z in _chunks(logits3, counted, T, logits_start, temperature, scale, softcap, acc):
        z_y, y_ok = _target(z, ids[idx].long(), V, acc)
        flag = row_flags(nonfinite_rows(z), z_y)
        flag |= (~y_ok).to(torch.int8) * BAD_ID
        m, r, u = merge_blocks(block_stats(z, inv_t), inv_t)
        flag |= torch.isnan(r).to(torch.int8) * BAD_NONFINITE  # (a NaN 1 / tau too, as the Triton kernel flags it)
        del z
        logp[idx], ent[idx], stats[idx], bad[idx] = *finish(m, r, u, z_y, inv_t), flag
    return logp, ent, stats, bad


def _chunks(logits3, counted, T, logits_start, temperature, scale, softcap, acc):
    """The counted rows a chunk at a time (masked-out rows are never read): (their flat indices, 1 / tau,
    the chunk's transformed logits in the accumulation dtype: one chunk, and one more for the exponentials
    while it is reduced)."""
    rows_idx = counted.nonzero().squeeze(1)
    V = logits3.shape[-1]
    if V == 0:
        return
    bi, ti = rows_idx // T, rows_idx % T + logits_start
    step = _rows_per_chunk(V)
    for k in range(0, rows_idx.numel(), step):
        sl = slice(k, k + step)
        idx = rows_idx[sl]
        yield idx, _inv_tau(temperature, idx, acc), _transform(logits3[bi[sl], ti[sl]].to(acc), scale, softcap)


def vocab_blocks(logits3, ids, counted, temperature, logits_start, scale=1.0, softcap=None, id_start=0):
    """A vocabulary slice's per-block statistics (spec 14): (n, n_blocks(V), 3) as block_stats gives them,
    the transformed target logit z'_y (n,) where the (local) id lies in the slice (NaN elsewhere), and
    whether the token's slice holds a NaN or +inf (n,) bool. Uncounted tokens: zeros."""
    ids = _slice_ids(ids, id_start)
    B, T_l, V = logits3.shape
    n = ids.numel()
    T = n // B if B else 0
    dev = logits3.device
    acc = float_dtype_for(logits3)
    nb = n_blocks(V)
    blocks = torch.zeros((n, nb, 3), device=dev, dtype=acc)
    zy = torch.full((n,), float("nan"), device=dev, dtype=acc)
    nonfinite = torch.zeros(n, device=dev, dtype=torch.bool)
    for idx, inv_t, z in _chunks(logits3, counted, T, logits_start, temperature, scale, softcap, acc):
        zy[idx] = _target(z, ids[idx].long(), V, acc)[0]
        nonfinite[idx] = nonfinite_rows(z)
        blocks[idx] = block_stats(z, inv_t)
        del z
    return blocks, zy, nonfinite


def vocab_merge(blocks, zy, nonfinite, ids, counted, temperature, V_whole, state=None, fold=False):
    """The vocabulary-parallel merge: blocks (n, NB, 3) of consecutive ranks in global block order, the
    owner's z'_y, whether any slice is non-finite -> logp, entropy, stats, flags as vocab_fwd gives them for
    the whole vocabulary (the same merge_blocks and finish). ids: global ids. state: (n, 3) row statistics
    the earlier blocks were folded into (None: the empty row); fold: only fold the blocks into them and
    return the (n, 3) statistics."""
    n = ids.numel()
    acc = blocks.dtype
    logp = torch.zeros(n, device=blocks.device, dtype=acc)
    ent = torch.zeros_like(logp)
    stats = torch.zeros((n, 3), device=blocks.device, dtype=acc)
    bad = torch.zeros(n, device=blocks.device, dtype=torch.int8)
    idx = counted.nonzero().squeeze(1)
    folded = None if state is None else state.clone()
    if idx.numel() == 0:
        return (folded if folded is not None else stats) if fold else (logp, ent, stats, bad)
    inv_t = _inv_tau(temperature, idx, acc)
    y = ids[idx].long()
    z_y = zy[idx]
    m, r, u = merge_blocks(blocks[idx], inv_t, None if state is None else state[idx].unbind(1))
    if fold:
        out = stats if folded is None else folded
        out[idx] = torch.stack([m, r, u], 1)
        return out
    c_logp, c_ent, c_stats = finish(m, r, u, z_y, inv_t)
    flag = row_flags(nonfinite[idx], z_y)
    flag |= ((y < 0) | (y >= V_whole)).to(torch.int8) * BAD_ID
    logp[idx], ent[idx], stats[idx], bad[idx] = c_logp, c_ent, c_stats, flag
    return logp, ent, stats, bad


def vocab_bwd(logits3, grad3, ids, stats, ent, c, e, temperature, logits_start, scale=1.0, softcap=None, id_start=0):
    """Same contract as vocab_triton.vocab_bwd: dL/dz of the raw logits, through the transforms."""
    ids = _slice_ids(ids, id_start)
    B, T_l, V = logits3.shape
    n = ids.numel()
    T = n // B if B else 0
    # rows outside the completion window, and rows with no gradient, are zeros
    active = c != 0
    if e is not None:
        active = active | (e != 0)
    if grad3.data_ptr() != logits3.data_ptr():
        grad3.zero_()
        zero_rows = None
    else:  # in place: zero what is outside the window and the inactive rows (after reading)
        grad3[:, :logits_start].zero_()
        grad3[:, logits_start + T:].zero_()
        zero_rows = (~active).nonzero().squeeze(1)
    rows_idx = active.nonzero().squeeze(1)
    step = _rows_per_chunk(V)
    for k in range(0, rows_idx.numel(), step):
        idx = rows_idx[k:k + step]
        inv_t = _inv_tau(temperature, idx, stats.dtype)
        bi, ti = idx // T, idx % T + logits_start
        yc = ids[idx].long().clamp(0, V - 1)[:, None]  # an invalid id has c = NaN: a NaN row
        cc = c[idx, None]
        st = stats[idx]
        # log p = (z - m) / tau - log S (clamped where p = 0), p = exp(log p): two chunks, in place
        logq, dz = _transform_grad(logits3[bi, ti].to(stats.dtype), scale, softcap)
        logq.sub_(st[:, 0:1]).mul_(inv_t).sub_(st[:, 1:2]).clamp_(min=_LOG_ZERO)
        p = torch.exp(logq)
        q = st[:, 2:3]
        # g_v = -p_v (c + e (log p_v + H)) for v != y;  g_y = c q - e p_y (log p_y + H)
        if e is not None:
            ee = e[idx, None]
            t = logq.add_(ent[idx, None]).mul_(ee)
            g_y = cc * q - p.gather(1, yc) * t.gather(1, yc)
            g = p.mul_(t.add_(cc)).neg_()
        else:
            g_y = cc * q
            g = p.mul_(-cc)
        # the target entry, where the id lies in this vocabulary (a slice of it under process_group)
        y_ok = (ids[idx] >= 0) & (ids[idx] < V)
        g.scatter_(1, yc, torch.where(y_ok[:, None], g_y, g.gather(1, yc)))
        g.mul_(inv_t)
        if softcap is not None or scale != 1.0:  # the chain rule through the transforms
            g.mul_(dz)
        grad3[bi, ti] = g.to(grad3.dtype)
        del logq, p, g, dz
    if zero_rows is not None and zero_rows.numel():
        grad3[zero_rows // T, zero_rows % T + logits_start] = 0
    return grad3
