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
        if y is not None:
            out.setdefault(r["label"], []).append((r[x_name], y))
    return {k: sorted(v) for k, v in out.items()}


def _color(label):
    """One colour per implementation in every panel and figure."""
    from .providers import LABELS
    names = list(LABELS.values())
    return f"C{names.index(label) if label in names else len(names)}"


def _figure(rows, key, ylabel, title, x_name, fixed_name, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fixed_vals = sorted({r[fixed_name] for r in rows})
    fig, axes = plt.subplots(1, len(fixed_vals), figsize=(4.5 * len(fixed_vals), 3.6), squeeze=False)
    drawn = False
    for ax, fv in zip(axes[0], fixed_vals):
        for label, pts in _series(rows, key, x_name, fixed_name, fv).items():
            if len(pts) >= 1:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label, color=_color(label))
                drawn = True
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens" if x_name == "tokens" else "vocabulary size V")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{'V' if fixed_name == 'V' else 'tokens'} = {fv}", fontsize=9)
        ax.grid(alpha=0.3)
    if not drawn:
        plt.close(fig)
        return None
    next(ax for ax in axes[0] if ax.get_lines()).legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(res, out_dir):
    rows = [r for r in res["rows"] if r["status"] == "ok"]
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
                        fixed, os.path.join(out_dir, f"{tag}-{name}-vs-{x_name.lower()}.png"))
            if p:
                paths.append(p)
    return paths
