"""The GPU section's sentences, rendered from committed results (bench.readme_numbers calls these):
the profile of one call (bench.timing.profile's JSON), ours against Liger-Kernel over the grid (every
logits-cuda-*.json beside the given file), and the launch configurations timed on the GPU (tune-cuda.json)."""
from __future__ import annotations

import glob
import json
import os

from .common.record import ROOT

BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _kernel_us(row, name):
    return next(t["device_us"] for t in row["top"] if t["name"] == name)


def render_gpu_profile(doc, path):
    rows = {(r["impl"], r["tokens"], r["V"]): r for r in doc["rows"] if "error" not in r}
    big = max({(t, v) for _, t, v in rows}, key=lambda s: s[0] * s[1])
    small = min({(t, v) for _, t, v in rows}, key=lambda s: s[0] * s[1])
    elem = BYTES[doc.get("dtype", "bfloat16")]
    on, off = rows[("triton",) + big], rows[("triton-novalidate",) + big]
    f_us, b_us = _kernel_us(off, "_vocab_fwd_kernel"), _kernel_us(off, "_vocab_bwd_kernel")
    s_on, s_off = rows[("triton",) + small], rows[("triton-novalidate",) + small]
    # bytes actually moved: the forward reads the counted rows only; the backward writes every row and reads
    # the rows with a gradient (at most the counted ones). A record without `counted` (before it was kept)
    # gives the rate per row of the whole batch, an upper bound, and says so.
    counted = off.get("counted")
    rows_read = counted if counted is not None else big[0]
    fwd_tb = rows_read * big[1] * elem / f_us / 1e6
    bwd_tb = (rows_read + big[0]) * big[1] * elem / b_us / 1e6
    how = ("host syncs counted as they happen (set_sync_debug_mode)"
           if doc.get("syncs_counted_by") == "set_sync_debug_mode" else "host reads in the profiler's count")
    basis = ("" if counted is not None else
             "; per row of the whole batch: the record does not say how many rows were counted, about 90% "
             "in bench.timing.inputs, so the rates moved are about 0.9x and 0.95x these")
    return (f"Profiled at {big[0]} x {big[1]} (`python -m bench.timing.profile`, `{path}`, {doc['date'][:10]}): "
            f"the forward kernel takes {f_us / 1e3:.2f} ms ({fwd_tb:.2f} TB/s of logits read) and the "
            f"backward kernel {b_us / 1e3:.2f} ms ({bwd_tb:.2f} TB/s read and written{basis}), "
            f"{off['device_ms']:.2f} ms of device time in all. But a `gtpo_loss` forward + backward launches "
            f"{off['kernels']} kernels with `validate=False` ({on['kernels']} validating, with {on['syncs']} "
            f"{how} against {off['syncs']}): its wall time is {off['wall_ms']:.2f} ms "
            f"({on['wall_ms']:.2f} ms validating). At {small[0]} x {small[1]} the kernels take "
            f"{s_off['device_ms']:.2f} ms and the call {s_off['wall_ms']:.2f} ms ({s_on['wall_ms']:.2f} ms "
            f"validating): the host's launches are the cost.\n")


def render_gpu_peers(doc, path):
    ratios, seen = [], set()
    for f in sorted(glob.glob(os.path.join(ROOT, os.path.dirname(path), "logits-cuda-*.json"))):
        with open(f) as fh:
            d = json.load(fh)
        by = {(r["impl"], r["tokens"], r["V"]): r for r in d["rows"] if r.get("status") == "ok" and "time_ms" in r}
        for (impl, t, v), r in by.items():
            if impl == "triton" and ("liger", t, v) in by and (t, v) not in seen:  # a size once: its first file's
                seen.add((t, v))
                ratios.append((r["time_ms"]["full"] / by[("liger", t, v)]["time_ms"]["full"], t, v))
    lo, hi = min(ratios), max(ratios)
    return (f"Liger-Kernel's `triton_grpo_loss` (GRPO, no entropies) took less time than ours at all "
            f"{len(ratios)} sizes where both ran: ours took {lo[0]:.2f}x its forward + backward time at "
            f"{lo[1]} x {lo[2]} up to {hi[0]:.2f}x at {hi[1]} x {hi[2]} (`logits-cuda-*.json` beside `{path}`).\n")


def render_gpu_tune(doc, path):
    from gtpo_kernels.kernels import vocab_triton as vt
    rows = doc["cuda"]
    shipped = next(r for r in rows if r["block"] == vt.MAX_BLOCK_V and r["num_warps"] == vt.num_warps_for(vt.MAX_BLOCK_V))
    fwd, bwd = min(rows, key=lambda r: r["fwd_ms"]), min(rows, key=lambda r: r["bwd_ms"])

    def name(r):
        return f"BLOCK_V = {r['block']} with {r['num_warps']} warps"
    out = (f"Launch configurations (`{path}`, {doc['device']}, each the median of synchronized calls): the "
           f"shipped {name(shipped)} took {shipped['fwd_ms']:.2f} ms forward and {shipped['bwd_ms']:.2f} ms "
           f"backward; the fastest forward was {name(fwd)} ({fwd['fwd_ms']:.2f} ms), the fastest backward "
           f"{name(bwd)} ({bwd['bwd_ms']:.2f} ms).\n")
    return out


RENDER = {"gpu_profile": render_gpu_profile, "gpu_peers": render_gpu_peers, "gpu_tune": render_gpu_tune}
