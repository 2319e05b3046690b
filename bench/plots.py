"""PNG plots of a run: time and peak memory against tokens (one panel per V) and against the vocabulary
size (one panel per token count), one line per implementation; on CUDA also the fraction of the copy
bandwidth (section 8's floor) reached by each implementation's forward+backward."""
from __future__ import annotations

import os


def _series(rows, key, x_name, fixed_name, fixed):
    """{label: [(x, y)]} for rows with `fixed_name == fixed`."""
    out = {}
    for r in rows:
        if r[fixed_name] != fixed:
            continue
        y = key(r)
        if isinstance(y, (int, float)):
            out.setdefault(r["label"], []).append((r[x_name], y))
    return {k: sorted(v) for k, v in out.items()}


def _color(label):
    """One colour per implementation in every panel and figure."""
    from .providers import LABELS
    names = list(LABELS.values())
    return f"C{names.index(label) if label in names else len(names)}"


def _why_missing(rows, label):
    """Why `label` has no point in a figure: its rows' status and note."""
    rs = [r for r in rows if r["label"] == label]
    why = sorted({(r["status"] + (": " + r["note"] if r.get("note") else "")) if r["status"] != "ok"
                  else ("; ".join(x for x in (r.get("note"), r.get("peak_note")) if x) or "no value") for r in rs})
    return "; ".join(why)


def _figure(rows, key, ylabel, title, x_name, fixed_name, path, log=None, all_rows=()):
    """One figure, one panel per value of `fixed_name` that has data; None when no panel has any.
    Panels and implementations left out are reported through `log`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    name = os.path.basename(path)
    panels = [(fv, s) for fv in sorted({r[fixed_name] for r in rows})
              for s in [_series(rows, key, x_name, fixed_name, fv)] if s]
    fixed_label = "V" if fixed_name == "V" else "tokens"
    if log is not None:
        empty = sorted({r[fixed_name] for r in all_rows} - {fv for fv, _ in panels})
        drawn = {label for _, s in panels for label in s}
        left = [f"no line for {label} ({_why_missing(all_rows, label)})"
                for label in dict.fromkeys(r["label"] for r in all_rows) if label not in drawn]
        if empty:
            left.append(f"no panel for {fixed_label} = {', '.join(map(str, empty))} (no data)")
        if left:
            log(f"plot {name}: " + "; ".join(left))
    if not panels:
        if os.path.exists(path):  # a figure of an earlier run would read as this run's
            os.remove(path)
        if log is not None:
            log(f"plot {name}: not written (no data)")
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (fv, series) in zip(axes[0], panels):
        for label, pts in series.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label, color=_color(label))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens" if x_name == "tokens" else "vocabulary size V")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{fixed_label} = {fv}", fontsize=9)
        ax.grid(alpha=0.3)
    max(axes[0], key=lambda a: len(a.get_lines())).legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(res, out_dir, log=None):
    """Writes the figures into out_dir and returns their paths. Panels and lines without data are not
    drawn; `log` (e.g. print), when given, is told which were left out and why."""
    all_rows = res["rows"]
    rows = [r for r in all_rows if r["status"] == "ok"]
    dev = res["device"]
    tag = f"{dev}-{res['dtype']}"
    specs = [
        ("time", lambda r: r.get("time_ms", {}).get("full"), "ms (forward+backward)"),
        ("memory", lambda r: r["peak_bytes"] / 2**20 if "peak_bytes" in r else None, "peak MiB above inputs"),
    ]
    if dev == "cuda":
        specs.append(("bandwidth", lambda r: 100 * r["bandwidth_fraction"]["full"] if "bandwidth_fraction" in r
                      else None, "% of copy bandwidth (fwd+bwd)"))
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, key, ylabel in specs:
        for x_name, fixed in (("tokens", "V"), ("V", "tokens")):
            p = _figure(rows, key, ylabel, f"{name} on {dev} ({res['dtype']}, preset {res['preset']})", x_name,
                        fixed, os.path.join(out_dir, f"{tag}-{name}-vs-{x_name.lower()}.png"), log=log,
                        all_rows=all_rows)
            if p:
                paths.append(p)
    return paths
