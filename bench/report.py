"""The stdout table and the JSON file (with the machine, the versions, the date and the commit)."""
from __future__ import annotations

import datetime
import json
import os
import platform


def _mb(b):
    return f"{b / 2**20:,.0f} MiB" if b >= 2**20 else f"{b / 2**10:,.0f} KiB"


def _time(r, modes):
    t = r.get("time_ms")
    if not t:
        return "-"
    return " / ".join(f"{t[m]:.1f}" if t[m] >= 1 else f"{t[m]:.3f}" for m in modes if m in t)


def table(res):
    modes = [m for m in ("full", "fwd", "bwd") if m in res["modes"]]
    head = ["implementation", "size (tok x V)", "ms " + "/".join("fwd+bwd" if m == "full" else m for m in modes),
            "vs eager", "peak above inputs", "saved B/tok", "traffic fwd-r/bwd-r/bwd-w", "status / note"]
    if res["device"] == "cuda":
        head.insert(4, "% copy bw")
    lines = []
    for r in res["rows"]:
        status = r["status"]
        if status == "ok" and not r.get("errors", {}).get("within_spec", True):
            status = "ok*"
        if status == "wrong":
            status = f"WRONG: {r.get('check', '')}"
        note = "; ".join(x for x in (status if status != "ok" else "", r.get("note", ""), r.get("peak_note", ""),
                                     f"compile {r['compile_s']:.1f} s" if r.get("compile_s") else "") if x)
        ve = r.get("vs_eager", {}).get("full")
        tr = r.get("traffic")
        cells = [r["label"], f"{r['tokens']} x {r['V']}", _time(r, modes), f"{ve:.2f}x" if ve else "-",
                 _mb(r["peak_bytes"]) if "peak_bytes" in r else "-",
                 f"{r['saved_bytes_per_token']:,.0f}" if "saved_bytes_per_token" in r else "-",
                 f"{tr['fwd_read']:.4f}/{tr['bwd_read']:.4f}/{tr['bwd_write']:.4f}" if tr else "-", note]
        if res["device"] == "cuda":
            bw = r.get("bandwidth_fraction")
            cells.insert(4, "/".join(f"{100 * bw[m]:.0f}" for m in modes if m in bw) if bw else "-")
        lines.append(cells)
    widths = [max(len(str(c)) for c in col) for col in zip(head, *lines)]
    fmt = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    out = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(c) for c in lines]
    out.append("")
    out.append(f"device {res['device']}, {res['dtype']}, preset {res['preset']} (Liger: grpo), times are medians of "
               + ("do_bench" if res["device"] == "cuda" else f"{res['repeats']} runs after warm-up (CPU wall clock)")
               + "; vs eager = fwd+bwd time / eager's in this run.")
    out.append("peak above inputs: one forward+backward, gradient included"
               + (" (max_memory_allocated)." if res["device"] == "cuda" else
                  " (peak resident size of a fresh process per implementation)."))
    out.append("saved B/tok: storages saved for backward per token (saved_tensors_hooks), the logits excluded.")
    if res.get("traffic"):
        t = res["traffic"]
        out.append(f"traffic: bytes the Triton kernels move / spec section 8's ideal, counted in the interpreter at "
                   f"{t['tokens']} x {t['V']} {t['dtype']} (self-test reads twice: "
                   f"{t['self_test']['read_ratio']:.3f}, {'ok' if t['self_test']['ok'] else 'FAILED'}).")
    if res.get("copy_bandwidth_GBps"):
        out.append(f"% copy bw: section 8 bytes / time, over the copy bandwidth measured in this run "
                   f"({res['copy_bandwidth_GBps']:.0f} GB/s, read + write).")
    out.append("ok*: within float32 accuracy (1e-4) but beyond section 7's 1e-5 (the bar for our kernels).")
    return "\n".join(out)


def machine(device):
    import torch
    m = dict(platform=platform.platform(), python=platform.python_version(), cpu=platform.processor(),
             cpu_count=os.cpu_count())
    try:
        with open("/proc/cpuinfo") as f:
            m["cpu"] = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        m.update(gpu=p.name, gpu_memory_bytes=p.total_memory, capability=list(torch.cuda.get_device_capability(0)),
                 cuda=torch.version.cuda)
    return m


def versions():
    import torch
    v = dict(torch=torch.__version__)
    for mod in ("triton", "gtpo_kernels", "liger_kernel", "numpy", "matplotlib"):
        try:
            m = __import__(mod)
            v[mod] = getattr(m, "__version__", "?")
        except Exception:
            v[mod] = None
    from importlib.metadata import version
    for mod, dist in (("liger_kernel", "liger-kernel"), ("trl", "trl")):
        if v.get(mod, "?") == "?":  # no __version__ (Liger), or not imported: importing trl takes seconds
            try:
                v[mod] = version(dist)
            except Exception:
                v[mod] = None
    return v


def commit():
    """The git commit the figures were measured on ('+dirty' when the tree had changes), or None."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def write_json(res, out_dir, prefix=""):
    """<prefix><device>-<date>.json and latest-<prefix><device>.json in out_dir; returns the first path."""
    os.makedirs(out_dir, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    doc = dict(date=now.isoformat(timespec="seconds"), commit=commit(), machine=machine(res["device"]),
               versions=versions(), **res)
    path = os.path.join(out_dir, f"{prefix}{res['device']}-{now.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    with open(os.path.join(out_dir, f"latest-{prefix}{res['device']}.json"), "w") as f:
        json.dump(doc, f, indent=1, default=str)
    return path
