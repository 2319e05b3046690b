"""The LM head over the sampler's kept sets, counted next to the full-vocabulary head on the same inputs
(`python -m bench.head_accounting --replay`; spec 11 and 13).

Inputs: bench.timing.linear.kept_inputs, a head whose own logits are peaked as a trained policy's, each
counted token's kept set drawn from them as vLLM's sampler keeps it (top_k = 512, then top_p = 0.95) and
its id drawn from the set; the `grpo` preset with old log-probs (the replayed ones + noise for the kept-set
heads, the full-vocabulary ones + the same noise for the full heads), float32, CPU, backend='torch'. The
full heads get a memory_budget of `tiles` tiles of rows x V (logits and gradient); the kept-set heads get
the same budget, which pipeline.head_replay.plan_union fills with rows x min(sum of the sets' sizes, V).

Heads: 'fused' and 'recompute' (measure.measure_one, the main table's rows); 'replay' (sampling_mask:
each tile projects its union U, forward 1 GEMM, backward 3); 'rebuild' (top_k / top_p: the forward
projects full-V tiles and rebuilds the sets there, the backward runs 3 GEMMs over each union).

Counted (measured on the CPU, counter.HeadCounter over one forward + torch.autograd.grad):
  GEMM FLOPs    2 M N K of every mm / addmm, forward and backward, the gathered weight W[U] included
  tile passes   ops reading or writing a tile (rows x V, or a planned replay tile rows x |U|); the vocabulary
                kernels (dispatch.vocab_*, replay_torch.replay_fwd / replay_bwd) are suspended, the
                rebuild's kept_sets (torch's topk, sort, softmax, cumsum over full-V blocks) is counted
  rows gathered / scattered   rows of D-wide tensors read or written by index (W[U], hidden's tile rows,
                dW[U], dh's rows): the replay head's extra memory traffic, |U| D elements per gather
  host syncs    as in the main table
  peak          the CPU allocator's high-water mark over the call (counter.peak_bytes: the profiler's
                allocation events), above the inputs, the returned gradients included
Modeled (from the inputs and the plan, not measured):
  GEMM FLOPs    fused 2 V D (N + 2 N_nz), recompute 2 V D (N + 3 N_nz) (N_nz: rows with a gradient: the
                full heads skip the others), replay sum over tiles of 8 rows |U| D (no row skipped),
                rebuild 2 N V D + sum over tiles of 6 rows |U| D
  peak          the largest tile and its gradient (8 B an entry) + the returned gradients (N_all D and
                V D, float32): what the memory model of spec 11 bounds; gathers and temporaries aside

    python -m bench.head_accounting --replay                       # N 1024, D 64, V 32000: table, JSON in bench/out/
    python -m bench.head_accounting --replay --vocab 151936 --tiles 16
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from ..common import record
from .counter import Geometry, _ptr, count_call, our_kernels, peak_bytes

PROVIDERS = ("fused", "recompute", "replay", "rebuild")
SIZE = (1024, 64, 32000)  # N (B x T positions), D, V
TILES = 4  # the full head's tiles at the budget


def replay_kernels():
    """Our vocabulary kernels (suspended, as in the main table), the replay's too."""
    from gtpo_kernels.kernels import replay_torch
    return our_kernels() + [(replay_torch, "replay_fwd"), (replay_torch, "replay_bwd")]


def make(N=SIZE[0], D=SIZE[1], V=SIZE[2], tiles=TILES, seed=0):
    """(inputs, measure.Case on them for the full heads) with the budget of `tiles` full tiles."""
    from gtpo_kernels import GTPOConfig
    from ..timing import linear
    from .measure import Case, _nonzero_rows
    inp = linear.kept_inputs(N, D, V, torch.float32, "cpu", seed)
    n = inp.counted
    rows = math.ceil(n / tiles)
    case = Case("kept_sets", inp.hidden, inp.weight, None, inp.ids, inp.mask, inp.adv, inp.old,
                GTPOConfig.preset("grpo"), None, None, 1.0, None, 2 * rows * V * 4, rows, n, 0, 0.0)
    case.N_nz, case.filtered_frac = _nonzero_rows(case)
    return inp, case


def plan(inp, budget):
    """The replay head's tiles on inp's sets: [(m0, m1, |U|)] (pipeline.head_replay.plan_union)."""
    from gtpo_kernels.pipeline.head import row_bytes
    from gtpo_kernels.pipeline.head_replay import plan_union
    token_ids, offsets = inp.sampling_mask
    off = offsets.tolist()
    tiles = plan_union([e - s for s, e in zip(off[:-1], off[1:])], inp.V, row_bytes(1, torch.float32, "cpu"), budget)
    return [(m0, m1, torch.unique(token_ids[off[m0]:off[m1]]).numel()) for m0, m1 in tiles]


