"""The gradient pass over the vocabulary (Triton); launched by vocab_triton.vocab_bwd.

Layout as in vocab_fwd_triton. z below is the transformed logit z' of vocab_jit, recomputed from the raw
tile; what is written is dL/dz of the raw z: dL/dz' times dz'/dz = scale (1 - tanh^2), in registers.

Backward (vector-Jacobian product). With p = softmax(s), log p_v = s_v - lse:
    d logp / dz_v = (1[v=y] - p_v) / tau
    d H / dz_v    = -p_v (log p_v + H) / tau
so for upstream coefficients c = dL/dlogp and e = dL/dH of the token (already multiplied by the
loss's incoming gradient), the kernel writes
    dL/dz_v = ( c (1[v=y] - p_v) - e p_v (log p_v + H) ) / tau
recomputing p from the saved (m, log S) as p_v = exp2((z_v - m) c2 - log2 S). The loop writes every entry
as if off the target, p_v (a + b log2 p_v) with a = -(c + e H) / tau and b = -e ln 2 / tau (b = 0 without
the entropy term), so it has no per-element compare with y; the target entry is written once after the
loop (behind a barrier, so it lands after the loop's store there), from the target logit read before the
loop (with inplace=True the gradient overwrites the logits) and 1 - p_y = q from the forward. Rows with
c = e = 0 (masked out, filtered, lambda = 0, or outside the completion window) are not read, only
written with zeros.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .vocab_jit import LN2, LOG2E, _inv_cap, _inv_tau, _kept, _transform_grad
from .vocab_status import _seq_of


@triton.jit
def _bwd_grad(z, m, c2, ls2, a_co, b_co, HAS_E: tl.constexpr):
    """dL/dz_v of one block, every entry as if off the target (the target is rewritten after the loop)."""
    l2 = (z - m) * c2 - ls2  # log2 p_v: the difference first, then the scale
    if HAS_E:
        # clamped: p = 0 either way, and b * l2 stays finite where z = -inf (0 * inf would be NaN)
        l2 = tl.maximum(l2, -16384.0)
        g = tl.exp2(l2) * (a_co + b_co * l2)
    else:
        g = tl.exp2(l2) * a_co
    return g


@triton.jit(do_not_specialize=["T", "T_l", "logits_start", "temp_stride", "id_start", "n_seq"])
def _vocab_bwd_kernel(
    # pointers
    logits_ptr, grad_ptr,  # (B, T_l, V) strided rows; grad may alias logits (inplace)
    ids_ptr, stats_ptr, ent_ptr, c_ptr, e_ptr,  # per token: (B*T,), (B*T, 3) = (m, log S, q), (B*T,) x 3
    # strides (elements)
    stride_lb, stride_lt, stride_gb, stride_gt,
    # sizes
    T, T_l, V, logits_start,
    # scalars
    temp_ptr, temp_stride,  # tau of token k at temp_ptr + k * temp_stride (0: one tau for every row), float32
    # in device memory, read here, never on the host
    scale, softcap,  # the tile's transforms (vocab_jit): runtime floats, used only under HAS_*
    # meta
    HAS_E: tl.constexpr,  # entropy term present (entropy_coef != 0)
    HAS_SCALE: tl.constexpr,  # scale != 1
    HAS_SOFTCAP: tl.constexpr,  # a soft-cap is given
    BLOCK_V: tl.constexpr,
    TEMP_BY_VALUE: tl.constexpr = False,  # True: temp_ptr is tau itself, a float argument (no memory read)
    HAS_G: tl.constexpr = False,  # True: c and e are multiplied here by the upstream gradient g
    g_ptr=None, g_stride=0,  # g of token k at g_ptr + k * g_stride (0: the loss is a scalar), float32
    rows_ptr=None,  # ROWS: the token of each logits row, int64 (the LM head's tile of gathered rows)
    ROWS: tl.constexpr = False,  # True: program p writes row p (B = 1, T = T_l = the tile's rows, logits_start
    # 0) and reads the per-token tensors at token rows_ptr[p]
    id_start=0,  # the vocabulary entry of the tile's column 0 (the LM head's backward by vocabulary blocks):
    # the target is y - id_start, written only where it lies in [0, V)
    keep_s_ptr=None, keep_id_ptr=None,  # KEEP: each token's kept set as (t_s, t_id) (kept_rule_triton)
    KEEP: tl.constexpr = False,  # True: exactly 0 outside the kept set
    TEMP_PER_SEQ: tl.constexpr = 0,  # tau per completion, read at the row's (1: padded) or found in cu_ptr (2)
    cu_ptr=None, n_seq=0,  # TEMP_PER_SEQ 2: the packed form's cu_seqlens as given and its completions
):
    row_id = tl.program_id(0).to(tl.int64)  # one program per logits row, int64 offsets
    inv_cap = _inv_cap(softcap, HAS_SOFTCAP)
    i = row_id // T_l
    r = row_id - i * T_l
    t = r - logits_start
    in_window = (t >= 0) & (t < T)
    if ROWS:
        tok = tl.load(rows_ptr + row_id).to(tl.int64)
    else:
        tok = i * T + t
    if TEMP_BY_VALUE:
        inv_temp = _inv_tau(temp_ptr)
    else:
        if TEMP_PER_SEQ == 1:
            at = i
        elif TEMP_PER_SEQ == 2:
            at = _seq_of(cu_ptr, n_seq, tok, 1024)
        else:
            at = tok
        inv_temp = _inv_tau(tl.load(temp_ptr + at * temp_stride, mask=in_window, other=1.0))
    c = tl.load(c_ptr + tok, mask=in_window, other=0.0)
    if HAS_E:
        e = tl.load(e_ptr + tok, mask=in_window, other=0.0)
    else:
        e = 0.0
    if HAS_G:  # c g and e g, exactly 0 where the coefficient is 0 (an inf or NaN g there is ignored)
        g_up = tl.load(g_ptr + tok * g_stride, mask=in_window, other=0.0)
        c = tl.where(c == 0.0, 0.0, c * g_up)
        if HAS_E:
            e = tl.where(e == 0.0, 0.0, e * g_up)
    lanes = tl.arange(0, BLOCK_V)
    grad_row = grad_ptr + i * stride_gb + r * stride_gt
    if (c != 0.0) | (e != 0.0):
        row = logits_ptr + i * stride_lb + r * stride_lt
        m = tl.load(stats_ptr + tok * 3)
        log_s = tl.load(stats_ptr + tok * 3 + 1)
        q = tl.load(stats_ptr + tok * 3 + 2)  # 1 - p_y
        ent = tl.load(ent_ptr + tok)
        y = tl.load(ids_ptr + tok).to(tl.int64) - id_start
        y_ok = (y >= 0) & (y < V)
        # the target's own logit, read before the loop: with inplace the loop overwrites it
        z_y = tl.load(row + y, mask=y_ok, other=float("-inf")).to(tl.float32)
        if KEEP:
            k_s = tl.load(keep_s_ptr + tok)
            k_id = tl.load(keep_id_ptr + tok)
        c2 = inv_temp * LOG2E
        ls2 = log_s * LOG2E  # log2 p_v = (z_v - m) c2 - ls2
        # dL/dz_v off the target = p_v (a + b log2 p_v): a = -(c + e H) / tau, b = -e ln 2 / tau
        if HAS_E:
            a_co = -(c + e * ent) * inv_temp
            b_co = -(e * LN2) * inv_temp
        else:
            a_co = -c * inv_temp
            b_co = 0.0
        v_full = (V // BLOCK_V) * BLOCK_V
        for v0 in range(0, v_full, BLOCK_V):  # whole blocks: no mask
            z, dz = _transform_grad(tl.load(row + v0 + lanes).to(tl.float32), scale, softcap, inv_cap, HAS_SCALE,
                                    HAS_SOFTCAP)
            if KEEP:
                z = _kept(z, v0 + lanes, inv_temp, k_s, k_id, y)
            g = _bwd_grad(z, m, c2, ls2, a_co, b_co, HAS_E) * dz
            if KEEP:  # exactly 0 outside the set, a NaN coefficient's token too (spec 13)
                g = tl.where(z == float("-inf"), 0.0, g)
            tl.store(grad_row + v0 + lanes, g.to(grad_ptr.dtype.element_ty))
        if v_full < V:  # the partial last block
            offs = v_full + lanes
            in_v = offs < V
            z = tl.load(row + offs, mask=in_v, other=float("-inf")).to(tl.float32)
            z, dz = _transform_grad(z, scale, softcap, inv_cap, HAS_SCALE, HAS_SOFTCAP)
            if KEEP:
                z = _kept(z, offs, inv_temp, k_s, k_id, y)
            g = _bwd_grad(z, m, c2, ls2, a_co, b_co, HAS_E) * dz
            if KEEP:
                g = tl.where(z == float("-inf"), 0.0, g)
            tl.store(grad_row + offs, g.to(grad_ptr.dtype.element_ty), mask=in_v)
        # the target entry, written once: (c (1 - p_y) - e p_y (log p_y + H)) / tau with 1 - p_y = q from
        # the forward. The barrier orders it after every thread's store of its block (which wrote the
        # off-target formula there).
        tl.debug_barrier()
        z_y, dz_y = _transform_grad(z_y, scale, softcap, inv_cap, HAS_SCALE, HAS_SOFTCAP)
        logq_y = (z_y - m) * inv_temp - log_s
        p_y = tl.exp(logq_y)
        g_y = c * q - e * tl.where(p_y > 0, p_y * (logq_y + ent), 0.0)
        tl.store(grad_row + y, (g_y * inv_temp * dz_y).to(grad_ptr.dtype.element_ty), mask=y_ok)
    else:
        zero = tl.zeros([BLOCK_V], tl.float32).to(grad_ptr.dtype.element_ty)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + lanes
            tl.store(grad_row + offs, zero, mask=offs < V)

