"""The examples run as shipped: examples/train_loop.py (a home-grown loop on a tiny transformers model)
and the toy RL demo examples/toy_rl.py (torch only; matplotlib for its PNG)."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from trl_setup import ROOT, needs_transformers


# ---------------------------------------------------------------- examples/train_loop.py

@needs_transformers
def test_train_loop_example_runs(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "train_loop.py"), "--steps", "3",
                        "--prompts", "2", "--group-size", "4", "--max-new-tokens", "6"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("step ")]
    assert len(lines) == 3, r.stdout
    assert "conflict" in lines[0] and "loss" in lines[0]


# ---------------------------------------------------------------- the demo (examples/toy_rl.py)

def test_demo_runs_small(tmp_path):
    """A short run: one summary line per seed and arm by default (the per-step lines only with --verbose),
    each quoting its own curves in the JSON, which records the date, commit, machine and load."""
    out = tmp_path / "demo"
    demo = Path(__file__).resolve().parents[1] / "examples" / "toy_rl.py"
    r = subprocess.run([sys.executable, str(demo), "--steps", "4", "--warmup-steps", "20", "--seeds", "0",
                        "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(r.stdout.splitlines()) <= 8 and " step " not in r.stdout, r.stdout
    curves = json.loads((out / "toy_rl.json").read_text())
    assert {"date", "commit", "machine", "load", "seconds"} <= set(curves), sorted(curves)
    for arm in ("gtpo", "grpo"):
        c = curves["arms"][arm]
        for key in ("reward", "format_acc", "answer_acc", "conflict_frac", "mean_entropy"):
            assert len(c[key]) == 4, (arm, key)
        seed0 = c["per_seed"][0]
        tail = [sum(seed0[k]) / 4 for k in ("reward", "format_acc", "answer_acc")]
        assert (f"{arm} seed 0: last 4 steps reward {tail[0]:.3f}, format {tail[1]:.3f}, "
                f"correct {tail[2]:.3f}") in r.stdout, r.stdout
    assert curves["arms"]["grpo"]["filtered_frac"] == [0.0] * 4  # the grpo preset has no entropy filter
    assert curves["arms"]["gtpo"]["conflict_frac"][0] > 0  # the tags are shared: conflict tokens exist
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "toy_rl.png").stat().st_size > 1000


# ---------------------------------------------------------------- examples/mismatch_demo.py (spec 14)

def test_mismatch_demo_runs_small(tmp_path):
    """A small run: the four head settings, each with its mismatch against the sampler; the float32 head's
    mean |d| below the default's (the sampler computes its head in float32)."""
    demo = Path(__file__).resolve().parents[1] / "examples" / "mismatch_demo.py"
    r = subprocess.run([sys.executable, str(demo), "--vocab", "700", "--dim", "32", "--completions", "4",
                        "--tokens", "6"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    names = ("default (bf16 logits)", "batch_invariant=True", "head_dtype=torch.float32", "both")
    rows = {ln.split("|")[0].strip(): ln.split("|")[1].split() for ln in r.stdout.splitlines()
            if ln.split("|")[0].strip() in names}
    assert set(names) == set(rows), r.stdout
    mean_d = {k: float(v[1]) for k, v in rows.items()}  # k3, mean |d|, max |d|, outside
    assert mean_d["head_dtype=torch.float32"] < mean_d["default (bf16 logits)"], r.stdout
