"""Tests only: run a function on W gloo processes on the CPU and collect what each rank returns.

With a watchdog (run_ranks(..., watchdog=seconds)) a hang fails the test instead of blocking it: every
rank reports its progress (`progress`) and can wait for the others outside torch.distributed (`sync`,
a barrier on files: a rank that raised stays alive there, as a trainer that logged its error would, so
that a peer stuck in a collective stays stuck and shows as a hang); when no rank progresses for
`watchdog` seconds, the processes are killed and the test fails naming each rank's last step."""
import importlib
import json
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STARTUP_S = 120  # spawning and importing on a loaded 2-core machine, before the watchdog applies
# The ranks start from a fork server (one per test process: a fresh interpreter that imported torch and ran
# nothing), not each a fresh interpreter importing torch again (seconds each on a loaded machine). The
# package is not preloaded: each rank imports it under the caller's environment as it is at the call
# (run_ranks passes it; a test's monkeypatched variable reaches the ranks, as with spawn).
START = "forkserver"
PRELOAD = ["torch", "torch.distributed"]


def rel_nan(a, b):
    """A rank's output against one process's: inf unless NaN stands at the same places, else the largest
    difference over max(|b|, 1)."""
    a, b = a.double(), b.double()
    if not torch.equal(torch.isnan(a), torch.isnan(b)):
        return float("inf")
    a, b = torch.nan_to_num(a), torch.nan_to_num(b)
    return float((a - b).abs().max() / b.abs().clamp(min=1).max()) if a.numel() else 0.0


def _rank(rank, world, init_file, out_dir, fn, environ):
    os.environ.clear()
    os.environ.update(environ)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    module, name = fn
    fn = getattr(importlib.import_module(module), name)
    from bench import interpreter
    interpreter.install()
    os.environ["GLOO_TEST_DIR"] = out_dir
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    progress("started")
    try:
        res = fn(rank, world)
    except Exception:
        res = {"exception": traceback.format_exc()}
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(res, f)
    progress("finished")
    dist.destroy_process_group()


def progress(note):
    """Record this rank's latest step (for the watchdog's report)."""
    path = os.path.join(os.environ["GLOO_TEST_DIR"], f"{dist.get_rank()}.progress")
    with open(path, "a") as f:
        f.write(f"{note}\n")


def record(key, value):
    """Keep this rank's outcome of one case (JSON-able) where run_ranks(..., partial=True) finds it even
    when a later case hangs and the watchdog ends the ranks."""
    with open(os.path.join(os.environ["GLOO_TEST_DIR"], f"{dist.get_rank()}.records"), "a") as f:
        f.write(json.dumps([key, value]) + "\n")


def _records(d, r):
    try:
        with open(os.path.join(d, f"{r}.records")) as f:
            return dict(json.loads(line) for line in f)
    except FileNotFoundError:
        return {}


def sync(tag):
    """Wait until every rank has reached sync(tag) (files, not a collective: a rank stuck in a collective
    keeps the others waiting here, alive, until the watchdog ends them)."""
    d, rank, world = os.environ["GLOO_TEST_DIR"], dist.get_rank(), dist.get_world_size()
    tag = "".join(c if c.isalnum() else "_" for c in tag)
    open(os.path.join(d, f"sync.{tag}.{rank}"), "w").close()
    progress(f"waiting at {tag}")
    while not all(os.path.exists(os.path.join(d, f"sync.{tag}.{r}")) for r in range(world)):
        time.sleep(0.01)


def _snapshot(d, world):
    out = []
    for r in range(world):
        try:
            with open(os.path.join(d, f"{r}.progress")) as f:
                out.append(f.read().splitlines())
        except FileNotFoundError:
            out.append([])
    return out


def _watch(ctx, d, world, watchdog):
    """Join the ranks; kill them and fail when no rank reports progress for `watchdog` seconds."""
    seen, last = None, time.monotonic()
    while not ctx.join(timeout=0.2):
        now, state = time.monotonic(), _snapshot(d, world)
        if state != seen:
            seen, last = state, now
        started = all(state) and all(lines[0] == "started" for lines in state)
        if now - last > (watchdog if started else STARTUP_S):
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            last_steps = {r: (lines[-1] if lines else "not started") for r, lines in enumerate(state)}
            raise AssertionError(f"hang: no rank progressed for {watchdog} s; each rank's last step: {last_steps}")


def run_ranks(fn, world, watchdog=None, partial=False):
    """fn(rank, world) -> a JSON-able dict, run on every rank of a fresh gloo group (fn must be a module-level
    function); returns the ranks' dicts in rank order, {'exception': traceback} where one raised. With
    `watchdog` (seconds), a rank that makes no progress that long fails the test as a hang; with `partial`
    too, a hang returns instead each rank's `record`ed cases and 'hang': the watchdog's message."""
    import multiprocessing
    multiprocessing.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as d:
        # fn by name, imported by the rank once the caller's environment is in place
        args = (world, os.path.join(d, "init"), d, (fn.__module__, fn.__qualname__), dict(os.environ))
        try:
            if watchdog is None:
                mp.start_processes(_rank, args=args, nprocs=world, join=True, start_method=START)
            else:
                _watch(mp.start_processes(_rank, args=args, nprocs=world, join=False, start_method=START), d,
                       world, watchdog)
        except AssertionError as hang:
            if not partial:
                raise
            return [dict(_records(d, r), hang=str(hang)) for r in range(world)]
        except mp.ProcessExitedException:
            # a rank killed by a signal after every rank wrote its result: gloo's own teardown at exit
            # ("terminate called without an active exception", seen on a loaded machine), not the test's
            # subject; a rank that died before its result still fails the test
            if not all(os.path.exists(os.path.join(d, f"{r}.json")) for r in range(world)):
                raise
        return [json.load(open(os.path.join(d, f"{r}.json"))) for r in range(world)]


def run_ranks_ok(fn, world, **kw):
    """run_ranks(fn, world, **kw), failing the test with the rank's traceback where a rank raised: for the
    tests whose ranks catch the errors they expect and return every other outcome."""
    results = run_ranks(fn, world, **kw)
    for r, res in enumerate(results):
        assert "exception" not in res, f"rank {r} raised:\n{res['exception']}"
    return results
