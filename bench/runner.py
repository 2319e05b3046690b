"""The shared runner: check, time, peak memory and saved bytes of one implementation on one problem.

- time: forward, backward and forward+backward. CUDA: `triton.testing.do_bench` (median). CPU: median of
  `repeats` wall-clock runs after `warmup` runs. The backward is timed on a graph kept alive
  (`retain_graph=True`), as do_bench does it.
- peak memory of one forward + backward above the inputs. CUDA: `max_memory_allocated` minus what was
  allocated before. CPU: a fresh subprocess per implementation (`python -m bench.runner --memory ...`)
  that, for each size, resets the kernel's high-water mark of its resident size (/proc/self/clear_refs)
  after a warm-up and reads VmHWM after one forward + backward; glibc is told to give large blocks back
  to the system (MALLOC_MMAP_THRESHOLD_), so freed tensors do not hide in the heap.
- tensors saved for backward, per token: `saved_tensors_hooks` records the storage of every saved
  tensor, counted once, except storage shared with the logits (saved by reference).
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from . import providers
from .inputs import make_inputs

MODES = ("fwd", "bwd", "full")


def is_oom(e: BaseException) -> bool:
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(e, RuntimeError) and ("out of memory" in str(e) or "can't allocate memory" in str(e))


def forward_backward(run, inp):
    out = run(inp)
    grad, = torch.autograd.grad(out[0], inp.logits)
    return out, grad


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_ms(run, inp, modes=MODES, repeats=5, warmup=3):
    """{mode: milliseconds}. CUDA: do_bench medians; CPU: wall-clock medians."""
    z = inp.logits
    cuda = z.is_cuda
    fns = {}
    if "fwd" in modes:
        fns["fwd"] = lambda: run(inp)
    if "full" in modes:
        fns["full"] = lambda: torch.autograd.grad(run(inp)[0], z)
    if "bwd" in modes:
        kept = run(inp)[0]
        fns["bwd"] = lambda: torch.autograd.grad(kept, z, retain_graph=True)
    res = {}
    for mode, fn in fns.items():
        if cuda:
            import triton.testing
            res[mode] = float(triton.testing.do_bench(fn, warmup=10, rep=max(20, 10 * repeats),
                                                      return_mode="median"))
        else:
            for _ in range(warmup):
                fn()
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            res[mode] = 1e3 * statistics.median(ts)
    fns.clear()
    return res


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


def _reset_hwm():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident size to the current one (Linux >= 4.0)


def memory_child(impl, sizes, dtype, preset, seed):
    """Runs in the child: for each size, inputs, a warm-up forward+backward, then one measured."""
    from gtpo_kernels import GTPOConfig
    cfg = GTPOConfig.preset(preset)
    out = {}
    try:
        run = providers.make(impl, cfg, "cpu")
    except providers.Unavailable as e:
        return {"error": str(e)}
    for tokens, V in sizes:
        key = f"{tokens}x{V}"
        try:
            inp = make_inputs(tokens, V, dtype=dtype, device="cpu", seed=seed, config=providers.config_for(impl, cfg))
            r = forward_backward(run, inp)
            del r
            gc.collect()
            base = _status_kb("VmRSS")
            _reset_hwm()
            r = forward_backward(run, inp)
            peak = _status_kb("VmHWM")
            del r, inp
            gc.collect()
            out[key] = (peak - base) * 1024
        except Exception as e:  # reported per size
            out[key] = "oom" if is_oom(e) else f"error: {type(e).__name__}: {e}"
    return out


def cpu_peak_bytes(impl, sizes, dtype, preset, seed, timeout=900):
    """{'<tokens>x<V>': bytes or 'oom' / 'error: ...'} from a fresh child process."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    if impl == "triton":
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", "bench.runner", "--memory", impl, "--sizes",
           ",".join(f"{t}x{v}" for t, v in sizes), "--dtype", str(dtype).replace("torch.", ""),
           "--preset", preset, "--seed", str(seed)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=root)
    except subprocess.TimeoutExpired:
        return {f"{t}x{v}": "error: timeout" for t, v in sizes}
    if p.returncode:
        tail = p.stderr.strip().splitlines()[-1:] or ["?"]
        killed = p.returncode in (-9, 137)
        return {f"{t}x{v}": "oom" if killed else f"error: {tail[0]}" for t, v in sizes}
    return json.loads(p.stdout.strip().splitlines()[-1])


def parse_sizes(text):
    return [tuple(int(x) for x in s.split("x")) for s in text.split(",") if s]


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description="peak-memory child process (used by python -m bench)")
    ap.add_argument("--memory", required=True, help="implementation")
    ap.add_argument("--sizes", required=True, help="comma-separated TOKENSxV")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--preset", default="gtpo")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    torch.set_num_threads(torch.get_num_threads())
    res = memory_child(a.memory, parse_sizes(a.sizes), getattr(torch, a.dtype), a.preset, a.seed)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
