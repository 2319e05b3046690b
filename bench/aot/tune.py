"""BLOCK_V and num_warps for the vocabulary kernels: a static model here, a timed sweep on a GPU.

    python -m bench.aot.tune            # no GPU needed: compile each candidate for sm_90 (bf16, V = 151936)
    python -m bench.aot.tune --gpu      # on CUDA: time each candidate (forward, backward) and record them

Static model (a choice, not a measurement): every candidate is compiled as `python -m bench.aot` does and
counted (SASS instructions per logit element in the main loop, registers, occupancy in warps per SM).
To stay memory-bound a streaming kernel needs, by Little's law, bandwidth x latency bytes in flight:
at an H200's 4.3 TB/s and ~700 ns of DRAM latency, about 3 MB over 132 SMs, 22.8 KB per SM. A warp keeps
one iteration's loads in flight (32 threads x elements per thread x 2 bytes for bf16). Every candidate is
memory-bound by the roofline of bench.aot (at most 14 instructions per element), so the rule is: no
spills and at least 1.5x the bytes in flight Little's law asks for (latency varies), then the highest
occupancy (warps per SM: latency hiding), then the smallest block (the least masked tail at a vocabulary
that is not a multiple of it).
Results go to bench/out/ (git-ignored) unless --save (bench/results/).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from ..common import HelpFormatter, record
from .compiler import compile_kernel
from .sass import V_REAL

CANDIDATES = [(1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16)]
BANDWIDTH, LATENCY, SMS = 4.3e12, 700e-9, 132  # H200: bytes/s, seconds of DRAM latency, SMs
NEED_PER_SM = BANDWIDTH * LATENCY / SMS  # bytes in flight per SM


def static(dtype=torch.bfloat16, arch=90, V=V_REAL):
    """One row per (kernel, variant, BLOCK_V, warps), with the chosen configuration marked."""
    from gtpo_kernels.kernels import vocab_triton as vt
    rows = []
    for kernel, has_e in ((vt._vocab_fwd_kernel, None), (vt._vocab_bwd_kernel, False), (vt._vocab_bwd_kernel, True)):
        group = []
        for block, warps in CANDIDATES:
            r = compile_kernel(kernel, dtype, arch, V=V, has_e=has_e, block=block, warps=warps)
            in_flight = r.warps_per_sm * 32 * r.elems_per_thread * torch.tensor([], dtype=dtype).element_size()
            group.append(dict(kernel=r.kernel, variant=r.variant or "-", block=block, num_warps=warps, regs=r.registers,
                              spills=r.spill_stores + r.spill_loads, instr_per_elem=r.instr_per_elem,
                              bar_per_iter=r.bar_per_iter, warps_per_sm=r.warps_per_sm, bytes_in_flight_per_sm=in_flight,
                              meets_little=in_flight >= 1.5 * NEED_PER_SM and r.spill_stores + r.spill_loads == 0,
                              ok=r.ok, chosen=False))
        ok = [g for g in group if g["meets_little"] and g["ok"]] or group
        best = min(ok, key=lambda g: (-g["warps_per_sm"], g["block"], round(g["instr_per_elem"], 2)))
        best["chosen"] = True
        rows += group
    return rows


def timed(N=16384, V=151936, dtype=torch.bfloat16, repeats=20):
    """On CUDA: forward and backward time of each candidate (median of `repeats`), the launcher's
    block size overridden for the sweep."""
    from gtpo_kernels.kernels import vocab_triton as vt
    dev = torch.device("cuda")
    x = torch.randn(1, N, V, device=dev, dtype=dtype)
    ids = torch.randint(0, V, (N,), device=dev)
    counted = torch.ones(N, dtype=torch.bool, device=dev)
    grad = torch.empty_like(x)
    c = torch.rand(N, device=dev)
    saved = vt.MAX_BLOCK_V, vt.num_warps_for
    rows = []
    try:
        for block, warps in CANDIDATES:
            vt.MAX_BLOCK_V, vt.num_warps_for = block, (lambda _b, w=warps: w)
            ms = {}
            for name, fn in (("fwd", lambda: vt.vocab_fwd(x, ids, counted, 1.0, 0)),
                             ("bwd", lambda: vt.vocab_bwd(x, grad, ids, st, ent, c, None, 1.0, 0))):
                if name == "bwd":
                    _, ent, st, _ = vt.vocab_fwd(x, ids, counted, 1.0, 0)
                fn()
                torch.cuda.synchronize()
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    fn()
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1e3)
                ms[name] = sorted(times)[len(times) // 2]
            nbytes = x.numel() * x.element_size()
            rows.append(dict(block=block, num_warps=warps, fwd_ms=ms["fwd"], bwd_ms=ms["bwd"],
                             fwd_TBps=nbytes / ms["fwd"] / 1e9, bwd_TBps=2 * nbytes / ms["bwd"] / 1e9))
    finally:
        vt.MAX_BLOCK_V, vt.num_warps_for = saved
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.aot.tune", formatter_class=HelpFormatter,
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="also time every candidate on CUDA (N=16384, V=151936 bf16)")
    ap.add_argument("--save", action="store_true", help="write into bench/results/ (the committed record)")
    ap.add_argument("--out", default=None, help="where a run without --save writes (default: bench/out/, git-ignored)")
    args = ap.parse_args(argv)
    if args.save and args.out:
        ap.error("--save writes into bench/results/; give --save or --out DIR, not both")
    root = record.RESULTS if args.save else (args.out or record.SCRATCH)
    record.require_clean(root)
    rows = static()
    print(f"static model, bf16 sm_90 V={V_REAL}: need {NEED_PER_SM / 1024:.1f} KiB in flight per SM "
          f"({BANDWIDTH / 1e12:.1f} TB/s x {LATENCY * 1e9:.0f} ns / {SMS} SMs)")
    print(f"{'kernel':<20} {'var':<6} {'block':>6} {'warps':>5} {'regs':>5} {'instr/el':>8} {'warps/SM':>8} "
          f"{'KiB in flight/SM':>16}  chosen")
    for r in rows:
        print(f"{r['kernel']:<20} {r['variant']:<6} {r['block']:>6} {r['num_warps']:>5} {r['regs']:>5} "
              f"{r['instr_per_elem']:>8.2f} {r['warps_per_sm']:>8} {r['bytes_in_flight_per_sm'] / 1024:>16.1f}  "
              f"{'<-' if r['chosen'] else ''}")
    out = dict(record.stamp("cuda" if args.gpu and torch.cuda.is_available() else "cpu"), static=rows,
               triton=__import__("triton").__version__)
    if args.gpu:
        if not torch.cuda.is_available():
            raise SystemExit("--gpu needs CUDA")
        out["cuda"] = timed()
        out["device"] = torch.cuda.get_device_name()
        for r in out["cuda"]:
            print(f"cuda block {r['block']:>5} warps {r['num_warps']:>2}: fwd {r['fwd_ms']:.3f} ms "
                  f"({r['fwd_TBps']:.2f} TB/s), bwd {r['bwd_ms']:.3f} ms ({r['bwd_TBps']:.2f} TB/s)")
    record.require_clean(root)
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, f"tune-{'cuda' if args.gpu else 'static'}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"written: {path}")


if __name__ == "__main__":
    main()
