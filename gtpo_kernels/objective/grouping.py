"""Groups given by a per-row key (verl's `uid`) instead of contiguous blocks of `group_size` rows.

Trainers such as verl reorder rows after generation (to balance sequence lengths across ranks) and may
pad a batch with extra rows, so a group is "the rows with the same key", in any order and of any size.
The conflict kernels want contiguous groups of one size; `GroupLayout` maps one to the other: every
group gets `size` consecutive slots (the largest group's size), its rows fill the first slots in their
batch order and the remaining slots are inactive padding (all masked out, advantage 0), which changes
no weight (a padding slot never stands masked in, spec 3). `slot[i]` is row i's slot; scatter a
(B, ...) tensor into the slots with `to_slots`, and read the rows back with `x[slot]`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GroupLayout:
    slot: torch.Tensor   # (B,) int64: the slot of row i, in [0, n_groups * size)
    code: torch.Tensor   # (B,) int64: the group of row i, in [0, n_groups)
    n_groups: int
    size: int            # slots per group = the largest group's size

    @property
    def n_slots(self) -> int:
        return self.n_groups * self.size

    def to_slots(self, x, fill=0):
        """(B, ...) rows -> (n_slots, ...) slots; padding slots hold `fill`."""
        out = torch.full((self.n_slots, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
        out[self.slot] = x
        return out


def group_codes(group_ids, B, name, device):
    """Any per-row key -> (B,) int64 group codes and the number of groups."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1 or group_ids.numel() != B:
            raise ValueError(f"{name} must hold one group key per row: {B} entries, got shape "
                             f"{tuple(group_ids.shape)}")
        if group_ids.dtype.is_floating_point or group_ids.dtype.is_complex:
            raise TypeError(f"{name} as a tensor must be integer or bool (a group key per row), got {group_ids.dtype}")
        uniq, code = torch.unique(group_ids, return_inverse=True)
        return code.to(device=device, dtype=torch.int64), int(uniq.numel())
    if isinstance(group_ids, (str, bytes)) or not hasattr(group_ids, "__len__"):
        raise TypeError(f"{name} must be a sequence of per-row group keys (a list, a numpy array, a tensor), "
                        f"got {type(group_ids).__name__}")
    shape = getattr(group_ids, "shape", None)
    if shape is not None and len(shape) != 1:
        raise ValueError(f"{name} must be 1-D (one group key per row), got shape {tuple(shape)}")
    if len(group_ids) != B:
        raise ValueError(f"{name} must hold one group key per row: {B} entries, got {len(group_ids)}")
    index = {}
    try:
        codes = [index.setdefault(k.item() if hasattr(k, "item") else k, len(index)) for k in group_ids]
    except TypeError as e:  # unhashable keys (lists, arrays)
        raise TypeError(f"{name} keys must be hashable (strings, ints): {e}") from None
    return torch.tensor(codes, dtype=torch.int64, device=device), len(index)


def group_layout(group_ids, B, *, device=None, name="group_ids") -> GroupLayout:
    """The slot layout of B rows grouped by `group_ids` (any hashable key per row, any order; a 1-D
    integer tensor is grouped on its device). One host sync (the largest group's size)."""
    code, n_groups = group_codes(group_ids, B, name, device)
    if B == 0:
        return GroupLayout(slot=code, code=code, n_groups=0, size=1)
    counts = torch.bincount(code, minlength=n_groups)
    size = int(counts.max())
    order = torch.argsort(code, stable=True)  # rows of each group together, in batch order
    start = torch.cumsum(counts, 0) - counts   # first sorted position of each group
    within = torch.empty_like(code)
    within[order] = torch.arange(B, device=code.device) - start[code[order]]
    return GroupLayout(slot=code * size + within, code=code, n_groups=n_groups, size=size)
