"""The figures of README.md and docs/*.md are backed: the measured ones are the committed JSON under
bench/results/, rendered (bench.readme_numbers), so a number edited by hand, a JSON re-measured without
rewriting the docs, or a table whose file is gone fails here; the others are what the code and the tests
hold (the presets, the tolerances, the head's keywords, the layers, the bounds a doc attributes to a test).
Parsing only: no benchmark runs."""
import inspect
import json
import math
import os
import re
from pathlib import Path

import torch

from bench import readme_numbers as rn

ROOT = Path(rn.ROOT)
# every rendered table and the page that holds it
TABLES = {"logits_summary": "README.md", "linear_summary": "README.md", "logits": "docs/benchmarks.md",
          "linear": "docs/benchmarks.md", "aot": "docs/benchmarks.md", "head": "docs/head.md",
          "parallel": "docs/parallelism.md", "toy": "docs/trainers.md", "gpu_profile": "docs/benchmarks.md",
          "gpu_peers": "docs/benchmarks.md", "gpu_tune": "docs/benchmarks.md"}


def rendered():
    """[(page, name, json path, body)] over README.md and docs/."""
    return [(os.path.relpath(doc, rn.ROOT), name, path, body)
            for doc in rn.documents() for name, path, body in rn.blocks(open(doc).read())]


def test_every_table_matches_its_json():
    found = {name: page for page, name, _, _ in rendered()}
    assert found == TABLES, found
    for page, name, path, body in rendered():
        assert path.startswith("bench/results/") and path.endswith(".json"), path
        assert (ROOT / path).exists(), path
        assert body != rn.PLACEHOLDER + "\n", (page, name)
    problems = [p for doc in rn.documents() for p in rn.drift(open(doc).read(), doc)]
    assert problems == []


def test_a_table_holds_its_files_numbers():
    """The rendering quotes the JSON's figures: dates, commits, each row's median time and peak memory."""
    for page, name, path, body in rendered():
        doc = json.load(open(ROOT / path))
        if name == "head":  # the accounting: every row's GEMM work appears
            for r in doc["rows"]:
                if "unavailable" not in r:
                    assert f"{r['gemm_flops'] / 1e6:.0f}" in body, (r["case"], r["provider"])
            continue
        if name == "aot":  # a list of compiled kernels: every one of ours quotes its instructions per element
            for r in doc:
                if r["provider"] == "gtpo_kernels" and r["dtype"] == "bfloat16":
                    assert f"{r['instr_per_elem']:.2f}, {r['regs']}" in body, (r["arch"], r["kernel"])
            continue
        if name == "gpu_profile":  # the sentence quotes each profiled call's wall time
            assert doc["date"][:10] in body
            assert all(f"{r['wall_ms']:.2f}" in body for r in doc["rows"] if r["impl"].startswith("triton")
                       and r["tokens"] * r["V"] == max(x["tokens"] * x["V"] for x in doc["rows"])), body
            continue
        if name == "gpu_tune":  # the fastest forward of the sweep
            assert f"{min(r['fwd_ms'] for r in doc['cuda']):.2f} ms" in body, body
            continue
        if name == "gpu_peers":  # ratios of the grid's rows: the files are named
            assert path in body
            continue
        assert doc["date"][:10] in body and (doc["commit"] or "?")[:7] in body, (page, name)
        if name == "toy":
            assert f"{sum(doc['arms']['gtpo']['reward'][-10:]) / 10:.3f}" in body
            continue
        for r in doc.get("rows", []):
            if r["status"] != "ok" or "peak_bytes" not in r:
                continue
            if name in ("logits", "linear") and r.get("time_ms"):
                t = r["time_ms"]["full"] / (1e3 if name == "linear" else 1)
                assert (f"{t:.2f}" if name == "linear" else f"{t:.1f}") in body, (name, r["label"], t)
            if name in ("linear", "linear_summary") and r["impl"] in ("fused", "trl"):
                assert rn._mib(r["peak_bytes"]) in body, (name, r["label"])


