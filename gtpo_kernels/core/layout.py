"""The canonical token layout shared by every backend: `Batch`, and the packed/padded helpers.

Every public call turns its arguments into a `Batch` (checks.prepare / checks.prepare_tokens): logits as
a (B', T_l, V) view with vocabulary stride 1 (the padded form has B' = B; the packed form is one long
row of completions, B' = 1), and per-token tensors flattened to (N,) with `seg[k]` the completion that
owns token k. The padded form is seg = k // T; the packed form comes from cu_seqlens.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch


class Lazy:
    """A Batch field made on first use (a fused call whose kernels read the mask and the segments
    themselves never makes it: no launch)."""
    __slots__ = ("make",)

    def __init__(self, make):
        self.make = make


def spread_packed(x, cu_seqlens, n):
    """x (B,), one value per completion, spread on the n packed tokens: token k takes its completion's, the
    number of cu_seqlens[1:] <= k (torch.searchsorted), clamped into [0, B - 1] so that a malformed
    cu_seqlens (flagged apart) reads in bounds: 4 launches."""
    B = x.shape[0]
    seg = torch.searchsorted(cu_seqlens[1:].to(device=x.device, dtype=torch.long),
                             torch.arange(n, device=x.device), right=True).clamp_(max=max(B - 1, 0))
    return x[seg]


def spread_rows(x, rows):
    """x (B,), one value per completion, spread on the tokens as `rows` (a Batch's seq_rows) reads it: T, rows
    of T tokens (padded), or (cu_seqlens, N) (packed, spread_packed)."""
    if isinstance(rows, tuple):
        return spread_packed(x, *rows)
    return x.reshape(-1, 1).expand(-1, rows).reshape(-1)


def _lazy(name):
    def get(self):
        v = getattr(self, name)
        if isinstance(v, Lazy):
            v = v.make()
            setattr(self, name, v)
        return v

    def put(self, v):
        setattr(self, name, v)
    return property(get, put)


@dataclasses.dataclass
class Batch:
    logits3: Optional[torch.Tensor]  # (B', T_l, V), stride(2) == 1; None for token-only batches
    ids_: object  # (N,) contiguous, integer (a Lazy of it where a malformed cu_seqlens poisons it): `ids`
    counted_: object  # (N,) bool, or a Lazy of it: read it as `counted`
    seg_: object  # (N,) int64: completion of each token, or a Lazy of it: read it as `seg`
    B: int  # completions
    logits_start: int
    tok_shape: tuple  # (B, T) padded or (N,) packed
    adv_: object = None  # (B,)
    old: Optional[torch.Tensor] = None  # (N,)
    ref: Optional[torch.Tensor] = None  # (N,)
    lam: Optional[torch.Tensor] = None  # (N,)
    n_conf: Optional[torch.Tensor] = None  # (B,)
    rollout_w_: object = None  # (N,) rollout importance weights (per completion: a Lazy of them on the tokens): `rollout_w`
    rollout_w_seq: Optional[torch.Tensor] = None  # (B,) when they were given per completion
    rollout_logps: Optional[torch.Tensor] = None  # (N,) the inference engine's log-probs
    cu_seqlens_: object = None
    max_seqlen: Optional[int] = None
    max_len_: object = None  # default denominator of seq-mean-token-sum-norm (or a Lazy of it): `max_len`
    malformed_: object = None  # 0-d bool: an unvalidated cu_seqlens was malformed (NaN outputs)
    tau: Optional[torch.Tensor] = None  # (N,) the call's temperature per token, when it gave one (spec 13); (B,)
    # one per completion where the kernels read it at each token's completion (tau_seq): `tau_per_row`
    tau_seq: bool = False
    mask: Optional[torch.Tensor] = None  # (N,) the caller's completion_mask as given (any dtype), None: all counted
    token_adv: Optional[torch.Tensor] = None  # (N,) an advantage per token in place of Ahat (pipeline/token_terms.py)
    conflicts: object = None  # the conflict weights computed in the call, their launch deferred (lam / n_conf: its)

    given: Optional[dict] = None  # ids, adv, cu_seqlens as the caller gave them (the epilogue kernel reads these)

    counted = _lazy("counted_")
    ids = _lazy("ids_")
    adv = _lazy("adv_")
    cu_seqlens = _lazy("cu_seqlens_")
    malformed = _lazy("malformed_")
    seg = _lazy("seg_")
    max_len = _lazy("max_len_")
    rollout_w = _lazy("rollout_w_")

    @property
    def packed(self) -> bool:
        return self.cu_seqlens_ is not None

    @property
    def tau_per_row(self) -> bool:
        """Whether `tau` holds one temperature per completion, read at each token's completion (`seq_rows`), as
        the call that set it says (tau_seq: packed with B == N its size would not tell)."""
        return self.tau is not None and self.tau_seq

    @property
    def seq_rows(self):
        """How a value per completion is read at each token: T (padded, token k's at k // T), or (cu_seqlens
        as given, N) (packed: found there, as spread_packed spreads it)."""
        return (self.given["cu_seqlens"], self.tok_shape[0]) if self.packed else self.tok_shape[1]

    @property
    def V(self) -> int:
        return self.logits3.shape[-1]


def float_dtype_for(x):
    """The float dtype of everything computed from tensor x: float64 for float64, else float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def packed_layout(b, longest=False):
    """Packed form: the padded length L (max_seqlen, or the longest completion: a host read) and
    pos[k], the position of token k inside its completion. longest: L the longest completion whatever
    max_seqlen says (the reference backend: an unvalidated max_seqlen steers nothing there)."""
    cu = b.cu_seqlens.long()
    L = b.max_seqlen if b.max_seqlen is not None and not longest else (int((cu[1:] - cu[:-1]).max()) if b.B else 0)
    return L, torch.arange(b.ids.numel(), device=b.ids.device) - cu[b.seg]


def pad(b, x, L, pos, fill=0):
    """Packed per-token values (N,) -> padded (B, L), `fill` elsewhere."""
    out = torch.full((b.B, L), fill, dtype=x.dtype, device=x.device)
    out[b.seg, pos] = x.reshape(-1)
    return out


def padded_tokens(b, x):
    """Per-token values (N,) of a padded or packed batch as (B, L) (packed: 0 where there is no token)."""
    if not b.packed:
        return x.reshape(b.tok_shape)
    L, pos = packed_layout(b)
    return pad(b, x, L, pos)


def padded_window(b, logits):
    """For the reference backend: the logits rows that predict tokens as (B, L, V) (L: the longest
    completion), ids (B, L), mask (B, L), `unpad` (a padded (B, L) result -> the caller's token shape) and `pad` (the reverse). A counted
    row whose id is outside [0, V) (unvalidated; malformed cu_seqlens make every id -1) is NaN, so that its
    outputs and gradient are NaN as on the other backends (the reference would clamp the id)."""
    if not b.packed:
        T = b.tok_shape[1]
        same = (lambda x: x)
        win = (logits[:, b.logits_start:b.logits_start + T], b.ids.reshape(b.tok_shape),
               b.counted.reshape(b.tok_shape), same, same)
    else:
        L, pos = packed_layout(b, longest=True)
        rows = torch.arange(b.ids.numel(), device=logits.device) + b.logits_start
        win = (logits[pad(b, rows, L, pos, fill=b.logits_start)], pad(b, b.ids.long(), L, pos),
               pad(b, b.counted, L, pos), (lambda x: x[b.seg, pos]), (lambda x: pad(b, x, L, pos)))
    lg, ids, m = win[:3]
    bad = m & ((ids < 0) | (ids >= lg.shape[-1]))
    return (lg + torch.where(bad, float("nan"), 0.0).to(lg.dtype)[..., None],) + win[1:]
