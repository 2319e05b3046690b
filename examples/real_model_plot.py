"""Plots and summarizes the two runs of examples/real_model.py (GTPO and GRPO) written to one folder.

    python examples/real_model_plot.py real_out     # reads real_out/{gtpo,grpo}.json, writes real_out/real_model.png

Panels against the optimizer step: reward (mean over the batch, on the steps that generate), entropy of
the completion tokens (whole vocabulary at the sampling temperature, measured the same way in both runs),
the conflict-token fraction (spec section 3, measured on each run's own batch), the clip fraction (GTPO:
the package's `gtpo/clip_frac`; GRPO: TRL's `clip_ratio/region_mean`), the full softmax's mass on the
top-p sets, the fraction of completions GTPO's entropy filter drops, the step time and the peak RSS. Prints one summary line per run (the figures quoted in docs/trainers.md).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

LOSSES = ("gtpo", "grpo")
COLORS = {"gtpo": "tab:blue", "grpo": "tab:orange"}
CLIP = {"gtpo": "gtpo/clip_frac", "grpo": "clip_ratio/region_mean"}


def series(run, key):
    """(steps, values) of a logged metric, the steps where it was logged."""
    pts = [(s["step"], s["logs"][key]) for s in run["steps"] if key in s.get("logs", {})]
    return [p[0] for p in pts], [p[1] for p in pts]


def mean(xs):
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def summary(run):
    """The figures of one run: reward and entropy at the start and end (mean of the first and last
    three generation steps), means of the conflict and clip fractions, median step time, peak RSS."""
    loss = run["loss"]
    _, r = series(run, "reward")
    _, h = series(run, "measured/entropy_full")
    _, c = series(run, "measured/conflict_frac")
    _, k = series(run, CLIP[loss])
    _, m = series(run, "measured/kept_mass")
    t = sorted(s["seconds"] for s in run["steps"])
    out = {"reward_first3": mean(r[:3]), "reward_last3": mean(r[-3:]), "entropy_first3": mean(h[:3]),
           "entropy_last3": mean(h[-3:]), "conflict_frac_mean": mean(c), "clip_frac_mean": mean(k),
           "kept_mass_mean": mean(m), "step_seconds_median": t[len(t) // 2] if t else float("nan"),
           "steps": len(run["steps"]), "seconds_total": run["seconds_total"], "peak_rss_mb": run["peak_rss_mb"]}
    _, f = series(run, "gtpo/filtered_frac")
    if f:
        out["filtered_frac_mean"] = mean(f)
    return out


def line(loss, s):
    txt = (f"{loss}: {s['steps']} steps, {s['seconds_total']:.0f} s; reward {s['reward_first3']:.3f} -> "
           f"{s['reward_last3']:.3f} (first / last 3 generation steps); entropy {s['entropy_first3']:.3f} -> "
           f"{s['entropy_last3']:.3f}; conflict frac {s['conflict_frac_mean']:.3f}; clip frac "
           f"{s['clip_frac_mean']:.3f}; kept mass {s['kept_mass_mean']:.3f}; median step "
           f"{s['step_seconds_median']:.1f} s; peak RSS {s['peak_rss_mb']:.0f} MiB")
    return txt + (f"; filtered frac {s['filtered_frac_mean']:.3f}" if "filtered_frac_mean" in s else "")


def plot(runs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("reward", "reward (mean)"), ("measured/entropy_full", "entropy (nats, whole vocab.)"),
              ("measured/conflict_frac", "conflict-token fraction"), (None, "clip fraction"),
              ("measured/kept_mass", "mass on the top-p sets"),
              ("gtpo/filtered_frac", "completions dropped by GTPO's entropy filter"),
              ("seconds", "step time (s)"), ("peak_rss_mb", "peak RSS (MiB)")]
    fig, axes = plt.subplots(2, 4, figsize=(17, 7))
    for ax, (key, title) in zip(axes.flat, panels):
        for loss, run in runs.items():
            if key in ("seconds", "peak_rss_mb"):
                x, y = [s["step"] for s in run["steps"]], [s[key] for s in run["steps"]]
            else:
                x, y = series(run, key or CLIP[loss])
            if x:
                ax.plot(x, y, marker="o", ms=3, lw=1.2, color=COLORS[loss], label=loss.upper())
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    any_run = next(iter(runs.values()))
    st = any_run["settings"]
    fig.suptitle(f"SmolLM2-135M-Instruct, GTPO vs GRPO (TRL {any_run['versions']['trl']}): "
                 f"{st['prompts']} prompts x {st['group']} completions, {st['max_new_tokens']} new tokens, "
                 f"T={st['temperature']}, top-p={st['top_p']}, lr={st['lr']}, seed {st['seed']}; "
                 f"{any_run['machine']['cpu']}, 1 thread per run", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    folder = Path(argv[0])
    runs = {loss: json.loads((folder / f"{loss}.json").read_text())
            for loss in LOSSES if (folder / f"{loss}.json").exists()}
    if not runs:
        print(f"no gtpo.json / grpo.json in {folder}")
        return 1
    summaries = {loss: summary(run) for loss, run in runs.items()}
    for loss, s in summaries.items():
        print(line(loss, s))
    (folder / "summary.json").write_text(json.dumps(summaries, indent=1))
    plot(runs, folder / "real_model.png")
    print(f"-> {folder / 'real_model.png'}, {folder / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