def test_drift_is_caught():
    """Any number changed in a table (or a missing JSON behind a rendered table) is reported."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    name, path, body = next(b for b in rn.blocks(text) if b[0] == "linear")
    digit = next(i for i, ch in enumerate(body) if ch.isdigit() and i > body.index("|"))
    edited = body[:digit] + str((int(body[digit]) + 1) % 10) + body[digit + 1:]
    assert rn.drift(text.replace(body, edited)) != []
    moved = text.replace(f"<!-- bench:linear {path} -->", "<!-- bench:linear bench/results/none.json -->")
    assert rn.drift(moved) != []


# ---------------------------------------------------------------- figures the code and the tests hold

def _table(page, first_header):
    """The rows (lists of cells) of the markdown table of `page` whose header starts with `first_header`."""
    lines = (ROOT / page).read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {first_header} |"))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip("|").split("|")])
    return rows


def test_presets_table_is_the_code():
    """docs/usage.md's presets table: each row is GTPOConfig.preset(name)'s fields."""
    from gtpo_kernels import GTPOConfig
    rows = _table("docs/usage.md", "preset")
    assert len(rows) >= 20  # every preset (dro's row with a dro_beta: it has no default)
    for name, conflict, h_max, gamma, policy, clip, agg in rows:
        n = name.split()[0].strip("`")
        c = GTPOConfig.preset(n, **({"dro_beta": 0.1} if n == "dro" else {}))
        assert conflict == (f"{c.conflict_pos_weight} / {c.conflict_neg_weight}" if c.use_conflict_mask else "off")
        h = c.entropy_threshold if c.use_conflict_mask or c.entropy_threshold is not None else None
        assert h_max == ("off" if h is None else "ln 2" if math.isclose(h, math.log(2)) else f"{h:g}"), name
        assert gamma == f"{c.entropy_penalty:g}", name
        assert policy == f"{c.policy_loss.upper()}, {c.importance_sampling_level}", name
        expect = ("off" if not c.clip else f"{c.eps_low:g} / {c.eps_high:g}" if c.policy_loss in ("ppo", "verl-cispo")
                  else f"- / {c.eps_high}" if c.policy_loss == "cispo" else "-")
        assert clip == expect, name
        assert agg == c.loss_agg, name


def test_tolerances_are_the_tests():
    """docs/accuracy.md's bounds are tests/conftest.py's TOL."""
    from conftest import TOL
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
              "float64": torch.float64}
    rows = _table("docs/accuracy.md", "logits dtype")
    assert {r[0] for r in rows} == set(dtypes)
    for dt, value, loss, grad in rows:
        t = TOL[dtypes[dt]]
        assert (float(value), float(loss), float(grad)) == (t["value"], t["loss"], t["grad"]), dt


def test_head_keywords_are_documented():
    """docs/head.md: linear_gtpo_loss takes gtpo_loss's keywords but the ones it names, plus its own."""
    from gtpo_kernels import gtpo_loss, linear_gtpo_loss
    ours = set(inspect.signature(gtpo_loss).parameters) - {"logits"}
    head = set(inspect.signature(linear_gtpo_loss).parameters) - {"hidden", "weight"}
    text = (ROOT / "docs" / "head.md").read_text()
    m = re.search(r"Its keywords are `gtpo_loss`'s; of them, (.*?) take only their defaults .*? plus the head's "
                  r"own: (.*?) \(", text, re.S)
    fixed, extra = (set(re.findall(r"`(\w+)`", g)) for g in m.groups())
    assert not ours - head and extra == head - ours, (ours - head, head - ours)
    params = inspect.signature(linear_gtpo_loss).parameters
    assert fixed == {"logits_start", "inplace"} and \
        all(params[k].default in (None, False) for k in fixed)


def test_layers_are_the_checked_ones():
    """docs/design.md: the number of layers and the layer folders are tests/test_layers.py's LAYERS."""
    from test_layers import LAYERS
    text = (ROOT / "docs" / "design.md").read_text()
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
    assert f"is {words[len(LAYERS)]} layers" in text
    folders = re.findall(r"^  (\w+)/ ", text, re.M)
    assert sorted(folders) == sorted(LAYERS), folders


# (page, the figure as the page writes it (line breaks aside), the test file that asserts it, the assertion's text)
FROM_TESTS = [
    ("docs/parallelism.md", "within 1e-5 of one process on the whole vocabulary (1e-4 for the head's gradients)",
     "tests/test_parallel.py", '(1e-4 if "linear" in key else 1e-5)'),
    ("docs/parallelism.md", "whole batch within 1e-5 for every row", "tests/test_parallel_dp.py", "<= 1e-5"),
    ("docs/parallelism.md", "by more than 1e-3", "tests/test_parallel_dp.py", '["seq-mean/uneven/naive"] > 1e-3'),
    ("docs/trainers.md", "to a relative 1e-5: `tests/test_trl_losses.py`", "tests/test_trl_losses.py",
     "loss_rel < 1e-5"),
    ("docs/head.md", "within the tile budget + the float32 weight-gradient accumulator + 8 MiB",
     "tests/test_linear.py", 'm["budget"] + weight_acc + (8 << 20)'),
    ("docs/head.md", "more than two `N x V` float32 buffers", "tests/test_linear.py", '> 2 * mat["logits"]'),
    ("docs/head.md", "(N = 2048 tokens, D = 256, V = 16000, float32, a 16 MiB tile budget)", "tests/test_linear.py",
     "N, D, V, budget = 2048, 256, 16000, 16 << 20"),
    ("docs/accuracy.md", "to 1e-4 in float32 and 1e-2 in 16-bit dtypes", "tests/test_linear.py",
     "WEIGHT_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}"),
    ("docs/benchmarks.md", "counts 2.000", "tests/test_bench.py", 'res["read_ratio"] == 2.0'),
]


def test_figures_attributed_to_tests_are_theirs():
    for page, figure, test_file, assertion in FROM_TESTS:
        assert " ".join(figure.split()) in " ".join((ROOT / page).read_text().split()), (page, figure)
        assert assertion in (ROOT / test_file).read_text(), (test_file, assertion)


def test_the_summaries_name_the_command_and_its_time():
    """Each README summary says which command printed its figures and how long that took; one measured at
    another point than `python -m bench`'s gives the command for its point and says so."""
    text = (ROOT / "README.md").read_text()
    body = {name: b for name, _, b in rn.blocks(text)}
    assert "printed by `python -m bench`, whose logits suite took" in body["logits_summary"]
    lin = json.load(open(ROOT / "bench/results/latest-linear-cpu.json"))
    assert f"in {lin['wall_s'] / 60:.1f} min" in body["linear_summary"]
    assert ("`python -m bench --suite linear --linear-size 4096,1024,32000 --threads 2`" in body["linear_summary"]
            and "(`python -m bench` measures 1024,256,8192 only)" in body["linear_summary"])
