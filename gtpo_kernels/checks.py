"""Argument checks: every public call's arguments become a `layout.Batch` here. Errors name the
argument and what was expected."""
from __future__ import annotations

import numbers

import torch

from .layout import Batch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# flags written per token by the forward pass (kernel and torch path alike)
BAD_NONFINITE = 1  # NaN or +inf in the counted row
BAD_TARGET_NEG_INF = 2  # the target's own logit is -inf
BAD_ID = 4  # id outside [0, V) (never read)


def host_checks(validate) -> bool:
    """Whether the host-side checks run: `validate`, except inside torch.compile or CUDA-graph capture,
    where a host read would sync or break the graph (invalid tokens then give NaN instead)."""
    if not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool, got {validate!r}")
    if not validate or torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def check_inplace(inplace, logits):
    """inplace=True writes the gradient over the logits: each element must own its memory."""
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool, got {inplace!r}")
    if not inplace:
        return
    if torch.compiler.is_compiling():
        raise ValueError("inplace=True is not supported inside torch.compile: the compiled backward would "
                         "copy the logits to write them, which loses the memory saving; use inplace=False")
    if logits.stride(-1) != 1:
        raise ValueError("inplace=True needs logits with vocabulary stride 1 (it writes the gradient "
                         "into their storage)")
    dims = sorted((st, n) for st, n in zip(logits.stride(), logits.shape) if n > 1)
    span = 1
    for st, n in dims:
        if st < span:
            raise ValueError(f"inplace=True needs logits whose rows do not overlap in memory; these have "
                             f"shape {tuple(logits.shape)} and strides {logits.stride()} (an expanded or "
                             f"broadcast view?): pass a copy, or inplace=False")
        span = st * n


def check_num_items(num_items, loss_agg, device, dtype):
    """num_items_in_batch: the denominator of 'token-mean' (a positive number or tensor), or None."""
    if num_items is None:
        return None
    if loss_agg != "token-mean":
        raise ValueError(f"num_items_in_batch is the denominator of loss_agg='token-mean' only; with "
                         f"loss_agg={loss_agg!r} the denominators are per completion or per batch (spec 4): "
                         f"scale the loss instead (README, 'Normalizers')")
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1 or num_items.dtype == torch.bool or num_items.dtype.is_complex:
            raise ValueError(f"num_items_in_batch must be a positive number or a one-element real tensor, "
                             f"got a {num_items.dtype} tensor of shape {tuple(num_items.shape)}")
        return num_items.reshape(()).to(device, dtype).clamp(min=1)
    if isinstance(num_items, numbers.Real) and not isinstance(num_items, bool) and num_items > 0:
        return max(float(num_items), 1.0)
    raise ValueError(f"num_items_in_batch must be a positive number or tensor, got {num_items!r}")


def _nonneg_int(name, x):
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 0:
        raise ValueError(f"{name} must be an int >= 0, got {x!r}")
    return int(x)


def _tensor(name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _shape(name, x, shape, what):
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {what} = {tuple(shape)}, got {tuple(x.shape)}")


def _int_tensor(name, x):
    _tensor(name, x)
    if x.dtype == torch.bool or x.dtype.is_floating_point or x.dtype.is_complex:
        raise TypeError(f"{name} must be an integer tensor (int32 or int64), got {x.dtype}")


def check_same_shape(name, x, tok_shape):
    _shape(name, x, tok_shape, "completion_ids' shape")


def check_float_tensor(name, x):
    _tensor(name, x)
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def _same_device(name, x, device):
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but logits are on {device}")


def check_logits(logits, ndim, what):
    _tensor("logits", logits)
    if logits.dtype not in FLOAT_DTYPES:
        raise TypeError(f"logits must be float16, bfloat16, float32 or float64, got {logits.dtype}")
    if logits.dim() != ndim:
        raise ValueError(f"logits must be {what}, got shape {tuple(logits.shape)}")
    if logits.shape[-1] < 1:
        raise ValueError("logits must have a vocabulary dimension V >= 1")


def vocab_contiguous(logits):
    """Rows with vocabulary stride 1 are read in place; anything else is copied once."""
    return logits if logits.stride(-1) == 1 or logits.shape[-1] == 1 else logits.contiguous()


def check_ids_in_range(ids, counted, V):
    bad = counted & ((ids < 0) | (ids >= V))
    if bool(bad.any()):
        k = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"completion_ids must lie in [0, V) = [0, {V}) at counted positions; flat position {k} "
            f"holds {int(ids[k])} (mask it out, or fix the ids)")


