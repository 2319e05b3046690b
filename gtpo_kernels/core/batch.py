"""The Batch factory: every public call's checked arguments become a `layout.Batch` here (ids, mask,
segments, shapes, advantages and the per-token extras, flattened)."""
from __future__ import annotations

import torch

from . import checks
from .layout import Batch


def vocab_contiguous(logits):
    """Rows with vocabulary stride 1 are read in place; anything else is copied once."""
    return logits if logits.stride(-1) == 1 or logits.shape[-1] == 1 else logits.contiguous()


def prepare_tokens(completion_ids, completion_mask=None, advantages=None, *, cu_seqlens=None,
                   max_seqlen=None, device=None, validate=True) -> Batch:
    """The per-token part of a Batch (no logits): ids, counted, seg, shapes, advantages."""
    checks.check_int_tensor("completion_ids", completion_ids)
    device = completion_ids.device if device is None else device
    checks.check_device("completion_ids", completion_ids, device)
    if cu_seqlens is None:
        if completion_ids.dim() != 2:
            raise ValueError(f"completion_ids must have shape (B, T), got {tuple(completion_ids.shape)}"
                             " (pass cu_seqlens for the packed (N,) form)")
        B, T = completion_ids.shape
        N, tok_shape, max_len = B * T, (B, T), T
        seg = torch.arange(B, device=device).repeat_interleave(T)
    else:
        checks.check_int_tensor("cu_seqlens", cu_seqlens)
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must have shape (B + 1,), got {tuple(cu_seqlens.shape)}")
        checks.check_device("cu_seqlens", cu_seqlens, device)
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
            max_seqlen = checks.check_nonneg_int("max_seqlen", max_seqlen)
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
        checks.check_tensor("completion_mask", completion_mask)
        checks.check_shape("completion_mask", completion_mask, tok_shape, "completion_ids' shape")
        checks.check_device("completion_mask", completion_mask, device)
        if validate and completion_mask.dtype != torch.bool and \
                bool(((completion_mask != 0) & (completion_mask != 1)).any()):
            raise ValueError("completion_mask must hold only 0 and 1 (1 = the token counts); it is a mask, "
                             "not a per-token weight (scale the loss, or pass rollout weights, instead)")
        counted = (completion_mask != 0).reshape(-1).contiguous()
    batch = Batch(logits3=None, ids=completion_ids.reshape(-1).contiguous(), counted=counted, seg=seg,
                  B=B, logits_start=0, tok_shape=tok_shape, cu_seqlens=cu_seqlens,
                  max_seqlen=max_seqlen, max_len=max_len)
    if advantages is not None:
        checks.check_tensor("advantages", advantages)
        if advantages.dtype == torch.bool or advantages.dtype.is_complex:
            raise TypeError(f"advantages must be a real tensor, got {advantages.dtype}")
        if tuple(advantages.shape) not in ((B,), (B, 1)):
            raise ValueError(f"advantages must have shape (B,) or (B, 1) with B = {B}, "
                             f"got {tuple(advantages.shape)}")
        checks.check_device("advantages", advantages, device)
        batch.adv = advantages.reshape(B)
    return batch


def prepare(logits, completion_ids, completion_mask=None, *, advantages=None, cu_seqlens=None,
            max_seqlen=None, logits_start=0, validate=True, vocab_size=None, **extras) -> Batch:
    """A Batch for the vocabulary passes: prepare_tokens plus the logits and the per-token extras
    (old_logps, ref_logps, lam, n_conf, rollout_is_weights, rollout_logps: see add_extras). vocab_size:
    the whole vocabulary's size when the logits hold a slice of it (vocabulary-parallel)."""
    logits_start = checks.check_nonneg_int("logits_start", logits_start)
    if cu_seqlens is None:
        checks.check_logits(logits, 3, "(B, T_l, V) (pass cu_seqlens for the packed (N, V) form)")
    else:
        checks.check_logits(logits, 2, "(N, V) in the packed form (cu_seqlens given)")
    checks.check_int_tensor("completion_ids", completion_ids)
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
        checks.check_ids_in_range(b.ids, b.counted, b.V if vocab_size is None else vocab_size)
    return b


def add_extras(b, device, *, old_logps=None, ref_logps=None, lam=None, n_conf=None, rollout_is_weights=None,
               rollout_logps=None, validate=True):
    """Per-token inputs of the loss, flattened onto the Batch: each of completion_ids' shape, except
    n_conf (B,) and rollout_is_weights (per token, or (B,) / (B, 1) per completion: then repeated)."""
    for name, x, attr in (("old_logps", old_logps, "old"), ("ref_logps", ref_logps, "ref"),
                          ("lam", lam, "lam"), ("rollout_logps", rollout_logps, "rollout_logps")):
        if x is not None:
            checks.check_float_tensor(name, x)
            checks.check_shape(name, x, b.tok_shape, "completion_ids' shape")
            checks.check_device(name, x, device)
            setattr(b, attr, x.reshape(-1))
    if n_conf is not None:
        checks.check_tensor("n_conf", n_conf)
        checks.check_shape("n_conf", n_conf, (b.B,), "(B,)")
        checks.check_device("n_conf", n_conf, device)
        b.n_conf = n_conf
    w = rollout_is_weights
    if w is not None:
        checks.check_float_tensor("rollout_is_weights", w)
        checks.check_device("rollout_is_weights", w, device)
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


