"""python -m bench: speed, peak memory, saved bytes and bytes moved, side by side with the peers.

Default on a CPU machine: a small grid (its measured duration: DEFAULT_RUN below, also in --help); Triton
runs in its interpreter, counted for bytes at one small size, never timed. On CUDA, `--gpu-sizes` is the grid of the spec:
V in {32000, 128256, 151936, 262144} x tokens in {4096, 16384, 32768}, bf16.
The `linear` suite (`--suite linear`, also part of the default `all`) computes the loss from hidden states
and the LM head (N tokens x D x V): materialized logits + gtpo_loss, linear_gtpo_loss in each schedule,
TRL's ChunkedLogProbFunction + the same loss, Liger-Kernel's LigerFusedLinearGRPOLoss; default CPU point
1024,256,8192 (`--linear-size 4096,1024,32000` for the README's point); it writes linear-<device>-<date>.json,
latest-linear-<device>.json and linear-*.png.
Every suite times its implementations in interleaved rounds (A, B, C, A, B, C, ...) after warm-up rounds
and reports medians with their range, ratios per round, and the machine's load before and after; a ratio
whose rounds spread too far, or any ratio of a run on a loaded machine, is marked unreliable ('!').
Prints a table and writes <device>-<date>.json, latest-<device>.json and PNG plots into bench/out/
(git-ignored; `--out DIR` for another folder); `--save` writes them into bench/results/ instead, the
committed record the README quotes.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from .common import HelpFormatter, record

GPU_TOKENS = (4096, 16384, 32768)
CPU_LINEAR = "1024,256,8192"  # the linear suite's default point on a CPU (N,D,V)
GPU_VOCAB = (32000, 128256, 151936, 262144)
# the default run (`python -m bench` on a CPU machine), as measured; the start line and --help quote it
DEFAULT_RUN = ("the default run (python -m bench on a CPU, TRL and Liger-Kernel installed) took 7.5 min of wall clock "
               "and 3.5 min of CPU time on a 2-core AMD EPYC that other work kept at a 1-minute load of 4, and 17 min "
               "(4.3 min of CPU time) on a 2-core CPU at a load of 6 to 12; 2 min of each was waiting for the load to "
               "settle (up to 60 s before each suite; --settle 0: no wait)")


def _ints(text):
    return [int(x) for x in str(text).split(",") if x]


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0],
                                 formatter_class=HelpFormatter, epilog=f"Duration: {DEFAULT_RUN}")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="auto: CUDA when available (the GPU grid needs --gpu-sizes), else CPU")
    ap.add_argument("--tokens", default=None,
                    help="comma-separated token counts (B*T) (default: CPU 256,1024; CUDA 4096,16384,32768)")
    ap.add_argument("--vocab", default=None,
                    help="comma-separated vocabulary sizes (default: CPU 8192,32000; CUDA 32000,128256,151936,262144)")
    ap.add_argument("--gpu-sizes", action="store_true", help=f"tokens {GPU_TOKENS} x V {GPU_VOCAB}")
    ap.add_argument("--impls", default=None,
                    help="comma-separated: triton, triton-novalidate (validate=False), triton-grpo (the grpo preset, "
                         "validate=False: Liger's work), torch, eager, compile, liger (default: triton,torch,eager,"
                         "compile and, on CUDA, liger: Liger-Kernel's GRPO loss on logits is a GPU kernel)")
    ap.add_argument("--preset", default="gtpo", choices=("gtpo", "grpo"), help="loss preset (Liger: always grpo)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"), help="logits dtype")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed rounds, each running every implementation once (default: CPU 5; CUDA 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds before the timed ones")
    ap.add_argument("--modes", default=None,
                    help="any of fwd,bwd,full; fwd+bwd and fwd are timed in the same round, bwd is their difference "
                         "(default: CPU full,fwd; CUDA fwd,bwd,full)")
    ap.add_argument("--traffic-size", default="128x32000", help="TOKENSxV for the interpreter byte count")
    ap.add_argument("--no-traffic", action="store_true", help="skip the interpreter byte count")
    ap.add_argument("--no-aot", action="store_true", help="skip the ahead-of-time compile report (sm_90 / sm_80 / sm_100 / gfx942)")
    ap.add_argument("--no-memory", action="store_true", help="skip peak-memory measurement")
    ap.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    ap.add_argument("--check-only", action="store_true", help="only the correctness checks (exit 1 if any fails)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds for the sweep; sizes not started by then are reported as skipped "
                         "(default: no limit)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the benchmark inputs")
    ap.add_argument("--suite", default="all", choices=("all", "logits", "linear", "parallel", "head"),
                    help="logits: the loss from the logits (the grid above); linear: the loss from hidden states "
                         "and the LM head (N x D x V, see --linear-size); all: both; parallel: vocabulary-parallel "
                         "bytes per token and 2 gloo ranks against 1 on the CPU (python -m bench.parallel); head: "
                         "what one call of the fused LM head does outside its kernels, counted (tile passes, host "
                         "syncs, allocations, GEMM FLOPs; python -m bench.head_accounting, its own options)")
    ap.add_argument("--linear-size", action="append", default=None, metavar="N,D,V",
                    help="tokens, hidden size, vocabulary of a linear-suite problem; repeat the flag for more "
                         "(default: CPU 1024,256,8192; CUDA 4096,1024,151936). The README's CPU point: "
                         "--suite linear --linear-size 4096,1024,32000 --threads 2 (9 min on a 2-core CPU in its "
                         "committed record, longer on a loaded one)")
    ap.add_argument("--linear-impls", default="materialized,fused,recompute,trl,liger",
                    help="comma-separated: materialized, fused, recompute, trl, liger, liger-flce (Liger's fused "
                         "linear cross-entropy: not GRPO, checked against a float64 cross-entropy), replay, rebuild")
    ap.add_argument("--linear-tile", type=float, default=None,
                    help="MiB of logits projected at once by ours and TRL's (default: CPU 64; CUDA 256)")
    ap.add_argument("--linear-dtype", default=None, choices=("bfloat16", "float16", "float32"),
                    help="hidden and weight dtype (default: CPU float32; CUDA bfloat16)")
    ap.add_argument("--linear-warmup", type=int, default=1, help="untimed rounds of the linear suite")
    ap.add_argument("--parallel-tokens", type=int, default=1024, help="tokens of the parallel suite")
    ap.add_argument("--parallel-vocab", type=int, default=32000, help="vocabulary of the parallel suite")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads for this run and its memory child processes (default: torch's)")
    ap.add_argument("--settle", type=float, default=60.0, metavar="SECONDS",
                    help="before each suite, wait at most this long for an earlier run's load to decay "
                         "(default: 60; 0: start at once)")
    ap.add_argument("--save", action="store_true",
                    help="write the JSON and plots into bench/results/ (tracked: the record the README quotes); "
                         "refused while tracked files have uncommitted changes")
    ap.add_argument("--out", default=None,
                    help="folder for the JSON and the plots (default: bench/out/, git-ignored)")
    a = ap.parse_args(argv)
    if a.save and a.out is not None:
        ap.error("--save writes into bench/results/; give --save or --out DIR, not both")
    a.out = record.RESULTS if a.save else (a.out or record.SCRATCH)
    return a


def quiet_interpreter_overflow():
    """Triton's interpreter runs the kernels in numpy, which warns "overflow encountered in multiply" where
    a lane's running maximum still holds its start value (-FLT_MAX, the kernels' sentinel) and is scaled by
    log2(e): the product is -inf on purpose and exp2 of it is 0, as on a GPU, which overflows silently.
    The results are unaffected (every one is checked against the float64 reference), so the warning is
    hidden; any other warning still shows."""
    import warnings
    warnings.filterwarnings("ignore", message="overflow encountered in multiply", category=RuntimeWarning,
                            module="triton.runtime.interpreter")


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    if not a.check_only:
        record.require_clean(a.out)  # before minutes of measuring, not after
    quiet_interpreter_overflow()
    import torch
    device = a.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        # before triton is first imported: our Triton kernels then run in the interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from . import interpreter
    interpreter.install()  # the interpreter without its repeated patching (nothing unless TRITON_INTERPRET=1)
    if a.threads:
        torch.set_num_threads(a.threads)
    from .timing import report, runner
    runner.SETTLE_S = a.settle
    print(f"python -m bench --suite {a.suite} on {device}"
          + (f": {DEFAULT_RUN}" if _is_default(a, device) else
             (f"; each suite first waits up to {a.settle:g} s for the machine's load to settle (--settle 0: no wait)"
              if a.settle else "; no wait for the load to settle (--settle 0)")),
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    status = 0
    if a.suite == "parallel":
        from .timing import parallel
        sys.exit(parallel.main(["--out", a.out, "--tokens", str(a.parallel_tokens), "--vocab", str(a.parallel_vocab),
                                "--repeats", str(a.repeats or 5), "--warmup", str(min(a.warmup, 1)), "--settle", str(a.settle)]))
    if a.suite == "head":
        from .head_accounting.measure import main as head_main
        sys.exit(head_main(["--save"] if a.save else ["--out", a.out]))
    from .timing.providers import missing_peers
    for line in missing_peers():
        print(f"not compared in this run: {line}", flush=True)
    if a.suite in ("all", "logits"):
        status = max(status, _logits_suite(a, device, torch, report))
    if a.suite in ("all", "linear"):
        status = max(status, _linear_suite(a, device, torch, report))
    if a.suite == "all":
        print(f"\nboth suites: {time.perf_counter() - t0:.0f} s")
    sys.exit(status)


def _is_default(a, device):
    """Whether this is the run DEFAULT_RUN describes: both suites on the CPU at their default sizes."""
    return (device == "cpu" and a.suite == "all" and not (a.tokens or a.vocab or a.linear_size or a.repeats
                                                          or a.check_only or a.time_budget) and a.settle == 60)


def _record(a, report, res, prefix, plot_fn):
    """A suite's JSON (and latest-<prefix><device>.json) and plots into a.out, saying where they went."""
    path = record.write_json(res, a.out, prefix=prefix)
    print(f"\nresults: {os.path.relpath(path)} (and latest-{prefix}{res['device']}.json next to it)")
    if not a.no_plots:
        try:
            from .timing import plots
            for p in getattr(plots, plot_fn)(res, a.out, log=print):
                print(f"plot: {os.path.relpath(p)}")
        except ImportError as e:
            print(f"plots skipped: {e} (pip install matplotlib)")
    if not a.save:
        print(f"written to {os.path.relpath(a.out)}/ (not the committed bench/results/: pass --save for that)")


