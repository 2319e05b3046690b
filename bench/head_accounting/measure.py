"""What one call of the fused LM head does outside its kernels, counted on the CPU (spec 11).

For one `linear_gtpo_loss` forward + backward per schedule ('fused', 'recompute'), and TRL's and
Liger-Kernel's heads at the same tile budget, a TorchDispatchMode sees every torch op and counts:

  tile passes   ops that read or write a logits tile or its gradient (a tensor with at least a tile's
                elements, or 2-D with the tile's vocabulary width as a dimension), by op and by shape;
                the floor is 3 per tile (fused) or 4 (recompute, TRL, Liger)
  host syncs    ops that read the device on the host: .item() (aten._local_scalar_dense), nonzero,
                boolean indexing, unique, bincount, repeat_interleave without a size, .tolist()
  over budget   tensors allocated with more bytes than memory_budget (and above half of it: the tile's share),
                besides those of last dimension D (weight, hidden, their gradients: counted as V x D allocs)
  V x D allocs  tensors of the head's size allocated (the weight gradient and its temporaries)
  GEMM FLOPs    2 M N K per mm / addmm / bmm, against the floor 2 V D (N + 2 N_nz) (fused) or
                2 V D (N + 3 N_nz): N counted tokens, N_nz those with a nonzero gradient coefficient
  per tile      N-sized allocations, N-sized ops and host syncs between the first and the last
                projection GEMM of a pass, divided by the tiles in between (the tile loop's own work)

The vocabulary kernels' work is not counted: ours run with backend='torch' and every
gtpo_kernels.kernels.dispatch.vocab_* call suspends the count (so do TRL's _forward_tile / _backward_tile,
its kernels' torch stand-ins); Liger's chunked loss is torch code throughout and counted whole.
A torch.library.custom_op (the head may run as one) is not counted as one op: its Python body runs
under the counter instead, so what it does inside is counted like the rest.
Caveats: a tensor whose last dimension is D is never a tile (so a tile of exactly D tokens, transposed,
is missed); partial tiles are recognized by their vocabulary width.

    python -m bench.head_accounting            # table on stdout, JSON in bench/out/ (--out DIR: elsewhere)
    python -m bench.head_accounting --save     # JSON in bench/results/head-accounting-after.json (clean tree)
    python -m bench.head_accounting --replay   # the head over the sampler's kept sets next to the full head
                                               # (replay.py, its own options and table)
Call from code: `measure(cases, providers, validate)` -> JSON-ready dict; `markdown(result)` -> table (table.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
from pathlib import Path

import torch

from ..common import record
from .counter import G, LIGER_TILE, PROVIDERS, TRL_TOKEN_CHUNK, Geometry, _ptr, count_call, our_kernels
from . import model
from .table import markdown

# ---- the cases -----------------------------------------------------------------------------------

CASES = {
    # name: (B, T, preset, config overrides, tiles wanted, head transforms)
    "default": (8, 72, "grpo", {}, 4, {}),
    "long": (4, 128, "gtpo", dict(entropy_threshold=None), 16, {}),
    "filtered": (8, 72, "gtpo", dict(entropy_threshold="median"), 4, {}),
    "transforms": (8, 72, "grpo", {}, 4, dict(bias=True, logit_scale=0.5, logit_softcap=30.0)),
    "zero_adv": (8, 72, "grpo", dict(zero_groups=1), 4, {}),
}
CASE_NOTES = {
    "default": "grpo preset, 4 tiles",
    "long": "gtpo preset (shaping: whole completions wanted), every completion about 4 tiles long",
    "filtered": "gtpo preset, entropy_threshold at the median completion entropy: half the completions dropped",
    "transforms": "grpo preset with bias, logit_scale=0.5, logit_softcap=30",
    "zero_adv": "grpo preset, one of the two groups of 4 with equal rewards (A = 0: half the completions "
                "have no gradient)",
}


@dataclasses.dataclass
class Case:
    name: str
    hidden: torch.Tensor  # (B, T, D), requires grad
    weight: torch.Tensor  # (V, D), requires grad
    bias: object  # (V,) requiring grad, or None
    ids: torch.Tensor
    mask: torch.Tensor
    adv: torch.Tensor
    old: torch.Tensor
    cfg: object
    lam: object  # conflict weights from conflict_weights (groups of G), or None
    n_conf: object
    scale: float
    cap: object
    budget: int  # memory_budget: a tile of `rows` tokens x V and its gradient, float32
    rows: int
    N: int  # counted tokens
    N_nz: int  # counted tokens with a nonzero gradient coefficient
    filtered_frac: float

    def wrt(self):
        return (self.hidden, self.weight) + (() if self.bias is None else (self.bias,))


def make_case(name, D=64, V=4096, seed=0) -> Case:
    """Random float32 inputs of a case (CASES), old log-probs = current + N(0, 0.1) noise (so the clip
    range is active), and the counted tokens whose gradient row is nonzero (from the materialized
    logits' gradient through gtpo_loss)."""
    from gtpo_kernels import GTPOConfig, conflict_weights, linear_token_logprobs
    B, T, preset, over, tiles, tf = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=gen)
    weight = torch.randn(V, D, generator=gen) * (2.0 / math.sqrt(D))
    bias = 0.1 * torch.randn(V, generator=gen) if tf.get("bias") else None
    lengths = T - (0.2 * T * torch.rand(B, generator=gen)).long()
    mask = torch.arange(T)[None, :] < lengths[:, None]
    ids = torch.where(mask, torch.randint(0, V, (B, T), generator=gen), 0)
    adv = torch.randn(B, generator=gen)
    over = dict(over)
    adv[:over.pop("zero_groups", 0) * G] = 0.0  # a group whose rewards were all equal
    scale, cap = tf.get("logit_scale", 1.0), tf.get("logit_softcap")
    logp, ent = linear_token_logprobs(hidden, weight, ids, completion_mask=mask, bias=bias, logit_scale=scale,
                                      logit_softcap=cap)
    old = torch.where(mask, logp + 0.1 * torch.randn(B, T, generator=gen), 0.0)
    if over.get("entropy_threshold") == "median":  # between the two middle completion entropies
        hbar = ((ent * mask).sum(1) / mask.sum(1)).sort().values
        over = {**over, "entropy_threshold": float(hbar[B // 2 - 1] + hbar[B // 2]) / 2}
    cfg = GTPOConfig.preset(preset, **over)
    lam, n_conf = conflict_weights(ids, mask, adv, G, config=cfg) if cfg.use_conflict_mask else (None, None)
    N = int(mask.sum())
    rows = math.ceil(N / tiles)
    case = Case(name, hidden, weight, bias, ids, mask, adv, old, cfg, lam, n_conf, scale, cap, 2 * rows * V * 4, rows,
                N, 0, 0.0)
    case.N_nz, case.filtered_frac = _nonzero_rows(case)
    for t in case.wrt():
        t.requires_grad_()
    return case


def _nonzero_rows(case):
    from gtpo_kernels import gtpo_loss
    z = case.hidden @ case.weight.t()
    z = (z if case.bias is None else z + case.bias) * case.scale
    z = (z if case.cap is None else case.cap * torch.tanh(z / case.cap)).requires_grad_()
    out = gtpo_loss(z, case.ids, case.adv, case.mask, old_logps=case.old, config=case.cfg, lam=case.lam,
                    n_conf=case.n_conf, backend="torch")
    g, = torch.autograd.grad(out.loss, z)
    return int(((g != 0).any(-1) & case.mask).sum()), float(out.metrics["filtered_frac"])


def provider_setup(case, provider, validate):
    """-> (run, geometry, kernels, planned tiles, note) of one head on a case; raises Unavailable."""
    from gtpo_kernels import gtpo_loss_from_logps, linear_gtpo_loss
    from ..timing.providers import Unavailable
    V, D = case.weight.shape
    pinned = (_ptr(case.hidden), _ptr(case.weight))
    geo = Geometry(V, D, (V,), case.rows * V, case.budget, tuple(case.mask.shape), case.N, pinned)
    tiles = math.ceil(case.N / case.rows)
    if provider in ("fused", "recompute"):
        def run():
            return linear_gtpo_loss(case.hidden, case.weight, case.ids, case.adv, case.mask, bias=case.bias,
                                    logit_scale=case.scale, logit_softcap=case.cap, memory_budget=case.budget,
                                    schedule=provider, old_logps=case.old, config=case.cfg, lam=case.lam,
                                    n_conf=case.n_conf, validate=validate, backend="torch").loss
        return run, geo, our_kernels(), tiles, f"tiles of {case.rows} tokens x {V}, backend='torch'"
    if provider == "trl":
        try:
            from trl.kernels import ChunkedLogProbFunction, chunked_logprob
        except Exception as e:  # noqa: BLE001
            raise Unavailable(f"trl not installed ({type(e).__name__})")
        n = min(case.N, TRL_TOKEN_CHUNK)
        chunk = max(1, min(V, case.budget // 2 // (n * 4)))  # its [n, chunk] tile: half the budget

        def run():
            m = case.mask
            lp, ent, *_ = ChunkedLogProbFunction.apply(case.hidden[m], case.weight, case.bias, case.ids[m],
                                                       float(case.cfg.temperature), chunk, case.cap, case.scale,
                                                       ("entropy",))
            logps, entropy = (x.new_zeros(m.shape).masked_scatter(m, x) for x in (lp, ent))
            return gtpo_loss_from_logps(logps, case.ids, case.adv, m, entropy=entropy, old_logps=case.old,
                                        config=case.cfg, lam=case.lam, n_conf=case.n_conf, validate=False).loss
        geo = dataclasses.replace(geo, widths=(chunk, V - (math.ceil(V / chunk) - 1) * chunk), tile_elems=n * chunk)
        kernels = [(chunked_logprob, "_forward_tile"), (chunked_logprob, "_backward_tile")]
        return run, geo, kernels, math.ceil(case.N / n) * math.ceil(V / chunk), \
            f"tiles of {n} tokens x {chunk}; its _forward_tile/_backward_tile not counted; our loss from its log-probs"
    if provider == "liger":
        if case.bias is not None or case.cap is not None or case.scale != 1.0:
            raise Unavailable("no logit_scale / logit_softcap in its API")
        from ..timing.linear import make_liger
        fn = make_liger(case.cfg, "cpu", case.budget // 2)
        rows, width = min(case.mask.shape[1], LIGER_TILE[0]), min(V, LIGER_TILE[1])
        geo = dataclasses.replace(geo, widths=(width, V - (math.ceil(V / width) - 1) * width), tile_elems=rows * width)
        B, T = case.mask.shape
        return (lambda: fn(case)), geo, [], B * math.ceil(T / rows) * math.ceil(V / width), \
            f"its own tiles of {rows} tokens x {width} (every position); all its torch ops counted"
    raise ValueError(f"provider must be one of {PROVIDERS}, got {provider!r}")


def measure_one(case, provider, validate):
    """One row of the table: the counts of one head on one case, with its floors."""
    from ..timing.providers import Unavailable
    row = dict(case=case.name, provider=provider, validate=validate if provider in ("fused", "recompute") else None,
               N=case.N, N_nz=case.N_nz, V=case.weight.shape[0], D=case.weight.shape[1],
               memory_budget=case.budget, filtered_frac=case.filtered_frac)
    try:
        run, geo, kernels, tiles, note = provider_setup(case, provider, validate)
        row.update(note=note, tiles_planned=tiles, tile_elems=geo.tile_elems, tile_widths=geo.widths)
        row.update(count_call(run, case.wrt(), geo, kernels))
        if provider in ("fused", "recompute"):  # the time model's prediction beside the counts (model.py)
            row["model_ms"] = model.case_ms(case, provider)
    except (Unavailable, ValueError, TypeError, RuntimeError) as e:  # e.g. a schedule refused on this case
        row.update(unavailable=f"{type(e).__name__}: {e}")
        return row
    k = 3 if provider == "fused" else 4
    V, D = row["V"], row["D"]
    row.update(tile_pass_floor=k * tiles, gemm_flops_floor=2 * V * D * (case.N + (k - 1) * case.N_nz))
    row["gemm_flops_over_floor"] = round(row["gemm_flops"] / row["gemm_flops_floor"], 3)
    return row


def auto_choice(case, rows):
    """The schedule schedule='auto' runs on `case`: the time model's choice for its options and sizes
    (pipeline.schedule.predict, before any logit is read), recompute where the fused schedule is refused."""
    from gtpo_kernels.pipeline.head import row_bytes
    from gtpo_kernels.pipeline.schedule import predict
    V, D = case.weight.shape
    fused_ok = not any(r["provider"] == "fused" and "unavailable" in r for r in rows)
    per_tile = case.budget // row_bytes(V, case.weight.dtype, case.weight.device)
    return predict(case.cfg, V, D, case.hidden[..., 0].numel(), per_tile, case.weight.element_size(),
                   fused_ok=fused_ok).choice


def measure(cases=tuple(CASES), providers=PROVIDERS, validate=(True, False), D=64, V=4096, seed=0):
    """-> {'meta': where and what was measured, 'rows': [measure_one rows]} (JSON-ready); our rows carry
    `auto`, the schedule schedule='auto' runs on that case."""
    rows = []
    for name in cases:
        case = make_case(name, D, V, seed)
        mine = []
        for p in providers:
            for v in (validate if p in ("fused", "recompute") else (False,)):
                mine.append(measure_one(case, p, v))
        choice = auto_choice(case, mine)
        for r in mine:
            if r["provider"] in ("fused", "recompute"):
                r["auto"] = choice
        rows += mine
    return dict(meta=meta(cases), rows=rows)


def meta(cases=tuple(CASES)):
    import gtpo_kernels
    src = Path(gtpo_kernels.__file__).resolve().parent
    versions = {"torch": torch.__version__}
    for mod in ("trl", "liger_kernel", "triton"):
        try:
            from importlib.metadata import version
            versions[mod] = version(mod.replace("_", "-"))
        except Exception:  # noqa: BLE001
            versions[mod] = None
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "") \
        if os.path.exists("/proc/cpuinfo") else platform.processor()
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                commit=(record.commit(src) or "").removesuffix("+dirty"), dirty=bool(record.tracked_changes(src)),
                gtpo_kernels=str(src), machine=f"{platform.platform()}; {cpu}; {os.cpu_count()} CPUs",
                versions=versions, cases={c: CASE_NOTES[c] for c in cases},
                counted="torch ops outside the vocabulary kernels, one forward + torch.autograd.grad, float32, CPU")


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.head_accounting",
                                description="Count what one call of the fused LM head does outside its kernels "
                                            "(forward + backward, CPU): tile passes, host syncs, allocations "
                                            "above the budget, GEMM FLOPs against their floor.",
                                epilog="--replay: the head over the sampler's kept sets instead, with its own options "
                                       "(python -m bench.head_accounting --replay --help)")
    p.add_argument("--cases", nargs="+", choices=tuple(CASES), default=list(CASES),
                   help="which inputs to count on (default: all: " + "; ".join(
                       f"{k}: {v}" for k, v in CASE_NOTES.items()) + ")")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS),
                   help="which heads to count: our two schedules, TRL's, Liger's (default: all)")
    p.add_argument("--validate", choices=("on", "off", "both"), default="both",
                   help="our heads' validate argument (default: both)")
    p.add_argument("--dim", type=int, default=64, help="hidden size D (default: 64)")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size V (default: 4096)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: 0)")
    p.add_argument("--label", default="after", help="name of the measurement, in the file name (default: after)")
    p.add_argument("--save", action="store_true",
                   help="write the JSON to bench/results/ (the committed record; only from a clean tree) instead "
                        "of bench/out/ (default: off)")
    p.add_argument("--out", default=None, help="folder for the JSON (default: bench/out/, git-ignored)")
    p.add_argument("--before", default=os.path.join(record.RESULTS, "head-accounting-before.json"),
                   help="an earlier JSON to show beside this one, if it exists and the label is not 'before' "
                        "(default: bench/results/head-accounting-before.json)")
    a = p.parse_args(argv)
    if a.save and a.out:
        p.error("--save writes into bench/results/; give --save or --out DIR, not both")
    folder = record.RESULTS if a.save else (a.out or record.SCRATCH)
    record.require_clean(folder)
    torch.set_num_threads(1)
    validate = {"on": (True,), "off": (False,), "both": (True, False)}[a.validate]
    result = measure(a.cases, a.providers, validate, a.dim, a.vocab, a.seed)
    result["meta"].update(label=a.label, command=" ".join(["python -m bench.head_accounting", *(argv or sys.argv[1:])]))
    record.require_clean(folder)
    out = Path(folder) / f"head-accounting-{a.label}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    before = None
    if a.label != "before" and os.path.exists(a.before):
        before = json.loads(Path(a.before).read_text())
    print(markdown(result, before))
    print("\nmodel ms (gtpo_kernels.pipeline.schedule.predict, fitted to the 2026-12-04 H200 record; predictions, "
          "not measurements) per row: " + "; ".join(f"{r['case']}/{r['provider']}: {r['model_ms']}" for r in
                                                   result["rows"] if r.get("model_ms") is not None))
    print("\nat the GPU record's sizes:\n" + model.gpu_table())
    print(f"\nwritten: {out}")


if __name__ == "__main__":
    main()
