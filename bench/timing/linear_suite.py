"""The `linear` suite: the loss from hidden states and the LM head, side by side with
the materialized logits, TRL's fused head and Liger-Kernel's fused linear GRPO loss.

Per size (N tokens x D x V) the inputs are made once; every implementation is checked against a float64
evaluation of the materialized path on the same inputs (loss, gradients of hidden and weight), then
timed, forward+backward with respect to hidden and weight, in interleaved rounds (bench.runner.interleaved:
each round runs every implementation once, so a load change on a shared machine hits all of them alike);
the table gives medians with their range and each implementation's time over TRL's (the per-round
ratios' median and range, flagged by bench.runner's rule). Peak memory is one forward+backward above the inputs and the parameter gradients it returns
(hidden's and weight's, in their dtype): CUDA, max_memory_allocated in this process; CPU, the peak
resident size of a fresh child process per implementation (`python -m bench.timing.linear_suite --memory`,
bench.memory's method: a warm-up, then VmHWM reset through /proc/self/clear_refs, glibc told to give
large blocks back at once with MALLOC_MMAP_THRESHOLD_).

The head over the sampler's kept sets (linear.REPLAY_PROVIDERS: 'replay', 'rebuild'; opt-in,
`--linear-impls materialized,fused,recompute,trl,replay,rebuild`): with either in the run, every
implementation of a size runs on linear.make_inputs(kept=True) (a peaked head, ids and kept sets drawn by
top_k = 512 / top_p = 0.95 from its own logits; the full heads' work does not depend on the values), the
two are checked against a float64 evaluation over the same sets, and each row gets `vs_full`: its time over
the fused head's (the recompute one's when the fused did not run) round by round. The sets' sizes and
the unions the replay head projects are in the result (`sets`, per size).
"""
from __future__ import annotations

import gc
import json
import statistics
import sys
import time

import torch

from . import linear, memory, runner
from .providers import Unavailable
from .runner import is_oom

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


def reference(inp: linear.LinearInputs, cfg):
    """Loss and gradients of the materialized path in float64 (our torch backend, float64 accumulation)."""
    from gtpo_kernels import gtpo_loss
    h = inp.hidden.detach().double().requires_grad_()
    w = inp.weight.detach().double().requires_grad_()
    loss = gtpo_loss(h @ w.t(), inp.ids, inp.adv, inp.mask, old_logps=inp.old.double(), config=cfg,
                     backend="torch").loss
    gh, gw = torch.autograd.grad(loss, (h, w))
    return float(loss.detach()), gh, gw


def reference_kept(inp: linear.LinearInputs, cfg, how):
    """reference() over the kept sets: the recorded ones ('replay') or rebuilt by the rules ('rebuild')
    from the float64 logits, old log-probs over the sets."""
    from gtpo_kernels import gtpo_loss
    h = inp.hidden.detach().double().requires_grad_()
    w = inp.weight.detach().double().requires_grad_()
    kw = dict(sampling_mask=inp.sampling_mask) if how == "replay" else dict(top_k=linear.TOP_K, top_p=linear.TOP_P)
    loss = gtpo_loss(h @ w.t(), inp.ids, inp.adv, inp.mask, old_logps=inp.old_kept.double(), config=cfg,
                     backend="torch", **kw).loss
    gh, gw = torch.autograd.grad(loss, (h, w))
    return float(loss.detach()), gh, gw


def reference_ce(inp: linear.LinearInputs):
    """Cross-entropy -mean(logp) over the counted tokens of the materialized logits in float64, with its
    gradients (what linear.CE_PROVIDERS compute)."""
    h = inp.hidden.detach().double().requires_grad_()
    w = inp.weight.detach().double().requires_grad_()
    logp = torch.log_softmax(h @ w.t(), -1).gather(-1, inp.ids[..., None])[..., 0]
    m = inp.mask.double()
    loss = -(logp * m).sum() / m.sum().clamp(min=1)
    gh, gw = torch.autograd.grad(loss, (h, w))
    return float(loss.detach()), gh, gw


def _rel(g, ref):
    return float((g.double() - ref).norm() / ref.norm().clamp(min=1e-300))


