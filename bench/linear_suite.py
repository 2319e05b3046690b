"""The `linear` suite: the loss from hidden states and the LM head (spec section 11), side by side with
the materialized logits, TRL's fused head and Liger-Kernel's fused linear GRPO loss.

Per size (N tokens x D x V) the inputs are made once; every implementation is checked against a float64
evaluation of the materialized path on the same inputs (loss, gradients of hidden and weight), then
timed, forward+backward with respect to hidden and weight. Timing goes round-robin: each repeat runs
every implementation once, so a load change on a shared machine hits all of them alike; the table
gives medians and each implementation's time over TRL's (the median of the per-round ratios, with its
range). Peak memory is one forward+backward above the inputs and the parameter gradients it returns
(hidden's and weight's, in their dtype): CUDA, max_memory_allocated in this process; CPU, the peak
resident size of a fresh child process per implementation (`python -m bench.linear_suite --memory`,
bench.runner's method: a warm-up, then VmHWM reset through /proc/self/clear_refs, glibc told to give
large blocks back at once with MALLOC_MMAP_THRESHOLD_).
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

from . import linear, runner
from .providers import Unavailable
from .runner import _reset_hwm, _status_kb, is_oom

# bound on each implementation's error against the float64 evaluation (loss: absolute, the per-token
# terms are O(1); gradients: relative Frobenius norm), by input dtype
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.float64: (1e-9, 1e-9), torch.bfloat16: (2e-2, 5e-2),
             torch.float16: (1e-2, 2e-2)}


def size_key(N, D, V):
    return f"{N}x{D}x{V}"


def parse_size(text):
    parts = [int(x) for x in text.replace("x", ",").split(",") if x]
    if len(parts) != 3:
        raise ValueError(f"a linear size is N,D,V (tokens, hidden size, vocabulary), got {text!r}")
    return tuple(parts)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def reference(inp: linear.LinearInputs, cfg):
    """Loss and gradients of the materialized path in float64 (our torch backend, float64 accumulation)."""
    from gtpo_kernels import gtpo_loss
    h = inp.hidden.detach().double().requires_grad_()
    w = inp.weight.detach().double().requires_grad_()
    loss = gtpo_loss(h @ w.t(), inp.ids, inp.adv, inp.mask, old_logps=inp.old.double(), config=cfg,
                     backend="torch").loss
    gh, gw = torch.autograd.grad(loss, (h, w))
    return float(loss.detach()), gh, gw


def _rel(g, ref):
    return float((g.double() - ref).norm() / ref.norm().clamp(min=1e-300))


def errors(result, ref):
    loss, gh, gw = result
    return dict(loss=abs(float(loss) - ref[0]), grad_hidden=_rel(gh, ref[1]), grad_weight=_rel(gw, ref[2]))


def cuda_peak_bytes(run, inp) -> int:
    """Peak above the inputs and the returned parameter gradients."""
    return runner.cuda_peak_bytes(lambda: linear.forward_backward(run, inp)) - inp.grad_bytes()


# ---- CPU peak memory: one child process per implementation --------------------------------------

def memory_child(impl, sizes, dtype, tile_bytes, seed):
    """In the child: for each size, inputs, a warm-up forward+backward, then one measured. Returns
    {size: bytes above the inputs and the parameter gradients, or 'oom' / 'error: ...'}."""
    cfg = linear.config()
    out = {}
    try:
        run = linear.make(impl, cfg, "cpu", tile_bytes)
    except Unavailable as e:
        return {"error": str(e)}
    for N, D, V in sizes:
        key = size_key(N, D, V)
        try:
            inp = linear.make_inputs(N, D, V, dtype=dtype, device="cpu", seed=seed)
            r = linear.forward_backward(run, inp)
            del r
            gc.collect()
            base = _status_kb("VmRSS")
            _reset_hwm()
            r = linear.forward_backward(run, inp)
            peak = _status_kb("VmHWM")
            out[key] = (peak - base) * 1024 - inp.grad_bytes()
            del r, inp
            gc.collect()
        except Exception as e:  # reported per size
            out[key] = "oom" if is_oom(e) else f"error: {type(e).__name__}: {e}"
    return out


def cpu_peak_bytes(impl, sizes, dtype, tile_bytes, seed, threads=None, timeout=1200):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    cmd = [sys.executable, "-m", "bench.linear_suite", "--memory", impl,
           "--sizes", ",".join(size_key(*s) for s in sizes), "--dtype", str(dtype).replace("torch.", ""),
           "--tile-bytes", str(tile_bytes), "--seed", str(seed)]
    if threads:
        cmd += ["--threads", str(threads)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=root)
    except subprocess.TimeoutExpired:
        return {size_key(*s): "error: timeout" for s in sizes}
    if p.returncode:
        tail = p.stderr.strip().splitlines()[-1:] or ["?"]
        killed = p.returncode in (-9, 137)
        return {size_key(*s): "oom" if killed else f"error: {tail[0]}" for s in sizes}
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---- the suite ----------------------------------------------------------------------------------

class LinearSuite:
    def __init__(self, device, impls, sizes, dtype=None, tile_bytes=64 << 20, repeats=5, warmup=1, seed=0,
                 memory=True, threads=None, progress=None):
        for i in impls:
            if i not in linear.PROVIDERS:
                raise ValueError(f"unknown linear implementation {i!r}; expected some of {linear.PROVIDERS}")
        self.device, self.impls, self.sizes = device, list(impls), [tuple(s) for s in sizes]
        self.dtype = dtype or linear.default_dtype(device)
        self.tile_bytes, self.repeats, self.warmup, self.seed = int(tile_bytes), repeats, warmup, seed
        self.memory, self.threads = memory, threads
        self.cfg = linear.config()
        self.t0 = time.perf_counter()
        self._progress = progress

    def progress(self, msg):
        if self._progress is not None:
            self._progress(msg)
        else:
            print(f"[{time.perf_counter() - self.t0:6.1f}s] linear: {msg}", file=sys.stderr, flush=True)

    def _row(self, impl, N, D, V, status, **kw):
        row = dict(impl=impl, label=linear.LABELS[impl], N=N, D=D, V=V, status=status,
                   note=linear.NOTES.get(impl, ""), dtype=str(self.dtype).replace("torch.", ""))
        row.update(kw)
        return row

    def run(self):
        load_before = os.getloadavg()
        makers = {}
        for impl in self.impls:
            try:
                makers[impl] = linear.make(impl, self.cfg, self.device, self.tile_bytes)
            except Unavailable as e:
                makers[impl] = e
        rows = []
        tol_loss, tol_grad = TOLERANCE[self.dtype]
        for N, D, V in self.sizes:
            self.progress(f"{size_key(N, D, V)}: inputs and the float64 reference")
            inp = linear.make_inputs(N, D, V, dtype=self.dtype, device=self.device, seed=self.seed)
            ref = reference(inp, self.cfg)
            runs, by = {}, {}
            for impl in self.impls:
                run = makers[impl]
                if isinstance(run, Exception):
                    by[impl] = self._row(impl, N, D, V, "unavailable", note=str(run))
                    continue
                self.progress(f"{size_key(N, D, V)}: check {impl}")
                f = dict(tile=linear.tile_note(impl, inp, self.tile_bytes), counted_tokens=inp.counted)
                try:
                    r = linear.forward_backward(run, inp)
                    err = errors(r, ref)
                    f.update(loss=float(r[0]), errors=err)
                    del r
                    ok = err["loss"] <= tol_loss * max(1.0, abs(ref[0])) and \
                        max(err["grad_hidden"], err["grad_weight"]) <= tol_grad
                    status = "ok" if ok else "wrong"
                    if ok:
                        runs[impl] = run
                except Exception as e:
                    status = "oom" if is_oom(e) else "error"
                    if status == "error":
                        f["note"] = f"{type(e).__name__}: {str(e)[:200]}"
                finally:
                    gc.collect()
                    if self.device == "cuda":
                        torch.cuda.empty_cache()
                by[impl] = self._row(impl, N, D, V, status, **f)
            self.progress(f"{size_key(N, D, V)}: timing {', '.join(runs)} round-robin "
                          f"({self.warmup} warm-up + {self.repeats} rounds)")
            times = self._time(runs, inp)
            for impl, ts in times.items():
                by[impl]["times_ms"] = ts
                by[impl]["time_ms"] = {"full": statistics.median(ts)}
            if self.device == "cuda":
                for impl, run in runs.items():
                    try:
                        by[impl]["peak_bytes"] = cuda_peak_bytes(run, inp)
                    except Exception as e:
                        by[impl]["peak_note"] = "oom" if is_oom(e) else f"{type(e).__name__}"
                    gc.collect()
                    torch.cuda.empty_cache()
            rows += [by[i] for i in self.impls]
            del inp, ref, runs
            gc.collect()
        if self.memory and self.device == "cpu":
            self._cpu_memory(rows)
        self._ratios(rows)
        return dict(suite="linear", rows=rows, device=self.device, dtype=str(self.dtype).replace("torch.", ""),
                    preset=linear.PRESET, tile_bytes=self.tile_bytes, repeats=self.repeats, warmup=self.warmup,
                    sizes=[list(s) for s in self.sizes], threads=torch.get_num_threads(),
                    load_average_before=list(load_before), load_average_after=list(os.getloadavg()),
                    tolerance=dict(loss=tol_loss, grad=tol_grad))

    def _time(self, runs, inp):
        """{impl: [ms per round]}: every implementation once per round, `warmup` rounds untimed."""
        fns = {impl: (lambda run=run: linear.forward_backward(run, inp)) for impl, run in runs.items()}
        ts = {impl: [] for impl in fns}
        for k in range(self.warmup + self.repeats):
            for impl, fn in fns.items():
                try:
                    _sync(self.device)
                    t0 = time.perf_counter()
                    r = fn()
                    _sync(self.device)
                    dt = time.perf_counter() - t0
                    del r
                except Exception as e:  # an implementation that fails while timed is dropped
                    ts[impl] = None
                    self.progress(f"{impl} failed while timed: {type(e).__name__}: {e}")
                    continue
                if k >= self.warmup and ts[impl] is not None:
                    ts[impl].append(1e3 * dt)
            fns = {i: f for i, f in fns.items() if ts[i] is not None}
        return {i: t for i, t in ts.items() if t}

    def _cpu_memory(self, rows):
        by_impl = {}
        for r in rows:
            if r["status"] == "ok":
                by_impl.setdefault(r["impl"], []).append((r["N"], r["D"], r["V"]))
        # after the timing: two children at a time (each measures its own resident size)
        from concurrent.futures import ThreadPoolExecutor
        self.progress(f"peak memory of {', '.join(by_impl)} (a fresh process each, two at a time)")
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = {impl: pool.submit(cpu_peak_bytes, impl, sizes, self.dtype, self.tile_bytes, self.seed,
                                         self.threads) for impl, sizes in by_impl.items()}
        for impl, fut in futures.items():
            res = fut.result()
            for r in rows:
                if r["impl"] == impl and r["status"] == "ok":
                    v = res.get(size_key(r["N"], r["D"], r["V"]), res.get("error"))
                    if isinstance(v, int):
                        r["peak_bytes"] = v
                    else:
                        r["peak_note"] = v

    @staticmethod
    def _ratios(rows):
        trl = {(r["N"], r["D"], r["V"]): r for r in rows if r["impl"] == "trl" and r["status"] == "ok"}
        for r in rows:
            t = trl.get((r["N"], r["D"], r["V"]))
            if not t:
                continue
            if r.get("times_ms") and t.get("times_ms"):
                per_round = [a / b for a, b in zip(r["times_ms"], t["times_ms"])]
                r["vs_trl"] = dict(full=r["time_ms"]["full"] / t["time_ms"]["full"],
                                   per_round_median=statistics.median(per_round),
                                   per_round_min=min(per_round), per_round_max=max(per_round))
            if "peak_bytes" in r and "peak_bytes" in t and t["peak_bytes"] > 0:
                r["peak_vs_trl"] = r["peak_bytes"] / t["peak_bytes"]


# ---- the table ----------------------------------------------------------------------------------

def _mb(b):
    return f"{b / 2**20:,.1f} MiB" if abs(b) >= 2**20 else f"{b / 2**10:,.0f} KiB"


def table(res):
    head = ["implementation", "N x D x V", "fwd+bwd ms (min-max)", "vs TRL (per-round range)",
            "peak above inputs+grads", "peak vs TRL", "tiles", "max err loss/dh/dw", "status / note"]
    lines = []
    for r in res["rows"]:
        ts = r.get("times_ms")
        t = f"{r['time_ms']['full']:.1f} ({min(ts):.1f}-{max(ts):.1f})" if ts else "-"
        v = r.get("vs_trl")
        vs = f"{v['full']:.2f}x ({v['per_round_min']:.2f}-{v['per_round_max']:.2f})" if v else "-"
        e = r.get("errors")
        err = f"{e['loss']:.0e}/{e['grad_hidden']:.0e}/{e['grad_weight']:.0e}" if e else "-"
        note = "; ".join(x for x in (r["status"] if r["status"] != "ok" else "", r.get("note", ""),
                                     r.get("peak_note", "")) if x)
        lines.append([r["label"], f"{r['N']} x {r['D']} x {r['V']}", t, vs,
                      _mb(r["peak_bytes"]) if "peak_bytes" in r else "-",
                      f"{r['peak_vs_trl']:.2f}x" if "peak_vs_trl" in r else "-", r.get("tile", "-"), err, note])
    widths = [max(len(str(c)) for c in col) for col in zip(head, *lines)]
    fmt = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    out = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(c) for c in lines]
    lb, la = res["load_average_before"], res["load_average_after"]
    out += ["", f"linear suite: device {res['device']}, {res['dtype']}, preset {res['preset']} (old_logps given), "
            f"hidden and weight require grad; tile {_mb(res['tile_bytes'])} of logits for ours and TRL; "
            f"{res['threads']} threads; load average {lb[0]:.2f} before, {la[0]:.2f} after.",
            f"times: median of {res['repeats']} round-robin rounds after {res['warmup']} warm-up "
            + ("(CUDA, synchronized wall clock)" if res["device"] == "cuda" else "(CPU wall clock)")
            + "; vs TRL = median time / TRL's median (range: the per-round ratios).",
            "peak: one forward+backward, above the inputs and the returned gradients of hidden and weight"
            + (" (max_memory_allocated)." if res["device"] == "cuda"
               else " (peak resident size, a fresh process per implementation)."),
            f"errors against a float64 materialized evaluation: loss absolute, gradients relative norm "
            f"(bounds {res['tolerance']['loss']:.0e} / {res['tolerance']['grad']:.0e})."]
    return "\n".join(out)


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description="peak-memory child process of the linear suite (used by python -m bench)")
    ap.add_argument("--memory", required=True, help="implementation")
    ap.add_argument("--sizes", required=True, help="comma-separated NxDxV")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tile-bytes", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    sizes = [tuple(int(x) for x in s.split("x")) for s in a.sizes.split(",") if s]
    print(json.dumps(memory_child(a.memory, sizes, getattr(torch, a.dtype), a.tile_bytes, a.seed)))


if __name__ == "__main__":
    main()
