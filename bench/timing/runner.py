"""The shared runner: time, load and saved bytes of one implementation on one problem (peak memory:
bench/timing/memory.py).

- time: every suite times its implementations in interleaved rounds (`interleaved`): after `warmup`
  untimed rounds, each of `rounds` rounds runs every implementation once (A, B, C, A, B, C, ...), so a
  change of the machine's load hits all of them alike. A figure is the median over the rounds with its
  range (min-max); a ratio between two implementations is computed per round, then summarized the same
  way (`summary`, `per_round_ratio`). The logits suite times forward+backward and forward in the same
  round; backward is their difference in that round. On CUDA each sample is the mean of enough
  synchronized calls to last ~20 ms.
- load: the load average and the core count, read before and after a suite (`load_snapshot`; before, it
  first waits up to SETTLE_S for an earlier run's load to decay); a ratio is flagged unreliable
  (`unreliable`) when its per-round range exceeds SPREAD_LIMIT of its median, or when other work shared the
  machine: the 1-minute load average exceeded LOAD_LIMIT x cores before the run, or (cores + LOAD_LIMIT x
  cores) after it (the run itself keeps up to every core busy, so its own load is not held against it),
  or when the row's median forward alone exceeds its slowest forward+backward round (`fwd_above_full`).
- tensors saved for backward, per token: `saved_tensors_hooks` records the storage of every saved
  tensor, counted once, except storage shared with the logits (saved by reference).
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time

import torch


MODES = ("fwd", "bwd", "full")
SPREAD_LIMIT = 0.25  # a ratio whose per-round range (max - min) exceeds 25% of its median is unreliable
LOAD_LIMIT = 0.5  # ... and every ratio of a run that shared the machine: 1-minute load above 0.5 x cores
# before it, or above cores + 0.5 x cores after it (the run's own threads account for up to the cores)
SETTLE_S = 60  # before a suite, wait up to this long for the load of an earlier run to decay
RULE = (f"'!' = unreliable: the per-round range exceeds {SPREAD_LIMIT:.0%} of the median, or other work shared "
        f"the machine (1-minute load average above {LOAD_LIMIT:g} x cores before the run, or above "
        f"{1 + LOAD_LIMIT:g} x cores after it, the run's own threads counting for up to the cores), or the row's "
        f"forward alone took longer than its slowest forward+backward round")
CUDA_SAMPLE_S = 0.02  # on CUDA a sample is the mean of enough calls to last this long


def is_oom(e: BaseException) -> bool:
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(e, RuntimeError) and ("out of memory" in str(e) or "can't allocate memory" in str(e))


def forward_backward(run, inp):
    out = run(inp)
    grad, = torch.autograd.grad(out[0], inp.logits)
    return out, grad


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ---- timing: interleaved rounds, medians with their range, per-round ratios ------------------------

def _say(msg):
    print(msg, file=sys.stderr, flush=True)


def load_snapshot(settle=False, log=_say) -> dict:
    """The 1, 5 and 15-minute load averages and the core count, now; settle: first wait up to SETTLE_S
    for the 1-minute load to fall below LOAD_LIMIT x cores (an earlier suite's own load decaying), saying
    so through `log` when it waits."""
    cores = os.cpu_count()
    limit = LOAD_LIMIT * cores
    start = time.monotonic()
    deadline = start + (SETTLE_S if settle else 0)
    waited = False
    while os.getloadavg()[0] > limit and time.monotonic() < deadline:
        if not waited:
            log(f"waiting up to {SETTLE_S:g} s for the 1-minute load average ({os.getloadavg()[0]:.2f}) to fall "
                f"below {limit:g} ({LOAD_LIMIT:g} x {cores} cores), so that other work does not skew the times "
                f"(--settle 0: start at once)")
            waited = True
        time.sleep(2)
    now = os.getloadavg()[0]
    if waited:
        log(f"load {now:.2f} after {time.monotonic() - start:.0f} s: "
            + ("starting" if now <= limit else "starting anyway (every time ratio of this run will be flagged "
                                                "unreliable)"))
    return dict(load_average=[round(x, 2) for x in os.getloadavg()], cores=cores)


def load_record(before: dict, after: dict) -> dict:
    """The JSON's `load` field: before and after a suite, and whether other work shared the machine
    (before above LOAD_LIMIT x cores, or after above (1 + LOAD_LIMIT) x cores)."""
    cores = before["cores"]
    loaded = before["load_average"][0] > LOAD_LIMIT * cores or after["load_average"][0] > (1 + LOAD_LIMIT) * cores
    return dict(cores=cores, before=before["load_average"], after=after["load_average"],
                limit=LOAD_LIMIT * cores, limit_after=(1 + LOAD_LIMIT) * cores, loaded=loaded)


def summary(xs) -> dict:
    """{'median', 'min', 'max', 'spread' ((max - min) / median)} of per-round values."""
    xs = [float(x) for x in xs]
    med = statistics.median(xs)
    return dict(median=med, min=min(xs), max=max(xs),
                spread=(max(xs) - min(xs)) / abs(med) if med else math.inf)


def per_round_ratio(xs, ys) -> dict:
    """summary() of x / y round by round (both lists from the same interleaved rounds)."""
    return summary([x / y for x, y in zip(xs, ys)])


def unreliable(ratio: dict, load: dict, row: dict | None = None) -> bool:
    """The rule above; also every ratio of a row whose forward alone came out slower than its
    forward+backward (`fwd_above_full`): noise, not a measurement."""
    return (ratio["spread"] > SPREAD_LIMIT or bool(load and load.get("loaded"))
            or bool(row and row.get("fwd_above_full")))


def fwd_above_full(rounds: dict) -> bool:
    """True when the median forward-only time exceeds the slowest forward+backward round: the rounds
    cannot be trusted (a forward is part of every forward+backward)."""
    fwd, full = rounds.get("fwd"), rounds.get("full")
    return bool(fwd and full) and statistics.median(fwd) > max(full)


def interleaved(steps: dict, rounds: int, warmup: int, device="cpu", on_error=None, before=None,
                progress=None) -> dict:
    """{key: [ms per round]}: `warmup` untimed rounds, then `rounds` rounds in each of which every step
    runs once, in the order given (before(key), when given, runs untimed just before each). A step that
    raises is dropped (on_error(key, exception) is told). progress(msg), when given, hears of each round
    that took longer than LONG_ROUND_S (a large problem's rounds take minutes on a CPU)."""
    steps, times = dict(steps), {k: [] for k in steps}
    calls = {k: 1 for k in steps}
    t_run = time.perf_counter()
    for k in range(warmup + rounds):
        t_round = time.perf_counter()
        _one_round(steps, times, calls, k >= warmup, device, on_error, before)
        if progress is not None and time.perf_counter() - t_round > LONG_ROUND_S:  # long rounds: say the next
            nxt = (f"now round {k + 2}/{warmup + rounds} ({'warm-up' if k + 1 < warmup else 'timed'})"
                   if k + 1 < warmup + rounds else "timing done")
            progress(f"round {k + 1}/{warmup + rounds} took {time.perf_counter() - t_round:.0f} s "
                     f"({time.perf_counter() - t_run:.0f} s so far); {nxt}")
    return times


LONG_ROUND_S = 10.0


def _one_round(steps, times, calls, timed, device, on_error, before):
    """Every step once (interleaved's round): its time appended to times[key] when `timed`."""
    for key, fn in list(steps.items()):
        try:
            if before is not None:
                before(key)
            sync(device)
            t0 = time.perf_counter()
            for _ in range(calls[key]):
                fn()
            sync(device)
            dt = (time.perf_counter() - t0) / calls[key]
        except Exception as e:
            del steps[key], times[key]
            if on_error is not None:
                on_error(key, e)
            continue
        if timed:
            times[key].append(1e3 * dt)
        elif torch.device(device).type == "cuda":  # calibrate: a sample lasts ~CUDA_SAMPLE_S
            calls[key] = max(1, int(CUDA_SAMPLE_S / max(dt, 1e-6)))


def step_fns(run, inp, modes):
    """The callables timed for `modes` of one implementation: 'full' (forward+backward) and 'fwd'; 'bwd'
    is derived per round (full - fwd), so asking for it times both."""
    z = inp.logits
    fns = {}
    if "full" in modes or "bwd" in modes:
        fns["full"] = lambda: torch.autograd.grad(run(inp)[0], z)
    if "fwd" in modes or "bwd" in modes:
        fns["fwd"] = lambda: run(inp)
    return fns


def mode_times(ts: dict, modes) -> dict:
    """{mode: [ms per round]} from the timed 'full' and 'fwd' rounds; bwd = full - fwd per round."""
    out = {m: ts[m] for m in ("full", "fwd") if m in modes and m in ts}
    if "bwd" in modes and "full" in ts and "fwd" in ts:
        out["bwd"] = [a - b for a, b in zip(ts["full"], ts["fwd"])]
    return out


def saved_bytes(run, inp) -> int:
    """Bytes of the distinct storages saved for backward by one forward, the logits' excluded."""
    logits_storage = inp.logits.untyped_storage().data_ptr()
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() != logits_storage:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run(inp)
    del out
    return sum(seen.values())
