"""The timing suites' stdout tables and the cells they share with the README's (ratios, the load line);
the JSON file and its stamp: bench/common/record.py."""
from __future__ import annotations


def _mb(b):
    return f"{b / 2**20:,.0f} MiB" if b >= 2**20 else f"{b / 2**10:,.0f} KiB"


def _ms(x):
    return f"{x:.1f}" if x >= 1 else f"{x:.3f}"


def _time(r, mode):
    """'median (min-max)' of one mode's rounds, or '-'."""
    t, rg = r.get("time_ms", {}).get(mode), r.get("time_range_ms", {}).get(mode)
    if t is None:
        return "-"
    return f"{_ms(t)} ({_ms(rg[0])}-{_ms(rg[1])})" if rg else _ms(t)


def ratio_cell(v):
    """A per-round ratio summary as 'median (min-max)', '!' when unreliable; an old float as is."""
    if v is None:
        return "-"
    if isinstance(v, (int, float)):
        return f"{v:.2f}x"
    return f"{v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f}){' !' if v.get('unreliable') else ''}"


def load_line(load):
    """One line on the machine's load during the run, and whether it makes every ratio unreliable."""
    if not load:
        return "load average: not recorded."
    line = (f"load average (1 min) {load['before'][0]:.2f} before, {load['after'][0]:.2f} after, "
            f"{load['cores']} cores")
    limits = f"limits {load['limit']:g} before, {load.get('limit_after', load['limit']):g} after"
    return line + (f": ABOVE the {limits}: other work shared the machine, every time ratio of this run is "
                   f"unreliable." if load["loaded"] else f" ({limits}).")


def _note(r):
    status = r["status"]
    if status == "ok" and not r.get("errors", {}).get("within_spec", True):
        status = "ok*"
    if status == "wrong":
        status = f"WRONG: {r.get('check', '')}"
    if status in ("ok", "ok*") and "time_ms" not in r and r.get("check"):
        status = f"{status}, checked: {r['check']}"  # a row checked and not timed (--check-only) says so
    noisy = "unreliable: fwd alone above fwd+bwd's slowest round" if r.get("fwd_above_full") else ""
    return "; ".join(x for x in (status if status != "ok" else "", noisy, r.get("note", ""), r.get("peak_note", ""),
                                 f"compile {r['compile_s']:.1f} s" if r.get("compile_s") else "") if x)


def table(res):
    modes = [m for m in ("full", "fwd", "bwd") if m in res["modes"]]
    names = {"full": "fwd+bwd", "fwd": "fwd", "bwd": "bwd (= fwd+bwd - fwd)"}
    head = (["implementation", "size (tok x V)"] + [f"{names[m]} ms (min-max)" for m in modes]
            + ["fwd+bwd vs eager (per round)", "peak above inputs", "saved B/tok", "traffic fwd-r/bwd-r/bwd-w",
               "status / note"])
    if res["device"] == "cuda":
        head.insert(3 + len(modes), "% copy bw")
    liger = any("vs_liger" in r for r in res["rows"])
    if liger:
        head.insert(head.index("fwd+bwd vs eager (per round)") + 1, "fwd+bwd vs Liger (per round)")
    lines = []
    for r in res["rows"]:
        tr = r.get("traffic")
        cells = ([r["label"], f"{r['tokens']} x {r['V']}"] + [_time(r, m) for m in modes]
                 + [ratio_cell(r.get("vs_eager", {}).get("full")),
                    _mb(r["peak_bytes"]) if "peak_bytes" in r else "-",
                    f"{r['saved_bytes_per_token']:,.0f}" if "saved_bytes_per_token" in r else "-",
                    f"{tr['fwd_read']:.4f}/{tr['bwd_read']:.4f}/{tr['bwd_write']:.4f}" if tr else "-", _note(r)])
        if liger:
            cells.insert(3 + len(modes), ratio_cell(r.get("vs_liger", {}).get("full")))
        if res["device"] == "cuda":
            bw = r.get("bandwidth_fraction")
            floor = " (floor)" if r.get("bytes_basis", "").startswith("section 8") else ""
            cells.insert(3 + len(modes) + liger, "/".join(f"{100 * bw[m]:.0f}" for m in modes if m in bw) + floor if bw
                         else "-")
        lines.append(cells)
    out = [format_rows(head, lines), ""]
    out.append(f"device {res['device']}, {res['dtype']}, preset {res['preset']} (Liger: grpo). " + (
               "Checked only, not timed (--check-only)." if not res["repeats"] else f"Times: median (min-max) "
               f"of {res['repeats']} interleaved rounds after {res.get('warmup', '?')} warm-up round(s), every "
               f"implementation forward+backward then forward in each round"
               + (" (CUDA: synchronized, each sample ~20 ms of calls)" if res["device"] == "cuda" else
                  " (CPU wall clock)") + "; vs eager: each round's time over eager's in the same round."))
    out.append(load_line(res.get("load")) + " " + res.get("rule", ""))
    out.append("peak above inputs: one forward+backward, gradient included"
               + (" (max_memory_allocated)." if res["device"] == "cuda" else
                  " (peak resident size of a fresh process per implementation)."))
    out.append("saved B/tok: storages saved for backward per token (saved_tensors_hooks), the logits excluded.")
    if res.get("traffic"):
        t = res["traffic"]
        out.append(f"traffic: bytes the Triton kernels move / the ideal (each logit read once forward, read and "
                   f"written once backward), counted in the interpreter at {t['tokens']} x {t['V']} {t['dtype']} "
                   f"(self-test reads twice: {t['self_test']['read_ratio']:.3f}, "
                   f"{'ok' if t['self_test']['ok'] else 'FAILED'}).")
    if res.get("copy_bandwidth_GBps"):
        out.append(f"% copy bw: bytes moved / time, over the copy bandwidth measured in this run "
                   f"({res['copy_bandwidth_GBps']:.0f} GB/s, read + write). Bytes moved: ours, the counted rows read "
                   f"forward, the rows with a gradient read backward, every row of the gradient written; Liger, every "
                   f"counted row read in both passes; '(floor)': section 8's floor for an implementation that moves "
                   f"more (`bytes_basis` in the JSON).")
    seen = {}
    for r in res["rows"]:
        if r.get("computes"):
            seen.setdefault(r["label"], r["computes"])
    if seen:
        out.append("what each row computes: " + "; ".join(f"{k}: {v}" for k, v in seen.items()) + ".")
    out.append("ok*: within float32 accuracy (1e-4) but beyond the 1e-5 our kernels are held to.")
    return "\n".join(out)


def format_rows(head, lines):
    """Columns padded to their widest cell, a dashed rule under the header."""
    widths = [max(len(str(c)) for c in col) for col in zip(head, *lines)]
    fmt = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(c) for c in lines])