def prepare_tokens(completion_ids, completion_mask=None, advantages=None, *, cu_seqlens=None,
                   max_seqlen=None, device=None, validate=True) -> Batch:
    """The per-token part of a Batch (no logits): ids, counted, seg, shapes, advantages."""
    _int_tensor("completion_ids", completion_ids)
    device = completion_ids.device if device is None else device
    _same_device("completion_ids", completion_ids, device)
    if cu_seqlens is None:
        if completion_ids.dim() != 2:
            raise ValueError(f"completion_ids must have shape (B, T), got {tuple(completion_ids.shape)}"
                             " (pass cu_seqlens for the packed (N,) form)")
        B, T = completion_ids.shape
        N, tok_shape, max_len = B * T, (B, T), T
        seg = torch.arange(B, device=device).repeat_interleave(T)
    else:
        _int_tensor("cu_seqlens", cu_seqlens)
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must have shape (B + 1,), got {tuple(cu_seqlens.shape)}")
        _same_device("cu_seqlens", cu_seqlens, device)
        if completion_ids.dim() != 1:
            raise ValueError(f"completion_ids must have shape (N,) in the packed form, "
                             f"got {tuple(completion_ids.shape)}")
        N, B = completion_ids.shape[0], cu_seqlens.numel() - 1
        tok_shape = (N,)
        cu = cu_seqlens.long()
        lengths = cu[1:] - cu[:-1]
        if validate and (int(cu[0]) != 0 or int(cu[-1]) != N or bool((lengths < 0).any())):
            raise ValueError(f"cu_seqlens must start at 0, never decrease and end at N = {N} "
                             f"(completion_ids' length), got {cu_seqlens.tolist()}")
        if max_seqlen is not None:
            max_seqlen = _nonneg_int("max_seqlen", max_seqlen)
            if validate and max_seqlen < int(lengths.max()):
                raise ValueError(f"max_seqlen = {max_seqlen} is shorter than the longest completion in "
                                 f"cu_seqlens ({int(lengths.max())})")
        seg = torch.repeat_interleave(torch.arange(B, device=device), lengths, output_size=N)
        max_len = lengths.max().clamp(min=1)  # the longest completion (a tensor: no host sync)
    if B == 0:
        raise ValueError("the batch is empty: completion_ids needs at least one completion")
    if completion_mask is None:
        counted = torch.ones(N, dtype=torch.bool, device=device)
    else:
        _tensor("completion_mask", completion_mask)
        _shape("completion_mask", completion_mask, tok_shape, "completion_ids' shape")
        _same_device("completion_mask", completion_mask, device)
        if validate and completion_mask.dtype != torch.bool and \
                bool(((completion_mask != 0) & (completion_mask != 1)).any()):
            raise ValueError("completion_mask must hold only 0 and 1 (1 = the token counts); it is a mask, "
                             "not a per-token weight (scale the loss, or pass rollout weights, instead)")
        counted = (completion_mask != 0).reshape(-1).contiguous()
    batch = Batch(logits3=None, ids=completion_ids.reshape(-1).contiguous(), counted=counted, seg=seg,
                  B=B, logits_start=0, tok_shape=tok_shape, cu_seqlens=cu_seqlens,
                  max_seqlen=max_seqlen, max_len=max_len)
    if advantages is not None:
        _tensor("advantages", advantages)
        if advantages.dtype == torch.bool or advantages.dtype.is_complex:
            raise TypeError(f"advantages must be a real tensor, got {advantages.dtype}")
        if tuple(advantages.shape) not in ((B,), (B, 1)):
            raise ValueError(f"advantages must have shape (B,) or (B, 1) with B = {B}, "
                             f"got {tuple(advantages.shape)}")
        _same_device("advantages", advantages, device)
        batch.adv = advantages.reshape(B)
    return batch


