"""Peak memory of one forward + backward above the inputs, for every suite.

CUDA: `max_memory_allocated` minus what was allocated before (`cuda_peak_bytes`). CPU: a fresh
subprocess per implementation (`child_peaks`) that, for each size, resets the kernel's high-water mark of
its resident size (/proc/self/clear_refs) after a warm-up and reads VmHWM after one forward + backward;
glibc is told to give large blocks back to the system (MALLOC_MMAP_THRESHOLD_), and its free pages before
each measured step (malloc_trim), so freed tensors do not hide in the heap (small steps measured 0 without).
`python -m bench.timing.memory` is the logits suite's child (`python -m bench.memory` too).
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys

import torch

from . import providers
from .inputs import make_inputs
from ..common.record import ROOT
from .runner import forward_backward, is_oom


def cuda_peak_bytes(step) -> int:
    """Peak CUDA memory above what is allocated before `step()` runs (its result is kept alive until the
    peak is read)."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    kept = step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del kept
    return peak


# ---- CPU peak memory: one child process per implementation --------------------------------------

def _status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _release_free_memory():
    """Hands the allocator's free pages back to the system (glibc's malloc_trim), so that a step's
    allocations show in the resident size even where the warm-up's freed memory would have held them."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the peak may then under-count memory reused
        pass


def _reset_hwm():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident size to the current one (Linux >= 4.0)


def measure_peaks(make_run, sizes, inputs_for, step, key_of, excess=lambda inp: 0) -> dict:
    """In a memory child: for each size, inputs, a warm-up step, then one measured. Returns {key: bytes
    of the peak resident size above the state before the step, less excess(inp), or 'oom' / 'error: ...'};
    {'error': why} when the implementation is unavailable."""
    try:
        run = make_run()
    except providers.Unavailable as e:
        return {"error": str(e)}
    out = {}
    for size in sizes:
        key = key_of(size)
        try:
            inp = inputs_for(size)
            r = step(run, inp)
            del r
            gc.collect()
            _release_free_memory()
            base = _status_kb("VmRSS")
            _reset_hwm()
            r = step(run, inp)
            out[key] = (_status_kb("VmHWM") - base) * 1024 - excess(inp)
            del r, inp
            gc.collect()
        except Exception as e:  # reported per size
            out[key] = "oom" if is_oom(e) else f"error: {type(e).__name__}: {e}"
    return out


def child_peaks(module, args, keys, env=None, timeout=900) -> dict:
    """`python -m <module> <args>` in a fresh process (a memory child printing measure_peaks' JSON as its
    last line); on failure {key: 'oom' / 'error: ...'} for every key."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", **(env or {}))
    try:
        p = subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True, text=True,
                           timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {k: "error: timeout" for k in keys}
    if p.returncode:
        tail = p.stderr.strip().splitlines()[-1:] or ["?"]
        killed = p.returncode in (-9, 137)
        return {k: "oom" if killed else f"error: {tail[0]}" for k in keys}
    return json.loads(p.stdout.strip().splitlines()[-1])


def cpu_memory(rows, peaks_of, size_of, key_of, select=lambda r: True, workers=1, progress=None):
    """Peak memory of every implementation with an 'ok' row (and select(row)), one child process each
    (peaks_of(impl, sizes) -> {key: bytes or a note}, `workers` at a time), merged into the rows as
    'peak_bytes' or 'peak_note'."""
    from concurrent.futures import ThreadPoolExecutor
    by_impl = {}
    for r in rows:
        if r["status"] == "ok" and select(r):
            by_impl.setdefault(r["impl"], []).append(size_of(r))
    if progress is not None and by_impl:
        progress(f"peak memory of {', '.join(by_impl)} (a fresh process each, {workers} at a time)")

    def peaks(impl, sizes):  # each child says when it is done: at a large size each takes minutes
        res = peaks_of(impl, sizes)
        if progress is not None:
            progress(f"peak memory of {impl}: measured")
        return res
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {impl: pool.submit(peaks, impl, sizes) for impl, sizes in by_impl.items()}
    for impl, fut in futures.items():
        res = fut.result()
        for r in rows:
            if r["impl"] == impl and r["status"] == "ok" and select(r):
                v = res.get(key_of(r), res.get("error"))
                r.update({"peak_bytes": v} if isinstance(v, int) else {"peak_note": v})


def _logits_key(size):
    return f"{size[0]}x{size[1]}"


def memory_child(impl, sizes, dtype, preset, seed):
    """Runs in the child: the logits suite's peaks (measure_peaks) for `impl` at each (tokens, V)."""
    from gtpo_kernels import GTPOConfig
    cfg = GTPOConfig.preset(preset)
    return measure_peaks(lambda: providers.make(impl, cfg, "cpu"), sizes,
                         lambda s: make_inputs(*s, dtype=dtype, device="cpu", seed=seed,
                                               config=providers.config_for(impl, cfg)),
                         forward_backward, _logits_key)


def cpu_peak_bytes(impl, sizes, dtype, preset, seed, timeout=900):
    """{'<tokens>x<V>': bytes or 'oom' / 'error: ...'} from a fresh child process."""
    args = ["--memory", impl, "--sizes", ",".join(map(_logits_key, sizes)),
            "--dtype", str(dtype).replace("torch.", ""), "--preset", preset, "--seed", str(seed)]
    return child_peaks("bench.timing.memory", args, [_logits_key(s) for s in sizes],
                       env={"TRITON_INTERPRET": "1"} if impl == "triton" else None, timeout=timeout)


def parse_sizes(text):
    return [tuple(int(x) for x in s.split("x")) for s in text.split(",") if s]


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description="peak-memory child process (used by python -m bench)")
    ap.add_argument("--memory", required=True, help="implementation")
    ap.add_argument("--sizes", required=True, help="comma-separated TOKENSxV")
    ap.add_argument("--dtype", default="bfloat16", help="logits dtype (default: bfloat16)")
    ap.add_argument("--preset", default="gtpo", help="loss preset (default: gtpo)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the inputs (default: 0)")
    a = ap.parse_args(argv)
    torch.set_num_threads(torch.get_num_threads())
    res = memory_child(a.memory, parse_sizes(a.sizes), getattr(torch, a.dtype), a.preset, a.seed)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
