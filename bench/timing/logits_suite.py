"""One benchmark run: every implementation on every size, checked first, then measured.

Per size the inputs are made once; each implementation is checked against the reference on them
(a wrong one is reported, not timed; one that runs out of memory is reported as such), then its saved
bytes and (CUDA) peak memory are measured; then every checked implementation is timed in interleaved
rounds (bench.runner.interleaved: forward+backward and forward of each in every round). CPU peak memory
comes after, from one child process per implementation. Triton on the CPU runs in the interpreter: it is checked and counted (bytes moved)
at the traffic size only, never timed.
"""
from __future__ import annotations

import gc
import sys
import time

import torch

from . import memory, providers, runner
from .inputs import check, make_inputs


class Suite:
    def __init__(self, device, impls, sizes, preset, dtype, modes, repeats, warmup, seed, traffic_size,
                 memory=True, check_only=False, time_budget=None):
        from gtpo_kernels import GTPOConfig
        self.device, self.impls, self.sizes = device, impls, sizes
        self.preset, self.cfg = preset, GTPOConfig.preset(preset)
        self.dtype, self.modes, self.repeats, self.warmup, self.seed = dtype, modes, repeats, warmup, seed
        self.traffic_size, self.memory, self.check_only = traffic_size, memory, check_only
        self.time_budget = time_budget  # seconds for the timed sweep; later rows are reported skipped
        self.t0 = time.perf_counter()

    def progress(self, msg):
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def _row(self, impl, tokens, V, status, **kw):
        row = dict(impl=impl, label=providers.LABELS[impl], tokens=tokens, V=V, status=status,
                   note=providers.NOTES.get(impl, ""), dtype=str(self.dtype).replace("torch.", ""),
                   preset="grpo" if impl in providers.GRPO_ROWS else self.preset,
                   computes=providers.work(impl, self.preset), validate=providers.VALIDATES.get(impl))
        row.update(kw)
        return row

    def _measure(self, impl, run, inp):
        """Check, then saved bytes and CUDA peak memory. Returns the row's fields."""
        cfg = providers.config_for(impl, self.cfg)
        try:
            out, grad = runner.forward_backward(run, inp)
            c = check(out, grad, inp, cfg, strict=impl in OURS)
            grad_rows = int((grad[:, :inp.T] != 0).any(-1).logical_and(inp.mask).sum())
            del out, grad
            f = dict(check=c.detail, errors=c.errors, grad_tokens=grad_rows, counted_tokens=inp.counted)
            if hasattr(run, "compile_s"):
                f["compile_s"] = run.compile_s
            if not c.ok:
                return dict(f, status="wrong")
            if self.check_only:
                return dict(f, status="ok")
            f["saved_bytes_per_token"] = runner.saved_bytes(run, inp) / inp.tokens
            if inp.logits.is_cuda:
                f["peak_bytes"] = memory.cuda_peak_bytes(lambda: runner.forward_backward(run, inp))
            return dict(f, status="ok")
        except Exception as e:
            if runner.is_oom(e):
                return dict(status="oom")
            return dict(status="error", note=f"{type(e).__name__}: {str(e)[:200]}")
        finally:
            gc.collect()
            if inp.logits.is_cuda:
                torch.cuda.empty_cache()

    def run(self):
        rows, runs = [], {}
        interp = self.device == "cpu"
        load_before = runner.load_snapshot(settle=True, log=self.progress)
        self.progress(f"preparing {', '.join(self.impls)}")
        for impl in self.impls:
            try:
                runs[impl] = providers.make(impl, self.cfg, self.device)
            except providers.Unavailable as e:
                runs[impl] = e
        native = [i for i in self.impls if not (i in INTERPRETED and interp)]
        for i in self.impls:  # ours' other rows on the CPU: the interpreter, never timed (the 'triton' row is
            if interp and i in INTERPRETED and i != "triton":  # checked and counted at the traffic size)
                rows.append(self._row(i, *(self.traffic_size or self.sizes[0]), "skipped",
                                      note="interpreted on the CPU: not timed (run on CUDA)"))
        for k, (tokens, V) in enumerate(self.sizes, 1):
            if self.time_budget and time.perf_counter() - self.t0 > self.time_budget:
                rows += [self._row(i, tokens, V, "skipped", note="time budget spent") for i in native]
                continue
            ready = [i for i in native if not isinstance(runs[i], Exception)]
            self.progress(f"[{k}/{len(self.sizes)}] tokens={tokens} V={V}: check {', '.join(ready) or 'nothing'}"
                          + ("" if self.check_only else
                             f", then time them in {self.warmup} warm-up + {self.repeats} interleaved rounds"))
            rows += self._size(runs, native, tokens, V)
        load_after = runner.load_snapshot()  # right after the timing: the memory children below load the machine
        traffic = self._traffic_rows(rows, runs, interp)
        if self.memory and self.device == "cpu" and not self.check_only:
            memory.cpu_memory(rows, lambda impl, sizes: memory.cpu_peak_bytes(impl, sizes, self.dtype, self.preset,
                                                                             self.seed),
                              lambda r: (r["tokens"], r["V"]), lambda r: f"{r['tokens']}x{r['V']}",
                              select=lambda r: "time_ms" in r, progress=self.progress)  # not the interpreter's
        load = runner.load_record(load_before, load_after)
        self._ratios(rows, load)
        out = dict(rows=rows, traffic=traffic, device=self.device, preset=self.preset,
                   dtype=str(self.dtype).replace("torch.", ""), modes=list(self.modes),
                   repeats=0 if self.check_only else self.repeats, warmup=self.warmup, timing="interleaved rounds", rule=runner.RULE, load=load,
                   sizes=[list(s) for s in self.sizes])
        if self.device == "cuda" and not self.check_only:
            out["copy_bandwidth_GBps"] = self._copy_bandwidth()
            self._bandwidth(rows, out["copy_bandwidth_GBps"])
        return out

    def _size(self, runs, native, tokens, V):
        """The rows of one size: every implementation checked, then the checked ones timed together."""
        inp = make_inputs(tokens, V, dtype=self.dtype, device=self.device, seed=self.seed, config=self.cfg)
        by, ok = {}, {}
        for impl in native:
            run = runs[impl]
            if isinstance(run, Exception):
                if (tokens, V) == tuple(self.sizes[0]):  # said once, at the first size
                    self.progress(f"{impl}: not run at any size ({run})")
                by[impl] = self._row(impl, tokens, V, "unavailable", note=str(run))
                continue
            first = impl == "compile" and (tokens, V) == tuple(self.sizes[0])
            self.progress(f"{impl} {tokens}x{V}: check" + (" (its first call compiles the loss: torch.compile takes "
                                                           "seconds to a minute on a CPU)" if first else ""))
            by[impl] = self._row(impl, tokens, V, **self._measure(impl, run, inp))
            if by[impl]["status"] == "ok" and not self.check_only:
                ok[impl] = run
        if ok:
            self.progress(f"{tokens}x{V}: timing {', '.join(ok)} in interleaved rounds "
                          f"({self.warmup} warm-up + {self.repeats})")
            steps = {(impl, m): fn for impl, run in ok.items() for m, fn in runner.step_fns(run, inp, self.modes).items()}

            def failed(key, e):
                by[key[0]].update(status="oom" if runner.is_oom(e) else "error",
                                  note=f"while timed: {type(e).__name__}: {str(e)[:200]}")
            ts = runner.interleaved(steps, self.repeats, self.warmup, self.device, on_error=failed,
                                    progress=self.progress)
            for impl in ok:
                rounds = runner.mode_times({m: t for (i, m), t in ts.items() if i == impl}, self.modes)
                if rounds and by[impl]["status"] == "ok":
                    by[impl].update(rounds_ms=rounds, time_ms={m: runner.summary(t)["median"] for m, t in rounds.items()},
                                    time_range_ms={m: [min(t), max(t)] for m, t in rounds.items()})
                    if runner.fwd_above_full(rounds):
                        by[impl]["fwd_above_full"] = True
        del inp
        gc.collect()
        return [by[i] for i in native]

    def _traffic_rows(self, rows, runs, interp):
        """The interpreter's byte count (and, on the CPU, the Triton row it checks); None when not run."""
        traffic = None
        if "triton" in self.impls and interp and isinstance(runs["triton"], Exception):
            rows.append(self._row("triton", *(self.traffic_size or self.sizes[0]), "unavailable",
                                  note=str(runs["triton"])))
        elif "triton" in self.impls and self.traffic_size and (interp or not self.check_only):
            traffic, row = self._traffic(runs["triton"] if interp else None)
            if row:
                rows.append(row)
            for r in rows:
                if r["impl"] == "triton" and r["status"] == "ok":
                    r["traffic"] = traffic["ratios"]
        return traffic

    def _traffic(self, interpreted_run=None):
        """Bytes moved by our kernels at the traffic size (in the interpreter; a child process when this
        one runs Triton natively). On the CPU the same forward+backward is also the Triton row's check,
        followed by its saved bytes: interpreted, never timed."""
        from . import traffic
        tokens, V = self.traffic_size
        self.progress(f"bytes moved by the Triton kernels (interpreter) at {tokens}x{V}")
        if interpreted_run is None:
            return traffic.run_in_subprocess(tokens, V, self.dtype, self.preset, self.seed), None
        keep = {}
        res = traffic.run(tokens, V, self.dtype, self.preset, self.seed, keep=keep)
        inp = keep["inputs"]
        c = check(keep["result"], keep["grad"], inp, self.cfg, strict=True)
        f = dict(check=c.detail, errors=c.errors, counted_tokens=inp.counted, grad_tokens=res["grad_tokens"],
                 status="ok" if c.ok else "wrong", note="interpreted: counted for bytes, not timed",
                 peak_note="memory not measured (interpreter)")
        if c.ok:
            f["saved_bytes_per_token"] = runner.saved_bytes(interpreted_run, inp) / inp.tokens
        return res, self._row("triton", tokens, V, **f)

    @staticmethod
    def _ratios(rows, load):
        """vs_eager and vs_liger: per mode, each round's time over eager's (Liger-Kernel's) in the same round,
        summarized (median, range), with 'unreliable' set by bench.runner's rule."""
        for key, impl in (("vs_eager", "eager"), ("vs_liger", "liger")):
            base = {(r["tokens"], r["V"]): r for r in rows if r["impl"] == impl and "rounds_ms" in r}
            for r in rows:
                e = base.get((r["tokens"], r["V"]))
                if e and "rounds_ms" in r:
                    r[key] = {m: runner.per_round_ratio(t, e["rounds_ms"][m]) for m, t in r["rounds_ms"].items()
                              if m in e["rounds_ms"]}
                    for v in r[key].values():
                        v["unreliable"] = runner.unreliable(v, load, r)

    def _copy_bandwidth(self):
        import triton.testing
        n = 1 << 31  # 2 GiB each way
        src = torch.empty(n, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
        del src, dst
        torch.cuda.empty_cache()
        return 2 * n / (ms * 1e-3) / 1e9

    @staticmethod
    def _bandwidth(rows, copy_gbps):
        """Bytes each row's implementation moves (`bytes_moved`) over its measured time, as a fraction of the
        copy bandwidth measured in the same run; `bytes_basis` says how they were counted."""
        for r in rows:
            if "time_ms" not in r:
                continue
            moved, basis = bytes_moved(r)
            r["bytes_moved"], r["bytes_basis"] = moved, basis
            r["bandwidth_fraction"] = {m: moved[m] / (t * 1e-3) / 1e9 / copy_gbps for m, t in r["time_ms"].items()
                                       if m in moved}


OURS = ("triton", "triton-novalidate", "triton-grpo", "torch")  # held to the spec's bounds
INTERPRETED = ("triton", "triton-novalidate", "triton-grpo")  # Triton's interpreter on the CPU
BASIS = {
    "ours": "moved: forward reads the counted rows, backward reads the rows that carry a gradient and writes "
            "every row of the gradient (bench.timing.traffic counts these bytes in the interpreter)",
    "liger": "moved: liger_kernel/ops/grpo_loss.py's forward skips masked rows; its backward reads every "
             "counted row (whatever its coefficient) and writes every row (zeros where masked, then the last row)",
    "floor": "section 8's floor (the counted rows read forward, the rows with a gradient read backward, every "
             "row written): this implementation moves more (float32 copies, masked rows), so the fraction is "
             "of useful bytes",
}


def bytes_moved(r):
    """({fwd, bwd, full}: bytes, basis) of one row: N counted tokens, Ng of them with a gradient, the
    gradient (B, T + 1, V) written whole, e bytes per logit."""
    e = torch.empty((), dtype=getattr(torch, r["dtype"])).element_size()
    V, N, Ng = r["V"], r["counted_tokens"], r["grad_tokens"]
    B, T = r["tokens"] // _T(r["tokens"]), _T(r["tokens"])
    write = B * (T + 1) * V * e
    if r["impl"] == "liger":
        fwd, bwd, basis = N * V * e, N * V * e + write, BASIS["liger"]
    else:
        fwd, bwd = N * V * e, Ng * V * e + write
        basis = BASIS["ours"] if r["impl"] in INTERPRETED else BASIS["floor"]
    return dict(fwd=fwd, bwd=bwd, full=fwd + bwd), basis


def _T(tokens):
    from .inputs import shape_for
    return shape_for(tokens)[1]