def model_flops(provider, N, N_nz, V, D, tiles):
    """The modeled GEMM FLOPs of the module's docstring."""
    union = sum((m1 - m0) * u for m0, m1, u in tiles)
    return {"fused": 2 * V * D * (N + 2 * N_nz), "recompute": 2 * V * D * (N + 3 * N_nz),
            "replay": 8 * union * D, "rebuild": 2 * N * V * D + 6 * union * D}[provider]


def run_of(inp, case, provider, validate=True):
    """loss = run() of one head on the inputs."""
    from gtpo_kernels import linear_gtpo_loss
    from ..timing.linear import TOP_K, TOP_P
    if provider in ("fused", "recompute"):
        kw = dict(schedule=provider, old_logps=inp.old)
    elif provider == "replay":
        kw = dict(sampling_mask=inp.sampling_mask, old_logps=inp.old_kept)
    else:
        kw = dict(top_k=TOP_K, top_p=TOP_P, old_logps=inp.old_kept)
    return lambda: linear_gtpo_loss(inp.hidden, inp.weight, inp.ids, inp.adv, inp.mask, config=case.cfg,
                                    memory_budget=case.budget, validate=validate, backend="torch", **kw).loss


def measure_one(inp, case, provider, validate=True):
    """One row: the counts, the model and the peak of one head."""
    from . import measure
    V, D = inp.V, inp.D
    tiles = plan(inp, case.budget)
    if provider in ("fused", "recompute"):
        row = measure.measure_one(case, provider, validate)
        row.update(tiles_forward=row.get("tiles_planned"), tile_shape=f"{case.rows} x {V}")
    else:
        full_rows = case.budget // (8 * V)
        fwd = math.ceil(case.N / full_rows) if provider == "rebuild" else len(tiles)
        shapes = tuple({(m1 - m0, u) for m0, m1, u in tiles})
        geo = Geometry(V, D, (V,) if provider == "rebuild" else (),
                       full_rows * V if provider == "rebuild" else max(r * u for r, u in shapes),
                       case.budget, tuple(inp.mask.shape), case.N, (_ptr(inp.hidden), _ptr(inp.weight)), shapes)
        row = dict(case=case.name, provider=provider, validate=validate, N=case.N, N_nz=case.N_nz, V=V, D=D,
                   memory_budget=case.budget, tiles_planned=len(tiles), tiles_forward=fwd,
                   tile_shape=(f"forward {min(full_rows, case.N)} x {V}; backward " if provider == "rebuild" else "")
                   + f"~{sum(m1 - m0 for m0, m1, _ in tiles) / len(tiles):.0f} x ~"
                   + f"{sum(u for *_, u in tiles) / len(tiles):.0f} (union)")
        row.update(count_call(run_of(inp, case, provider, validate), (inp.hidden, inp.weight), geo, replay_kernels()))
    row["model_flops"] = model_flops(provider, case.N, case.N_nz, V, D, tiles)
    largest = max((m1 - m0) * u for m0, m1, u in tiles) if provider == "replay" else case.rows * V
    n_all = inp.mask.numel()
    row["modeled_peak_bytes"] = 8 * largest + 4 * (n_all * D + V * D)
    row["peak_bytes"], row["end_bytes"], row["grad_bytes"] = peak_bytes(run_of(inp, case, provider, validate),
                                                                       (inp.hidden, inp.weight))
    return row


def measure(N=SIZE[0], D=SIZE[1], V=SIZE[2], tiles=TILES, providers=PROVIDERS, validate=True, seed=0):
    """-> {'sets': the kept sets and unions, 'rows': [one per head]} (JSON-ready)."""
    from ..timing.linear import set_stats
    inp, case = make(N, D, V, tiles, seed)
    plan_ = plan(inp, case.budget)
    sets = set_stats(*inp.sampling_mask, V, [(m0, m1) for m0, m1, _ in plan_])
    rows = [measure_one(inp, case, p, validate) for p in providers]
    by = {r["provider"]: r for r in rows}
    for r in rows:
        for ref in ("fused", "recompute"):
            if "gemm_flops" in r and "gemm_flops" in by.get(ref, {}):
                r[f"flops_vs_{ref}"] = r["gemm_flops"] / by[ref]["gemm_flops"]
    return dict(size=dict(N=N, D=D, V=V, counted=case.N, N_nz=case.N_nz, full_tiles=tiles,
                          memory_budget=case.budget, validate=validate), sets=sets, rows=rows)


def _mib(b):
    return f"{b / 2**20:.1f}"


