"""The O(tokens) loss math between the passes: policy terms (`policy`), the surrogate and its
coefficients (`surrogate`), the conflict-token weights from the raw flags (`conflict`) and groups by key
(`grouping`). Imports `core` and `kernels` (the raw conflict flags)."""
