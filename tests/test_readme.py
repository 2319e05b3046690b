"""Every python block of README.md and docs/*.md runs as written, on its own: each is copied into a file
and run as `python snippet.py` in an empty temporary folder (Triton's interpreter on, as for the tests), in a
process of its own forked from an interpreter that imported torch and nothing else (tests/zygote.py), and
must exit 0 without a warning of this package's, nor a FutureWarning of any library's. A block that needs
what a test machine may lack says so on the line before it:
- `<!-- snippet: needs trl -->`: runs when TRL is installed (the `trl` extra), skipped otherwise.
Nothing else is exempt. The quick start's commands are the lines CI runs."""
import os
import re
from pathlib import Path

import pytest
import zygote

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "GTPO_SPEC.md")
BLOCK = re.compile(r"^(?:<!-- snippet: (.*?) -->\n)?```python\n(.*?)^```", re.M | re.S)
NEEDS = {"needs trl": "trl"}


def python_blocks():
    """[(id, marker or None, code)] of every ```python block of the README and docs/."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for i, m in enumerate(BLOCK.finditer(text)):
            line = text[:m.start()].count("\n") + 1
            out.append((f"{doc.relative_to(ROOT)}:{line}", m.group(1), m.group(2)))
    return out


BLOCKS = python_blocks()


def test_every_python_block_is_collected():
    """The pattern sees every ```python fence, and markers are few and known."""
    fences = sum(doc.read_text().count("```python") for doc in DOCS)
    assert fences == len(BLOCKS) and fences >= 8, (fences, len(BLOCKS))
    markers = [m for _, m, _ in BLOCKS if m]
    assert all(m in NEEDS for m in markers), markers
    assert len(markers) <= 2, markers


@pytest.mark.parametrize("where,marker,code", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_python_block_runs_in_a_fresh_process(where, marker, code, tmp_path):
    if marker:
        pytest.importorskip(NEEDS[marker])
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="default")
    env.pop("PYTHONPATH", None)  # the installed package, as a reader has it
    # `python snippet.py`, forked from an interpreter that imported torch alone (tests/zygote.py)
    r = zygote.run([script], cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 0, f"{where} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    ours = [ln for ln in r.stderr.splitlines() if "Warning" in ln and ("gtpo" in ln or "snippet.py" in ln)]
    assert not ours, f"{where} warns:\n" + "\n".join(ours)
    # a deprecated argument in a block is ours to fix, whichever library warns about it
    future = [ln for ln in r.stderr.splitlines() if "FutureWarning" in ln]
    assert not future, f"{where} uses something deprecated:\n" + "\n".join(future)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snippet.py"], \
        f"{where} left files behind: {sorted(p.name for p in tmp_path.iterdir())}"


def test_ci_runs_the_readme_test_commands():
    """The README's test commands (quick start's second, and verl's environment) are the lines .ci/run runs."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    lines = [ln for ln in readme.splitlines() if ln.startswith("pip install") and "pytest" in ln]
    assert len(lines) == 2 and any("[test,trl,demo]" in ln for ln in lines) and any("verl" in ln for ln in lines)
    for ln in lines:
        assert ln in ci, f"README's {ln!r} is not a line of .ci/run"


def test_the_torch_choice_comes_before_any_torch_install():
    """A plain `pip install torch==...` pulls PyPI's CUDA build on Linux: the README shows the CPU/CUDA
    choice (the CPU wheel index) before the first line that installs torch without it."""
    lines = (ROOT / "README.md").read_text().splitlines()
    torch_lines = [i for i, ln in enumerate(lines) if re.search(r"pip install torch\b", ln)]
    choice = next(i for i in torch_lines if "--index-url https://download.pytorch.org/whl/cpu" in lines[i])
    assert choice == torch_lines[0], lines[torch_lines[0]]


def test_readme_is_short_and_in_order():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 260
    heads = [ln for ln in text.splitlines() if ln.startswith("## ")]
    assert heads == ["## Status", "## Install", "## Quick start", "## Your trainer", "## The shortest example",
                     "## Documentation"], heads


def test_no_word_about_where_or_how_it_was_built():
    """The README, docs/ and the examples speak to users: not about the machines the package was
    developed on, its sessions or an issue tracker."""
    banned = re.compile(r"this project's|local wheel cache|\bsessions?\b|\bissue \d+|\bissues? #\d+|measured here",
                        re.I)
    for doc in DOCS + sorted((ROOT / "examples").glob("*.py")):
        for n, ln in enumerate(doc.read_text().splitlines(), 1):
            assert not banned.search(ln), f"{doc.relative_to(ROOT)}:{n}: {ln.strip()}"
