"""The kept-set rebuild (kept_set.kept_sets) as a `torch.library` custom op over the flat tokens, so that a
call with `top_k` / `top_p` / `min_p` traces whole under torch.compile(fullgraph=True) (spec 6, 13):

    kept_sets_flat(logits3, rows_b, rows_t, y, counted, tau, top_k, top_p, min_p)
        -> token_ids (K,), offsets (n + 1,), restored (n,), nonfinite (n,), kept_mass (n,)

for every flat token (flat_rows' layout), an uncounted token with an empty set (offsets equal), not
restored, finite and of mass 0. The sets' total size K is known only once they are rebuilt (an unbacked
size while tracing, which nothing downstream branches on); every other output has the tokens' shape. The
counted rows, the blocks and the top-k path's sizes are read on the host inside the op, where tracing
does not look. tau and the rules are tensors, 0-d (one value) or (n,) per token; None: the rule is off.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..core.layout import float_dtype_for
from ..core.sampling import flat_offsets
from .kept_set import kept_sets
from .eager import eager

Tensor = torch.Tensor


def _at(x, pos, n):
    """A 0-d or (n,) tensor at the counted positions `pos`; None stays None (the rule is off)."""
    return None if x is None else x.expand(n)[pos]


@torch.library.custom_op("gtpo_kernels::kept_sets_flat", mutates_args=())
def kept_sets_flat(logits3: Tensor, rows_b: Tensor, rows_t: Tensor, y: Tensor, counted: Tensor, tau: Tensor,
                   top_k: Optional[Tensor], top_p: Optional[Tensor], min_p: Optional[Tensor], scale: float = 1.0,
                   softcap: Optional[float] = None) -> List[Tensor]:
    n = counted.numel()
    pos = counted.reshape(-1).nonzero().squeeze(1)
    ids, off, rest, nonfinite, mass = kept_sets(logits3, rows_b[pos], rows_t[pos], y[pos], _at(tau, pos, n),
                                                _at(top_k, pos, n), _at(top_p, pos, n), _at(min_p, pos, n),
                                                scale, softcap)
    flat = torch.zeros(n, dtype=torch.bool, device=counted.device)
    return [ids, flat_offsets(off, counted)[0], flat.scatter(0, pos, rest), flat.scatter(0, pos, nonfinite),
            torch.zeros(n, dtype=mass.dtype, device=mass.device).scatter(0, pos, mass)]


@kept_sets_flat.register_fake
def _(logits3, rows_b, rows_t, y, counted, tau, top_k, top_p, min_p, scale=1.0, softcap=None):
    n = counted.numel()
    K = torch.library.get_ctx().new_dynamic_size()
    return [logits3.new_empty(K, dtype=torch.long), logits3.new_empty(n + 1, dtype=torch.long),
            logits3.new_empty(n, dtype=torch.bool), logits3.new_empty(n, dtype=torch.bool),
            logits3.new_empty(n, dtype=float_dtype_for(logits3))]


def as_rule(x, dtype, like):
    """A rule or temperature as kept_sets_flat takes it: None, or a tensor (a number filled into a 0-d one
    on the logits' device, never copied from the host)."""
    if x is None or isinstance(x, Tensor):
        return x
    return torch.full((), x, dtype=dtype, device=like.device)


kept_sets_flat = eager(kept_sets_flat)  # called eagerly without torch.library's per-call Python (kernels/eager.py)