def errors(result, ref):
    loss, gh, gw = result
    return dict(loss=abs(float(loss) - ref[0]), grad_hidden=_rel(gh, ref[1]), grad_weight=_rel(gw, ref[2]))


def cuda_peak_bytes(run, inp) -> int:
    """Peak above the inputs and the returned parameter gradients."""
    return memory.cuda_peak_bytes(lambda: linear.forward_backward(run, inp)) - inp.grad_bytes()


# ---- CPU peak memory: one child process per implementation (bench.memory's method) ----------------

def memory_child(impl, sizes, dtype, tile_bytes, seed):
    """In the child: {size: bytes above the inputs and the parameter gradients, or 'oom' / 'error: ...'}."""
    cfg = linear.config()
    kept = impl in linear.REPLAY_PROVIDERS
    return memory.measure_peaks(lambda: linear.make(impl, cfg, "cpu", tile_bytes), sizes,
                                lambda s: linear.make_inputs(*s, dtype=dtype, device="cpu", seed=seed, kept=kept),
                                linear.forward_backward, lambda s: size_key(*s), excess=lambda inp: inp.grad_bytes())


def cpu_peak_bytes(impl, sizes, dtype, tile_bytes, seed, threads=None, timeout=1200):
    args = ["--memory", impl, "--sizes", ",".join(size_key(*s) for s in sizes), "--dtype",
            str(dtype).replace("torch.", ""), "--tile-bytes", str(tile_bytes), "--seed", str(seed)]
    args += ["--threads", str(threads)] if threads else []
    return memory.child_peaks("bench.timing.linear_suite", args, [size_key(*s) for s in sizes], timeout=timeout)


# ---- the suite ----------------------------------------------------------------------------------

