"""Vocabulary-parallel gtpo_loss (the vocabulary split over ranks): bytes communicated per token, and
time with 2 gloo ranks against 1 process on the CPU.

Bytes: every torch.distributed collective that gtpo_loss(..., process_group=pg) issues is counted in
each rank (the all-reduces that merge the per-slice statistics, per token; the one small all-gather of
shapes, per call), against what a trainer that all-gathers the logits moves instead: V x element size
per token (V = 151936 bf16: 303,872 bytes), independent of the world size (each rank receives
(W - 1) / W of that from the others and holds all of it).

Time: forward + backward of the `gtpo` preset without its entropy filter (torch backend) on `tokens` x V
float32 logits, in interleaved rounds (bench.runner.interleaved): each round runs the 2 gloo ranks of 1
thread each, each holding half the vocabulary (a step's time = the slower rank's), then rank 0 alone on
the whole vocabulary with 1 thread, then with 2 threads. Each figure is the median over the rounds with
its range; the speed-ups are per-round ratios, flagged unreliable by bench.runner's rule (range, load).
The 2-rank loss and each rank's gradient slice are checked against the one-process run.

    python -m bench.parallel                      # 1024 tokens x V = 32000 float32, 5 rounds
    python -m bench.parallel --tokens 512 --vocab 16000 --repeats 3

Prints a table and writes JSON (date, commit, machine, versions) into bench/out/ (git-ignored).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

from ..common import record

SIZES = (  # (label, V, element size) of the logits a trainer would all-gather
    ("V=32000 fp32", 32000, 4),
    ("V=128256 bf16 (Llama 3)", 128256, 2),
    ("V=151936 bf16 (Qwen 2.5/3)", 151936, 2),
    ("V=151936 fp32", 151936, 4),
)
ONE_PROCESS = {"1 rank": 1, "1 rank, 2 threads": 2}  # one process on the whole vocabulary: threads
G = 4        # completions per group
B = 8        # completions: tokens = B * T


def _inputs(tokens, vocab, seed=0):
    if tokens % B or tokens < B:
        raise ValueError(f"--tokens must be a positive multiple of {B}, got {tokens}")
    T = tokens // B
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, vocab, generator=g) * 2
    ids = torch.randint(0, vocab, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.1
    adv = torch.randn(B, generator=g)
    old = -torch.rand(B, T, generator=g) * 3 - 8
    return logits, ids, mask, adv, old


def _call(logits, ids, mask, adv, old, **kw):
    from gtpo_kernels import GTPOConfig, gtpo_loss
    # the gtpo preset without its entropy filter: random logits sit above ln 2 and every completion would
    # be dropped (loss 0); the entropies are still computed and shape the advantage
    cfg = GTPOConfig.preset("gtpo", entropy_threshold=None)
    return gtpo_loss(logits, ids, adv, mask, group_size=G, old_logps=old, config=cfg, backend="torch", **kw)


def _one_process(inp, threads):
    """One process on the whole vocabulary with `threads` threads: a forward+backward step."""
    logits = inp[0]

    def step():
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            x = logits.clone().requires_grad_()
            _call(x, *inp[1:]).loss.backward()
        finally:
            torch.set_num_threads(before)
    return step


def measure(tokens, vocab, repeats, warmup, group=None):
    """In every rank of an initialized process group (this rank's vocabulary slice): the bytes its
    collectives send, the rounds' times (ms: the 2-rank step, the slower rank's; rank 0 alone with 1 and
    2 threads), and its errors against one process."""
    import torch.distributed as dist
    from gtpo_kernels.distributed import agree
    pg = dist.group.WORLD if group is None else group
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    res = {}
    logits, ids, mask, adv, old = _inputs(tokens, vocab)
    size = vocab // world + (rank < vocab % world)
    start = sum(vocab // world + (r < vocab % world) for r in range(rank))
    part = logits[..., start:start + size].contiguous()
    counter = {"all_reduce": 0, "all_gather": 0}
    names = {"all_reduce": "all_reduce", "all_gather": agree.GATHER}  # the agreement's gather into one tensor
    real = {n: getattr(dist, names[n]) for n in counter}

    def count(name):
        def counted(*a, **k):
            t = a[0] if name == "all_reduce" else a[1]
            counter[name] += t.numel() * t.element_size()
            return real[name](*a, **k)
        return counted

    def step():
        x = part.clone().requires_grad_()
        out = _call(x, ids, mask, adv, old, process_group=pg)
        out.loss.backward()
        return out, x.grad

    for n in real:
        setattr(dist, names[n], count(n))
    try:
        out, grad = step()
    finally:
        for n in real:
            setattr(dist, names[n], real[n])
    res["all_reduce_bytes"], res["all_gather_bytes"] = counter["all_reduce"], counter["all_gather"]

    inp = (logits, ids, mask, adv, old)
    alone = {k: _one_process(inp, n) if rank == 0 else (lambda: None) for k, n in ONE_PROCESS.items()}
    from .runner import interleaved
    ts = interleaved({f"{world} ranks": step, **alone}, repeats, warmup,
                     before=lambda key: dist.barrier(group=pg))  # start together
    t = torch.tensor(ts[f"{world} ranks"], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)  # a step lasts as long as the slower rank
    res["rounds_ms"] = {f"{world} ranks": t.tolist(), **{k: ts[k] for k in ONE_PROCESS}}
    full = logits.clone().requires_grad_()  # the one-process answer, for the check
    one = _call(full, ids, mask, adv, old)
    one.loss.backward()
    ref = full.grad[..., start:start + size]
    res["loss_rel_err"] = float((out.loss.detach() - one.loss.detach()).abs() / one.loss.detach().abs().clamp(min=1))
    res["grad_rel_err"] = float((grad - ref).norm() / ref.norm().clamp(min=1e-30))
    res["grad_norm"] = float(ref.norm())
    res["loss"] = float(out.loss.detach())
    return res


def _worker(rank, world, init_file, out_dir, tokens, vocab, repeats, warmup):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        res = measure(tokens, vocab, repeats, warmup)
    except Exception:
        import traceback
        res = {"exception": traceback.format_exc()}
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def run(tokens=1024, vocab=32000, repeats=5, warmup=1, sizes=SIZES):
    import torch.multiprocessing as mp

    from .runner import load_record, load_snapshot
    world = 2
    before = load_snapshot(settle=True)
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, os.path.join(d, "init"), d, tokens, vocab, repeats, warmup),
                 nprocs=world, join=True)
        ranks = [json.load(open(os.path.join(d, f"{r}.json"))) for r in range(world)]
    for r, x in enumerate(ranks):
        if "exception" in x:
            raise RuntimeError(f"rank {r} failed:\n{x['exception']}")
    return summarize(ranks, tokens, vocab, repeats, warmup, load_record(before, load_snapshot()), sizes)


def summarize(ranks, tokens, vocab, repeats, warmup, load, sizes=SIZES):
    """The result of run() from the ranks' measure() (rank 0's rounds hold every timing)."""
    from .runner import RULE, per_round_ratio, summary, unreliable
    world = len(ranks)
    ours = max(x["all_reduce_bytes"] for x in ranks) / tokens
    rows = [dict(label=label, V=V, element_bytes=e, allgather_per_token=V * e, ours_per_token=ours,
                 ratio=V * e / ours) for label, V, e in sizes]
    rounds = ranks[0]["rounds_ms"]
    multi = f"{world} ranks"
    time = {k: dict(threads=ONE_PROCESS.get(k, 1), rounds_ms=t, **summary(t)) for k, t in rounds.items()}
    speedup = {k: per_round_ratio(rounds[k], rounds[multi]) for k in ONE_PROCESS}
    for v in speedup.values():
        v["unreliable"] = unreliable(v, load)
    return dict(
        suite="parallel", device="cpu", tokens=tokens, V=vocab, dtype="float32", preset="gtpo", backend="torch",
        completions=B, group_size=G, world=world, repeats=repeats, warmup=warmup, timing="interleaved rounds",
        rule=RULE, load=load, preset_overrides=dict(entropy_threshold=None),
        bytes=dict(ours_per_token=ours, shape_check_bytes_per_call=max(x["all_gather_bytes"] for x in ranks),
                   rows=rows),
        time=time, speedup_of_ranks_over=speedup,
        max_rel_err=max(max(x["loss_rel_err"], x["grad_rel_err"]) for x in ranks),
        min_grad_norm=min(x["grad_norm"] for x in ranks))


def table(res):
    from .report import load_line, ratio_cell
    b = res["bytes"]
    out = [f"Bytes communicated per token: gtpo_loss(process_group=...) vs all-gathering the logits "
           f"(measured at {res['tokens']} tokens x V = {res['V']}, 2 ranks; plus one shape check of "
           f"{b['shape_check_bytes_per_call']} bytes per call)",
           f"{'logits':<30}{'all-gather (V x e)':>20}{'ours':>8}{'ratio':>10}"]
    for r in b["rows"]:
        out.append(f"{r['label']:<30}{r['allgather_per_token']:>20,}{r['ours_per_token']:>8.0f}{r['ratio']:>9,.0f}x")
    out.append("")
    out.append(f"Forward + backward, {res['tokens']} tokens x V = {res['V']} {res['dtype']}, preset {res['preset']} "
               f"without its entropy filter, torch backend; median (min-max) of {res['repeats']} interleaved rounds "
               f"after {res['warmup']} warm-up")
    out.append(f"{'run':<22}{'threads/rank':>13}{'ms (min-max)':>26}")
    for k, t in res["time"].items():
        out.append(f"{k:<22}{t['threads']:>13}{t['median']:>10.1f} ({t['min']:.1f}-{t['max']:.1f})")
    for k, v in res["speedup_of_ranks_over"].items():
        out.append(f"{res['world']} ranks vs {k}: {ratio_cell(v)} faster (per round)")
    out.append(f"{res['world']}-rank loss and gradient slices vs one process: max rel. error {res['max_rel_err']:.1e}")
    out.append(load_line(res["load"]) + " " + res["rule"])
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.parallel", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024, help=f"tokens (a multiple of {B}: {B} completions)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size (split in halves over 2 ranks)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds before them")
    p.add_argument("--settle", type=float, default=60.0,
                   help="seconds to wait at most for an earlier run's load to decay (0: start at once)")
    p.add_argument("--out", default=record.SCRATCH,
                   help="folder for the JSON (bench/results/: only from a clean tree)")
    a = p.parse_args(argv)
    record.require_clean(a.out)  # before the run, not after
    from . import runner
    runner.SETTLE_S = a.settle
    res = run(a.tokens, a.vocab, a.repeats, a.warmup)
    print(table(res))
    path = record.write_json(res, a.out, prefix="parallel-")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
