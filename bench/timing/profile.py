"""Where one forward + backward spends its time: torch.profiler over the logits path, per implementation.

    python -m bench.timing.profile --device cuda --size 4096x32000 --size 16384x151936

For each size and implementation (ours with the Triton and torch backends, validate on and off, and
replaying top_k = 50 / top_p = 0.95 kept sets; the eager baseline): the wall time of a synchronized forward
+ backward, the device time its kernels took, how many operators and kernels it launched and how many host
syncs it made, then the operators that took the most device time (CUDA) or host time (CPU). The gap between
wall and device time is launch and Python overhead.

Host syncs (`syncs`): on CUDA, counted as they happen: one more call runs under
torch.cuda.set_sync_debug_mode("warn"), and every "synchronizing CUDA operation" warning it raises is one
(a device-to-host read, a stream synchronization, a copy from pageable host memory); `sync_ops` is the
profiler's count of the operators that usually sync (`item`, `_local_scalar_dense`, `nonzero`, stream and
device synchronizations), which is not the same thing. On the CPU nothing syncs: `syncs` is that operator
count. `counted` is the rows the forward kernel reads (a bandwidth over bytes moved counts these, not all).
Writes profile-<device>.json into --out (default bench/out/), stamped as every record (bench.common.record).
"""
from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import torch

from ..common import record
from . import runner  # providers and inputs import gtpo_kernels (and triton): main sets the interpreter first

IMPLS = ("triton", "triton-novalidate", "triton-replay", "torch", "eager")
REPLAY = dict(top_k=50, top_p=0.95)  # the kept sets rebuilt as a rollout engine's sampler would keep them


def _runner(impl, cfg, device):
    if impl == "triton-replay":  # spec 13: log-probs, entropies and gradient over the kept sets
        from gtpo_kernels import gtpo_loss

        def run(inp):
            out = gtpo_loss(inp.logits, inp.ids, inp.adv, inp.mask, logits_start=0, lam=inp.lam, n_conf=inp.n_conf,
                            config=cfg, backend="triton", **REPLAY)
            return out.loss, out.logps, out.entropy
        return run
    if impl == "triton-novalidate":
        from gtpo_kernels import gtpo_loss

        def run(inp):
            out = gtpo_loss(inp.logits, inp.ids, inp.adv, inp.mask, logits_start=0, lam=inp.lam, n_conf=inp.n_conf,
                            config=cfg, backend="triton", validate=False)
            return out.loss, out.logps, out.entropy
        return run
    from . import providers
    return providers.make(impl, cfg, device)


def profile_one(run, inp, device, top=12, rounds=5):
    """Wall and device time of `rounds` synchronized forward + backward calls (after one warm-up), the
    operators and kernels launched per call, and the costliest operators."""
    from torch.profiler import ProfilerActivity, profile
    runner.forward_backward(run, inp)
    runner.sync(device)
    t0 = time.perf_counter()
    for _ in range(rounds):
        runner.forward_backward(run, inp)
    runner.sync(device)
    wall_ms = (time.perf_counter() - t0) * 1e3 / rounds
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        runner.forward_backward(run, inp)
        runner.sync(device)
    events = prof.key_averages()
    dev_attr = "device_time_total" if device == "cuda" else "self_cpu_time_total"
    ops = [e for e in events if e.key.startswith(("aten::", "gtpo_kernels::"))]
    kernels = [e for e in events if device == "cuda" and getattr(e, "device_type", None) is not None
               and str(e.device_type).endswith("CUDA")]
    sync_ops = sum(e.count for e in events if e.key in ("aten::_local_scalar_dense", "aten::item", "aten::nonzero",
                                                       "cudaStreamSynchronize", "cudaDeviceSynchronize"))
    syncs = count_syncs(lambda: runner.forward_backward(run, inp)) if device == "cuda" else sync_ops
    device_ms = sum(getattr(e, "self_device_time_total", 0.0) for e in kernels) / 1e3
    costly = sorted(events, key=lambda e: getattr(e, dev_attr, 0.0), reverse=True)[:top]
    return dict(wall_ms=wall_ms, device_ms=device_ms if device == "cuda" else None,
                ops=sum(e.count for e in ops if e.key.startswith("aten::")), kernels=sum(e.count for e in kernels),
                syncs=syncs, sync_ops=sync_ops,
                top=[dict(name=e.key, count=e.count, device_us=getattr(e, "device_time_total", 0.0),
                          self_cpu_us=e.self_cpu_time_total) for e in costly])


SYNC_WARNING = "synchronizing CUDA operation"  # what torch.cuda.set_sync_debug_mode("warn") says at each sync


def count_syncs(fn):
    """Host syncs that fn() makes on CUDA, counted as they happen: fn runs under
    torch.cuda.set_sync_debug_mode("warn") with every warning recorded (none filtered as a repeat); each
    'synchronizing CUDA operation' warning is one sync. The device is synchronized before and after,
    outside the count."""
    torch.cuda.synchronize()
    old = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(old)
    torch.cuda.synchronize()
    return sum(SYNC_WARNING in str(w.message) for w in caught)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.timing.profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--size", action="append", default=None, metavar="TOKENSxV", help="default 4096x32000")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--out", default=None, help="folder of profile-<device>.json (default bench/out/)")
    a = ap.parse_args(argv)
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from gtpo_kernels import GTPOConfig

    from .inputs import make_inputs
    cfg = GTPOConfig()
    dtype = getattr(torch, a.dtype)
    rows = []
    for size in a.size or ["4096x32000"]:
        tokens, V = (int(x) for x in size.lower().split("x"))
        inp = make_inputs(tokens, V, dtype=dtype, device=a.device, seed=0, config=cfg)
        counted = int(inp.mask.sum())  # the rows the forward kernel reads (bandwidth counts these, not all)
        for impl in a.impls.split(","):
            try:
                r = profile_one(_runner(impl, cfg, a.device), inp, a.device)
            except Exception as e:  # report and go on: one implementation's failure is a row
                rows.append(dict(impl=impl, tokens=tokens, V=V, error=f"{type(e).__name__}: {str(e)[:200]}"))
                print(f"{impl} {tokens}x{V}: {type(e).__name__}: {e}", flush=True)
                continue
            rows.append(dict(impl=impl, tokens=tokens, V=V, counted=counted, **r))
            dev = f"{r['device_ms']:.3f}" if r["device_ms"] is not None else "-"
            how = "counted by set_sync_debug_mode" if a.device == "cuda" else "sync ops"
            print(f"\n{impl} {tokens}x{V}: wall {r['wall_ms']:.3f} ms, device {dev} ms, {r['ops']} aten ops, "
                  f"{r['kernels']} kernels, {r['syncs']} host syncs ({how}; profiler sync ops {r['sync_ops']})",
                  flush=True)
            for t in r["top"]:
                print(f"  {t['name'][:70]:<70} x{t['count']:<4} device {t['device_us']:>9.1f} us  "
                      f"self cpu {t['self_cpu_us']:>9.1f} us")
        del inp
    root = a.out or record.SCRATCH
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, f"profile-{a.device}.json")
    doc = dict(record.stamp(a.device), rows=rows, device=a.device, dtype=a.dtype,
               syncs_counted_by="set_sync_debug_mode" if a.device == "cuda" else "profiler sync ops")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print(f"written: {path}")


if __name__ == "__main__":
    main()