class LinearSuite:
    def __init__(self, device, impls, sizes, dtype=None, tile_bytes=64 << 20, repeats=5, warmup=1, seed=0,
                 memory=True, threads=None, progress=None):
        for i in impls:
            if i not in linear.ALL_PROVIDERS:
                raise ValueError(f"unknown linear implementation {i!r}; expected some of {linear.ALL_PROVIDERS}")
        self.device, self.impls, self.sizes = device, list(impls), [tuple(s) for s in sizes]
        self.dtype = dtype or linear.default_dtype(device)
        self.tile_bytes, self.repeats, self.warmup, self.seed = int(tile_bytes), repeats, warmup, seed
        self.memory, self.threads = memory, threads
        self.cfg = linear.config()
        self.kept = any(i in linear.REPLAY_PROVIDERS for i in self.impls)
        self.sets = {}  # size key -> linear.set_stats of the kept sets, with the replay head's tiles
        self.t0 = time.perf_counter()
        self._progress = progress

    def progress(self, msg):
        if self._progress is not None:
            self._progress(msg)
        else:
            print(f"[{time.perf_counter() - self.t0:6.1f}s] linear: {msg}", file=sys.stderr, flush=True)

    def _row(self, impl, N, D, V, status, **kw):
        row = dict(impl=impl, label=linear.LABELS[impl], N=N, D=D, V=V, status=status,
                   note=linear.NOTES.get(impl, ""), dtype=str(self.dtype).replace("torch.", ""),
                   computes=linear.WORK.get(impl, ""))
        row.update(kw)
        return row

    def run(self):
        load_before = runner.load_snapshot(settle=True, log=self.progress)
        makers = {}
        for impl in self.impls:
            try:
                makers[impl] = linear.make(impl, self.cfg, self.device, self.tile_bytes)
            except Unavailable as e:
                makers[impl] = e
        rows = []
        for k, size in enumerate(self.sizes, 1):
            ready = [i for i, m in makers.items() if not isinstance(m, Exception)]
            self.progress(f"[{k}/{len(self.sizes)}] N={size[0]} D={size[1]} V={size[2]}: check "
                          f"{', '.join(ready) or 'nothing'}, then time them in {self.warmup} warm-up + {self.repeats} "
                          f"interleaved rounds")
            rows += self._size(makers, *size)
        load_after = runner.load_snapshot()  # right after the timing: the memory children below load the machine
        if self.memory and self.device == "cpu":  # after the timing: two children at a time
            memory.cpu_memory(rows, lambda impl, sizes: cpu_peak_bytes(impl, sizes, self.dtype, self.tile_bytes,
                                                                       self.seed, self.threads),
                              lambda r: (r["N"], r["D"], r["V"]), lambda r: size_key(r["N"], r["D"], r["V"]),
                              workers=2, progress=self.progress)
        load = runner.load_record(load_before, load_after)
        self._ratios(rows, load)
        tol_loss, tol_grad = TOLERANCE[self.dtype]
        kept = dict(sets=self.sets, top_k=linear.TOP_K, top_p=linear.TOP_P) if self.kept else {}
        return dict(suite="linear", rows=rows, **kept, device=self.device, dtype=str(self.dtype).replace("torch.", ""),
                    preset=linear.PRESET, tile_bytes=self.tile_bytes, repeats=self.repeats, warmup=self.warmup,
                    timing="interleaved rounds", rule=runner.RULE, load=load,
                    sizes=[list(s) for s in self.sizes], threads=torch.get_num_threads(),
                    tolerance=dict(loss=tol_loss, grad=tol_grad))

    def _check(self, run, inp, ref):
        """(status, fields) of one implementation against the float64 evaluation."""
        tol_loss, tol_grad = TOLERANCE[self.dtype]
        f = {}
        try:
            r = linear.forward_backward(run, inp)
            err = errors(r, ref)
            f.update(loss=float(r[0]), errors=err)
            del r
            ok = err["loss"] <= tol_loss * max(1.0, abs(ref[0])) and \
                max(err["grad_hidden"], err["grad_weight"]) <= tol_grad
            return ("ok" if ok else "wrong"), f
        except Exception as e:
            if is_oom(e):
                return "oom", f
            return "error", dict(f, note=f"{type(e).__name__}: {str(e)[:200]}")
        finally:
            gc.collect()
            if self.device == "cuda":
                torch.cuda.empty_cache()

    def _size(self, makers, N, D, V):
        """The rows of one size: every implementation checked, then the checked ones timed together."""
        self.progress(f"{size_key(N, D, V)}: inputs and the float64 reference"
                      + (" (kept sets drawn: top_k 512, top_p 0.95)" if self.kept else ""))
        inp = linear.make_inputs(N, D, V, dtype=self.dtype, device=self.device, seed=self.seed, kept=self.kept)
        refs = {}

        def ref_for(impl):  # the float64 evaluation each implementation is held to, computed once
            how = impl if impl in linear.REPLAY_PROVIDERS else "ce" if impl in linear.CE_PROVIDERS else "full"
            if how not in refs:
                refs[how] = (reference(inp, self.cfg) if how == "full" else reference_ce(inp) if how == "ce"
                             else reference_kept(inp, self.cfg, how))
            return refs[how]
        if self.kept:
            tiles = linear.union_tiles(inp, self.tile_bytes)
            self.sets[size_key(N, D, V)] = linear.set_stats(*inp.sampling_mask, V, tiles)
        runs, by = {}, {}
        for impl, run in makers.items():
            if isinstance(run, Exception):
                by[impl] = self._row(impl, N, D, V, "unavailable", note=str(run))
                continue
            self.progress(f"{size_key(N, D, V)}: check {impl}")
            status, f = self._check(run, inp, ref_for(impl))
            by[impl] = self._row(impl, N, D, V, status, tile=linear.tile_note(impl, inp, self.tile_bytes),
                                 counted_tokens=inp.counted, **f)
            if impl in ("fused", "recompute"):  # the time model's prediction beside the measurement
                by[impl]["model_ms"] = model_ms(impl, self.cfg, inp, self.tile_bytes, self.dtype)
            if status == "ok":
                runs[impl] = run
        if not self.repeats:  # --check-only: checked, not timed
            return [by[i] for i in self.impls]
        self.progress(f"{size_key(N, D, V)}: timing {', '.join(runs)} in interleaved rounds "
                      f"({self.warmup} warm-up + {self.repeats} rounds)")
        times = runner.interleaved({i: (lambda run=run: linear.forward_backward(run, inp)) for i, run in runs.items()},
                                   self.repeats, self.warmup, self.device, progress=self.progress,
                                   on_error=lambda i, e: by[i].update(status="error", note=f"while timed: {e}"))
        for impl, ts in times.items():
            by[impl].update(times_ms=ts, time_ms={"full": statistics.median(ts)},
                            time_range_ms={"full": [min(ts), max(ts)]})
        if self.device == "cuda":
            for impl, run in runs.items():
                try:
                    by[impl]["peak_bytes"] = cuda_peak_bytes(run, inp)
                except Exception as e:
                    by[impl]["peak_note"] = "oom" if is_oom(e) else f"{type(e).__name__}"
                gc.collect()
                torch.cuda.empty_cache()
        return [by[i] for i in self.impls]

    @staticmethod
    def _ratios(rows, load):
        trl = {(r["N"], r["D"], r["V"]): r for r in rows if r["impl"] == "trl" and r["status"] == "ok"}
        full = {}
        for name in ("recompute", "fused"):  # the fused head's rounds where it ran, else the recompute one's
            full.update({(r["N"], r["D"], r["V"]): r for r in rows if r["impl"] == name and r.get("times_ms")})
        for r in rows:
            f = full.get((r["N"], r["D"], r["V"]))
            if f and r.get("times_ms") and r["impl"] in linear.REPLAY_PROVIDERS:
                v = runner.per_round_ratio(r["times_ms"], f["times_ms"])
                r["vs_full"] = {"full": dict(v, unreliable=runner.unreliable(v, load)), "against": f["impl"]}
            t = trl.get((r["N"], r["D"], r["V"]))
            if not t:
                continue
            if r.get("times_ms") and t.get("times_ms"):
                v = runner.per_round_ratio(r["times_ms"], t["times_ms"])
                r["vs_trl"] = {"full": dict(v, unreliable=runner.unreliable(v, load))}
            if "peak_bytes" in r and "peak_bytes" in t and t["peak_bytes"] > 0:
                r["peak_vs_trl"] = r["peak_bytes"] / t["peak_bytes"]


