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


def _median(v):
    """A per-round ratio summary's median (an older JSON's plain number as is)."""
    return v["median"] if isinstance(v, dict) else v


def plot_linear(res, out_dir, log=None):
    """The linear suite's figures: forward+backward time over TRL's and peak memory, one group of bars per
    size (N x D x V), one bar per implementation; implementations without a value are left out and said so.
    Returns the paths written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from .linear import LABELS
    rows = res["rows"]
    sizes = [tuple(s) for s in res["sizes"]]
    labels = list(dict.fromkeys(r["label"] for r in rows))
    tag = f"linear-{res['device']}-{res['dtype']}"
    specs = [("time", lambda r: _median(r.get("vs_trl", {}).get("full")), "fwd+bwd time / TRL's (median of rounds)"),
             ("memory", lambda r: r["peak_bytes"] / 2**20 if "peak_bytes" in r else None,
              "peak MiB above inputs and gradients")]
    names = list(LABELS.values())
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, key, ylabel in specs:
        path = os.path.join(out_dir, f"{tag}-{name}.png")
        val = {(r["label"], (r["N"], r["D"], r["V"])): key(r) for r in rows}
        drawn = [lb for lb in labels if any(isinstance(val.get((lb, s)), (int, float)) for s in sizes)]
        missing = [lb for lb in labels if lb not in drawn]
        if log is not None and missing:
            log(f"plot {os.path.basename(path)}: no bar for " + "; ".join(
                f"{lb} ({_why_missing(rows, lb)})" for lb in missing))
        if not drawn:
            if os.path.exists(path):
                os.remove(path)
            continue
        fig, ax = plt.subplots(figsize=(max(4.5, 2.2 * len(sizes) + 1.5), 3.8))
        width = 0.8 / len(drawn)
        for j, lb in enumerate(drawn):
            xs = [i + (j - (len(drawn) - 1) / 2) * width for i in range(len(sizes))]
            ys = [val.get((lb, s)) for s in sizes]
            ys = [y if isinstance(y, (int, float)) else 0.0 for y in ys]
            ax.bar(xs, ys, width, label=lb, color=f"C{names.index(lb) if lb in names else len(names)}")
        if name == "time":
            ax.axhline(1.0, color="k", lw=0.6, ls=":")
        ax.set_xticks(range(len(sizes)))
        ax.set_xticklabels([f"{N} x {D} x {V}" for N, D, V in sizes], fontsize=8)
        ax.set_xlabel("N tokens x D x V")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
        ax.set_title(f"from hidden states: {name}\n{res['device']}, {res['dtype']}, preset {res['preset']}, "
                     f"tile {res['tile_bytes'] / 2**20:g} MiB", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