def markdown(result):
    """The table of one measure() result, with the lines that say what is counted and what modeled."""
    z, st = result["size"], result["sets"]
    head = ["head", "tiles (fwd, bwd)", "tile (rows x columns)", "GEMM MFLOP counted (fwd + bwd)", "modeled",
            "vs recompute", "vs fused", "tile passes", "W, h rows gathered / scattered", "host syncs",
            "peak MiB counted (modeled)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        if "unavailable" in r:
            lines.append("| " + " | ".join([r["provider"], "n/a"] + ["-"] * (len(head) - 2)) + " |")
            continue
        bwd = r["tiles_planned"] if r["provider"] != "fused" else "-"
        g, s = r["rows_gathered"], r["rows_scattered"]
        cells = [r["provider"], f"{r['tiles_forward']}, {bwd}", r["tile_shape"],
                 f"{r['gemm_flops'] / 1e6:.0f} ({r['gemm_flops_forward'] / 1e6:.0f} + "
                 f"{r['gemm_flops_backward'] / 1e6:.0f})", f"{r['model_flops'] / 1e6:.0f}",
                 f"{r.get('flops_vs_recompute', float('nan')):.3f}", f"{r.get('flops_vs_fused', float('nan')):.3f}",
                 str(r["tile_passes"]), f"{g['forward'] + g['backward']} / {s['forward'] + s['backward']}",
                 str(r["host_syncs"]), f"{_mib(r['peak_bytes'])} ({_mib(r['modeled_peak_bytes'])})"]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [
        "",
        f"N = {z['counted']} counted tokens ({z['N_nz']} with a gradient) of {z['N']} positions, D = {z['D']}, "
        f"V = {z['V']}, memory_budget {z['memory_budget']} B ({z['full_tiles']} full tiles), float32, CPU, "
        f"backend='torch', validate {'on' if z['validate'] else 'off'}.",
        f"Kept sets (top_k 512, top_p 0.95 from the peaked head's own logits): |K_t| mean {st['mean_kept']:.1f}, "
        f"median {st['median_kept']:.0f}, p90 {st['p90_kept']:.0f}, max {st['max_kept']}; {st['tiles']} replay "
        f"tile(s) of ~{st['mean_rows']:.0f} tokens, |U| mean {st['mean_union']:.0f} (max {st['max_union']}) = "
        f"{st['union_over_V']:.3f} V; sum |K_t| / |U| = {st['sum_kept_over_union']:.2f}.",
        "Counted on the CPU (a TorchDispatchMode over one forward + backward): GEMM MFLOP, tile passes, rows "
        "gathered / scattered, host syncs; peak: the allocator's high-water mark (profiler allocation events), "
        "above the inputs, the returned gradients included. Modeled: the 'modeled' FLOPs (fused 2VD(N + 2 N_nz), "
        "recompute 2VD(N + 3 N_nz), replay sum 8 rows |U| D, rebuild 2NVD + sum 6 rows |U| D) and the peak in "
        "parentheses (largest tile + its gradient, 8 B an entry, + the gradients of hidden and weight).",
    ]
    return "\n".join(lines + notes)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.head_accounting --replay",
                                description="Count the LM head over the sampler's kept sets (sampling_mask, and "
                                            "top_k / top_p rebuilt) next to the full head's two schedules on one "
                                            "peaked input (forward + backward, CPU): GEMM FLOPs against their model, "
                                            "tile passes, rows gathered, host syncs, peak bytes.")
    p.add_argument("--tokens", type=int, default=SIZE[0], help=f"positions N = B x T (default: {SIZE[0]})")
    p.add_argument("--dim", type=int, default=SIZE[1], help=f"hidden size D (default: {SIZE[1]})")
    p.add_argument("--vocab", type=int, default=SIZE[2], help=f"vocabulary size V (default: {SIZE[2]})")
    p.add_argument("--tiles", type=int, default=TILES,
                   help=f"the full head's tiles at the memory_budget every head gets (default: {TILES})")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS),
                   help="which heads to count (default: all)")
    p.add_argument("--validate", choices=("on", "off"), default="on", help="the heads' validate (default: on)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (default: 0)")
    p.add_argument("--label", default="after", help="name of the measurement, in the file name (default: after)")
    p.add_argument("--save", action="store_true", help="write the JSON to bench/results/ (clean tree only) instead "
                                                       "of bench/out/ (default: off)")
    p.add_argument("--out", default=None, help="folder for the JSON (default: bench/out/, git-ignored)")
    a = p.parse_args(argv)
    if a.save and a.out:
        p.error("--save writes into bench/results/; give --save or --out DIR, not both")
    from .measure import meta
    folder = record.RESULTS if a.save else (a.out or record.SCRATCH)
    record.require_clean(folder)
    torch.set_num_threads(1)
    result = measure(a.tokens, a.dim, a.vocab, a.tiles, a.providers, a.validate == "on", a.seed)
    result["meta"] = dict(meta(()), label=a.label,
                          command=" ".join(["python -m bench.head_accounting --replay", *(argv or sys.argv[1:])]),
                          counted="torch ops outside the vocabulary and replay kernels, one forward + "
                                  "torch.autograd.grad, float32, CPU, 1 thread; peak: profiler allocation events")
    record.require_clean(folder)
    out = Path(folder) / f"head-accounting-replay-{a.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(markdown(result))
    print(f"\nwritten: {out}")