# ---- the table ----------------------------------------------------------------------------------

def _mb(b):
    return f"{b / 2**20:,.1f} MiB" if abs(b) >= 2**20 else f"{b / 2**10:,.0f} KiB"


def model_ms(impl, cfg, inp, tile_bytes, dtype):
    """The head's time model (gtpo_kernels.pipeline.schedule.predict, fitted to an H200 record) for schedule
    `impl` on these inputs at our budget: a prediction for a GPU like that one, not a measurement."""
    from gtpo_kernels.pipeline.head import row_bytes
    from gtpo_kernels.pipeline.schedule import predict
    V, D = inp.weight.shape
    per_tile = linear.our_budget(tile_bytes) // row_bytes(V, dtype, inp.weight.device)
    m = predict(cfg, V, D, inp.counted, per_tile, torch.empty((), dtype=dtype).element_size())
    return round(getattr(m, impl), 3)


def table(res):
    from .report import format_rows, load_line, ratio_cell
    head = ["implementation", "N x D x V", "fwd+bwd ms (min-max)", "model ms (H200 fit)", "vs TRL (per round)",
            "peak above inputs+grads", "peak vs TRL", "tiles", "max err loss/dh/dw", "status / note"]
    kept = any("vs_full" in r for r in res["rows"])
    if kept:
        head.insert(4, "vs full head (per round)")
    lines = []
    for r in res["rows"]:
        ts = r.get("times_ms")
        t = f"{r['time_ms']['full']:.1f} ({min(ts):.1f}-{max(ts):.1f})" if ts else "-"
        e = r.get("errors")
        err = f"{e['loss']:.0e}/{e['grad_hidden']:.0e}/{e['grad_weight']:.0e}" if e else "-"
        note = "; ".join(x for x in (r["status"] if r["status"] != "ok" else "", r.get("note", ""),
                                     r.get("peak_note", "")) if x)
        lines.append([r["label"], f"{r['N']} x {r['D']} x {r['V']}", t,
                      f"{r['model_ms']:.1f}" if r.get("model_ms") is not None else "-",
                      ratio_cell(r.get("vs_trl", {}).get("full")),
                      _mb(r["peak_bytes"]) if "peak_bytes" in r else "-",
                      f"{r['peak_vs_trl']:.2f}x" if "peak_vs_trl" in r else "-", r.get("tile", "-"), err, note])
        if kept:
            v = r.get("vs_full")
            lines[-1].insert(4, f"{ratio_cell(v['full'])} of {v['against']}" if v else "-")
    out = [format_rows(head, lines)]
    out += ["", f"linear suite: device {res['device']}, {res['dtype']}, preset {res['preset']} (old_logps given), "
            f"hidden and weight require grad; tile {_mb(res['tile_bytes'])} of logits for ours and TRL; "
            f"{res['threads']} threads.",
            "checked only, not timed (--check-only)." if not res["repeats"] else
            f"times: median (min-max) of {res['repeats']} interleaved rounds after {res['warmup']} warm-up round(s) "
            + ("(CUDA, synchronized)" if res["device"] == "cuda" else "(CPU wall clock)")
            + "; vs TRL: each round's time over TRL's in the same round.",
            load_line(res.get("load")) + " " + res.get("rule", ""),
            "model ms: the head's time model (gtpo_kernels.pipeline.schedule.predict, fitted to the 2026-12-04 "
            "H200 record), what it predicts on such a GPU; not a measurement.",
            "peak: one forward+backward, above the inputs and the returned gradients of hidden and weight"
            + (" (max_memory_allocated)." if res["device"] == "cuda"
               else " (peak resident size, a fresh process per implementation)."),
            f"errors against a float64 materialized evaluation: loss absolute, gradients relative norm "
            f"(bounds {res['tolerance']['loss']:.0e} / {res['tolerance']['grad']:.0e})"
            + ("; the kept-set rows over their sets (recorded, or rebuilt by the rules in float64)" if kept else "")
            + ("; Liger's cross-entropy row against a float64 cross-entropy." if any(
                r["impl"] in linear.CE_PROVIDERS for r in res["rows"]) else ".")]
    for key, st in (res.get("sets") or {}).items():
        out.append(kept_line(key, st, res))
    seen = dict.fromkeys((r["label"], r.get("computes")) for r in res["rows"] if r.get("computes"))
    if seen:
        out.append("what each row computes: " + "; ".join(f"{k}: {v}" for k, v in seen) + ".")
    if not any(r["impl"] == "trl" and r["status"] == "ok" for r in res["rows"]):
        out.append("vs TRL: not compared (TRL is not installed: pip install -e \".[bench]\").")
    return "\n".join(out)


