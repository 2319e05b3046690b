"""The head's time model beside the accounting (spec 11): what gtpo_kernels.pipeline.schedule.predict gives
for each case measured here and at the GPU record's sizes, with the float32 accumulators' bytes per call.
Predictions of a model fitted to one H200 record, not measurements; `python -m bench.head_accounting`
prints them after its table.
"""
from __future__ import annotations

import math

GPU_SIZES = ((8192, 4096, 151936), (4096, 2048, 151936))  # N x D x V of the GPU record's head rows
# memory_budget: the GPU record's (bench's --linear-tile 256: a 256 MiB tile and its gradient), the default
BUDGETS = (512 << 20, 1 << 30)


def per_tile(V, elem_bytes, budget):
    """Rows a tile holds within `budget` (its logits and their gradient, a GPU's mixed-precision GEMM)."""
    return max(1, budget // (2 * V * elem_bytes))


def accumulator_bytes(N, V, D, rows):
    """The float32 accumulators' bytes per call at `rows` rows a tile, N rows with a gradient:
    (fused, recompute before the vocabulary-ordered backward, recompute now)."""
    from gtpo_kernels.pipeline.head_backward import BackwardPlan, plan, traffic
    tiles = math.ceil(N / rows)
    whole = traffic(N, V, D, BackwardPlan(rows, V))
    return tiles * 2 * V * D * 4, whole, traffic(N, V, D, plan(N, V, rows))


def gpu_table(cfg=None):
    """Markdown: at each GPU size and budget, both schedules' predicted ms, auto's choice, the accumulators'
    GB (fused; recompute before -> now)."""
    from gtpo_kernels import GTPOConfig
    from gtpo_kernels.pipeline.schedule import predict
    cfg = cfg or GTPOConfig.preset("grpo")
    lines = ["| N x D x V (bf16, grpo) | budget | rows a tile | model ms fused / recompute | auto | accumulator GB "
             "fused | accumulator GB recompute (whole-row tiles -> by vocabulary) |", "|---|---|---|---|---|---|---|"]
    for N, D, V in GPU_SIZES:
        for budget in BUDGETS:
            rows = per_tile(V, 2, budget)
            m = predict(cfg, V, D, N, rows, 2)
            f, before, now = (x / 1e9 for x in accumulator_bytes(N, V, D, rows))
            lines.append(f"| {N} x {D} x {V} | {budget >> 20} MiB | {rows} | {m.fused:.1f} / {m.recompute:.1f} | "
                         f"{m.choice} | {f:.1f} | {before:.1f} -> {now:.1f} |")
    return "\n".join(lines)


def case_ms(case, provider):
    """The model's ms for `provider` ('fused' or 'recompute') on an accounting case, as if run on the GPU
    the model was fitted to (the case's sizes are small: launches dominate)."""
    from gtpo_kernels.pipeline.head import row_bytes
    from gtpo_kernels.pipeline.schedule import predict
    V, D = case.weight.shape
    rows = case.budget // row_bytes(V, case.weight.dtype, case.weight.device)
    m = predict(case.cfg, V, D, case.N, rows, case.weight.element_size(), N_nz=case.N_nz)
    value = getattr(m, provider)
    return None if value is None else round(value, 4)