def _linear_suite(a, device, torch, report):
    """The loss from hidden states and the LM head; its own table, JSON (linear-<device>-<date>.json,
    latest-linear-<device>.json) and plots. Returns the exit status (1 when an implementation is wrong)."""
    from .timing.linear_suite import LinearSuite, parse_size, table
    sizes = [parse_size(s) for s in (a.linear_size or ([CPU_LINEAR] if device == "cpu"
                                                         else ["4096,1024,151936"]))]
    tile = a.linear_tile if a.linear_tile is not None else (64 if device == "cpu" else 256)
    suite = LinearSuite(device=device, impls=[x for x in a.linear_impls.split(",") if x], sizes=sizes,
                        dtype=getattr(torch, a.linear_dtype) if a.linear_dtype else None,
                        tile_bytes=int(tile * 2**20),
                        repeats=0 if a.check_only else (a.repeats or (5 if device == "cpu" else 10)),
                        warmup=0 if a.check_only else a.linear_warmup, seed=a.seed,
                        memory=not (a.no_memory or a.check_only), threads=a.threads)
    t0 = time.perf_counter()
    res = suite.run()
    res["wall_s"] = time.perf_counter() - t0
    print()
    print(table(res))
    bad = any(r["status"] == "wrong" for r in res["rows"])
    if a.check_only:
        return 1 if bad else 0
    _record(a, report, res, "linear-", "plot_linear")
    return 1 if bad else 0