def kept_line(key, st, res):
    """One line on a size's kept sets and the unions the replay head projects."""
    return (f"kept sets at {key} (top_k {res.get('top_k')}, top_p {res.get('top_p')} on the peaked head; the "
            f"replay and rebuild rows are checked over them, the others over the full vocabulary): |K_t| mean "
            f"{st['mean_kept']:.1f}, median {st['median_kept']:.0f}, p90 {st['p90_kept']:.0f}, max {st['max_kept']}; "
            f"{st['tiles']} replay tile(s) of ~{st['mean_rows']:.0f} tokens, |U| mean {st['mean_union']:.0f} "
            f"(max {st['max_union']}) = {st['union_over_V']:.3f} V, sum |K_t| / |U| = {st['sum_kept_over_union']:.2f}.")


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(description="peak-memory child process of the linear suite (used by python -m bench)")
    ap.add_argument("--memory", required=True, help="implementation")
    ap.add_argument("--sizes", required=True, help="comma-separated NxDxV")
    ap.add_argument("--dtype", default="float32", help="hidden and weight dtype (default: float32)")
    ap.add_argument("--tile-bytes", type=int, required=True, help="bytes of logits projected at once")
    ap.add_argument("--seed", type=int, default=0, help="seed of the inputs (default: 0)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    sizes = [tuple(int(x) for x in s.split("x")) for s in a.sizes.split(",") if s]
    print(json.dumps(memory_child(a.memory, sizes, getattr(torch, a.dtype), a.tile_bytes, a.seed)))


if __name__ == "__main__":
    main()