def prepare(logits, completion_ids, completion_mask=None, *, advantages=None, cu_seqlens=None,
            max_seqlen=None, logits_start=0, validate=True, vocab_size=None, **extras) -> Batch:
    """A Batch for the vocabulary passes: prepare_tokens plus the logits and the per-token extras
    (old_logps, ref_logps, lam, n_conf, rollout_is_weights, rollout_logps: see add_extras). vocab_size:
    the whole vocabulary's size when the logits hold a slice of it (vocabulary-parallel)."""
    logits_start = _nonneg_int("logits_start", logits_start)
    if cu_seqlens is None:
        check_logits(logits, 3, "(B, T_l, V) (pass cu_seqlens for the packed (N, V) form)")
    else:
        check_logits(logits, 2, "(N, V) in the packed form (cu_seqlens given)")
    _int_tensor("completion_ids", completion_ids)
    if cu_seqlens is None and (completion_ids.dim() != 2 or completion_ids.shape[0] != logits.shape[0]):
        raise ValueError(f"completion_ids must have shape (B, T) with B = {logits.shape[0]} (logits' "
                         f"first dimension), got {tuple(completion_ids.shape)}")
    b = prepare_tokens(completion_ids, completion_mask, advantages, cu_seqlens=cu_seqlens,
                       max_seqlen=max_seqlen, device=logits.device, validate=validate)
    if cu_seqlens is None:
        B, T_l, _ = logits.shape
        T = b.tok_shape[1]
        if T_l < logits_start + T:
            raise ValueError(f"logits must hold at least logits_start + T = {logits_start + T} rows "
                             f"in dimension 1, got T_l = {T_l}")
        b.logits3 = vocab_contiguous(logits)
    else:
        N = b.tok_shape[0]
        if logits.shape[0] < logits_start + N:
            raise ValueError(f"logits must hold at least logits_start + N = {logits_start + N} rows, "
                             f"got {logits.shape[0]}")
        b.logits3 = vocab_contiguous(logits).unsqueeze(0)
    b.logits_start = logits_start
    add_extras(b, logits.device, validate=validate, **extras)
    if validate:
        check_ids_in_range(b.ids, b.counted, b.V if vocab_size is None else vocab_size)
    return b


def add_extras(b, device, *, old_logps=None, ref_logps=None, lam=None, n_conf=None, rollout_is_weights=None,
               rollout_logps=None, validate=True):
    """Per-token inputs of the loss, flattened onto the Batch: each of completion_ids' shape, except
    n_conf (B,) and rollout_is_weights (per token, or (B,) / (B, 1) per completion: then repeated)."""
    for name, x, attr in (("old_logps", old_logps, "old"), ("ref_logps", ref_logps, "ref"),
                          ("lam", lam, "lam"), ("rollout_logps", rollout_logps, "rollout_logps")):
        if x is not None:
            check_float_tensor(name, x)
            _shape(name, x, b.tok_shape, "completion_ids' shape")
            _same_device(name, x, device)
            setattr(b, attr, x.reshape(-1))
    if n_conf is not None:
        _tensor("n_conf", n_conf)
        _shape("n_conf", n_conf, (b.B,), "(B,)")
        _same_device("n_conf", n_conf, device)
        b.n_conf = n_conf
    w = rollout_is_weights
    if w is not None:
        check_float_tensor("rollout_is_weights", w)
        _same_device("rollout_is_weights", w, device)
        if tuple(w.shape) == tuple(b.tok_shape):
            b.rollout_w = w.reshape(-1)
        elif tuple(w.shape) in ((b.B,), (b.B, 1)):
            b.rollout_w_seq = w.reshape(b.B)
            b.rollout_w = b.rollout_w_seq[b.seg]
        else:
            raise ValueError(f"rollout_is_weights must have completion_ids' shape {tuple(b.tok_shape)} (per "
                             f"token) or ({b.B},) / ({b.B}, 1) (per completion), got {tuple(w.shape)}")
        if validate and bool((b.counted & ~(b.rollout_w >= 0)).any()):
            raise ValueError("rollout_is_weights must be >= 0 (and not NaN) at counted positions "
                             "(see rollout_is_weights() for TRL's modes)")


def check_group_size(group_size, B):
    if group_size is None:
        raise ValueError("group_size is required to compute the conflict weights (or pass lam and "
                         "n_conf from conflict_weights, or turn use_conflict_mask off)")
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if B % group_size:
        raise ValueError(f"group_size = {group_size} must divide the number of completions B = {B}")
    return int(group_size)


def raise_on_flags(bad, tok_shape):
    """Host-side report of the forward kernel's per-token flags (validate=True only)."""
    nz = bad.nonzero()
    if nz.numel() == 0:
        return
    k = int(nz[0, 0])
    where = tuple(int(v) for v in torch.unravel_index(torch.tensor(k), tok_shape))
    f = int(bad[k])
    if f & BAD_NONFINITE:
        what = "contains NaN or +inf"
    elif f & BAD_TARGET_NEG_INF:
        what = "gives its own target token a logit of -inf (log-prob -inf)"
    else:
        what = "has a target id outside [0, V)"
    raise ValueError(f"logits: the row predicting completion token {where} {what}; "
                     f"{nz.shape[0]} counted row(s) are invalid")
