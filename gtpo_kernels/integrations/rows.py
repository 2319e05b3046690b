"""Row shifts for trainers whose completions do not start at column 0 of their (B, T) tensors (SkyRL's
right-aligned responses, AReaL's prompt + response rows). GTPO's conflict weights align completions
at their first token (spec 3), so such rows are shifted left for the call and back afterwards."""
from __future__ import annotations

import torch


def shift_left(x: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """(B, T): row i's column t + offset[i] moves to column t; the vacated tail is 0."""
    T = x.shape[1]
    col = torch.arange(T, device=x.device)
    src = col[None, :] + offset[:, None]
    return torch.where(src < T, x.gather(1, src.clamp(max=max(T - 1, 0))), torch.zeros((), dtype=x.dtype,
                                                                                        device=x.device))


def shift_right(x: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The inverse of shift_left on the kept columns: row i's column t moves to t + offset[i]; the
    leading offset[i] columns are 0."""
    T = x.shape[1]
    col = torch.arange(T, device=x.device)
    src = col[None, :] - offset[:, None]
    return torch.where(src >= 0, x.gather(1, src.clamp(min=0)), torch.zeros((), dtype=x.dtype, device=x.device))


def first_counted(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) mask -> (B,) the column of each row's first nonzero entry (0 for an empty row)."""
    T = mask.shape[1]
    col = torch.arange(T, device=mask.device)
    first = torch.where(mask != 0, col[None, :], T).amin(dim=1)
    return torch.where(first == T, torch.zeros_like(first), first)