def _logits_suite(a, device, torch, report):
    """The loss from the logits: the grid of tokens x V. Returns the exit status."""
    from .timing.logits_suite import Suite
    impls = [x for x in (a.impls or "triton,torch,eager,compile,liger").split(",") if x]
    if a.impls is None and device == "cpu":  # said once, not a row per size
        impls.remove("liger")
        print("not compared in this run: Liger-Kernel's GRPO loss on logits (triton_grpo_loss) needs CUDA; on the "
              "CPU, Liger-Kernel is compared in the linear suite (its fused linear GRPO loss)", flush=True)
    if a.gpu_sizes:
        tokens, vocab = list(GPU_TOKENS), list(GPU_VOCAB)
    else:
        tokens = _ints(a.tokens) if a.tokens else ([256, 1024] if device == "cpu" else list(GPU_TOKENS))
        vocab = _ints(a.vocab) if a.vocab else ([8192, 32000] if device == "cpu" else list(GPU_VOCAB))
    modes = tuple(a.modes.split(",")) if a.modes else (("full", "fwd") if device == "cpu" else ("fwd", "bwd", "full"))
    suite = Suite(device=device, impls=impls, sizes=[(t, v) for v in vocab for t in tokens], preset=a.preset,
                  dtype=getattr(torch, a.dtype), modes=modes,
                  repeats=a.repeats or (5 if device == "cpu" else 10), warmup=a.warmup, seed=a.seed,
                  traffic_size=None if a.no_traffic else tuple(int(x) for x in a.traffic_size.split("x")),
                  memory=not a.no_memory, check_only=a.check_only, time_budget=a.time_budget)
    t0 = time.perf_counter()
    results = suite.run()
    aot = None
    if not a.no_aot and not a.check_only:
        suite.progress("static GPU report: our kernels compiled for sm_90 / sm_80 / sm_100 / gfx942 (no GPU used; "
                       "--no-aot skips it)")
        from . import aot as aot_mod
        aot = aot_mod.report_in_subprocess() if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") \
            else aot_mod.report()
    results["aot"] = None if aot is None else [r.__dict__ for r in aot]
    results["wall_s"] = time.perf_counter() - t0
    print(report.table(results))
    if aot is not None:
        from .aot import format_table, summary_line
        print()
        if device == "cuda":
            print("Static GPU report (compiled ahead of time):")
            print(format_table(aot))
        else:  # a CPU run: one line; the full report is its own command
            print(summary_line(aot) + " (the rows: 'aot' in the JSON below)")
    if a.check_only:
        bad = [r for r in results["rows"] if r["status"] == "wrong"]
        return 1 if bad else 0
    _record(a, report, results, "", "plot")
    failed_aot = aot is not None and not all(r.ok for r in aot)
    return 1 if failed_aot or any(r["status"] == "wrong" for r in results["rows"]) else 0


if __name__ == "__main__":
    main()
