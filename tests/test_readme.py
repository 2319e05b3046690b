"""The README's python snippets run as written (so the README cannot silently rot).

Every ```python block of README.md carries a marker comment on the line before it:
- `<!-- snippet: run "Use it" -->`: the "Use it" example, run on its own;
- `<!-- snippet: run after "Use it" -->`: run in the namespace the "Use it" example leaves (its model,
  rollout and config), and must give a finite, nonzero loss whose gradient reaches the model;
- `... in a process group -->`: the same inside a one-process gloo group (dist.init_process_group first);
- `<!-- snippet: run -->`: runs alone (the TRL trainer, when TRL is installed);
- `<!-- snippet: excerpt of FILE -->`: every code line is a line of FILE;
- `<!-- snippet: outline ... -->`: another framework's names; it must compile.
"""
import os
import re
import runpy
import warnings

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SNIPPET = re.compile(r"^<!-- snippet: (.*?) -->\n```python\n(.*?)^```", re.M | re.S)


def readme():
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def snippets(kind):
    """[(marker, code)] of the README's python blocks whose marker starts with `kind`."""
    return [(m, c) for m, c in SNIPPET.findall(readme()) if m.startswith(kind)]


def test_every_python_block_has_a_marker():
    assert readme().count("```python") == len(SNIPPET.findall(readme())), \
        "a ```python block of README.md has no `<!-- snippet: ... -->` line before it"


def run_use_it(tmp_path, monkeypatch):
    """Runs the "Use it" example as a reader would (a file of its own, from another folder) and returns
    its namespace; fails on any gtpo_loss warning (e.g. the entropy filter dropping every completion)."""
    (marker, code), = snippets('run "Use it"')
    assert "gtpo_loss(" in code and ".backward()" in code
    script = tmp_path / "use_it.py"
    script.write_text(code)
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ns = runpy.run_path(str(script), run_name="__main__")
    ours = [str(w.message) for w in caught if str(w.message).startswith("gtpo_loss:")]
    assert not ours, ours
    return ns


def test_readme_use_it_snippet_runs(tmp_path, capsys, monkeypatch):
    run_use_it(tmp_path, monkeypatch)
    assert "filtered_frac" in capsys.readouterr().out


def _run_after_use_it(code, tmp_path, monkeypatch):
    ns = run_use_it(tmp_path, monkeypatch)
    ns["model"].zero_grad(set_to_none=True)
    exec(compile(code, "README snippet", "exec"), ns)
    loss = ns["out"].loss.detach()
    assert torch.isfinite(loss) and float(loss) != 0.0, float(loss)
    grads = [p.grad for p in ns["model"].parameters() if p.grad is not None]
    assert grads and any(float(g.abs().sum()) > 0 for g in grads), "no gradient reached the model"


AFTER = [c for m, c in snippets('run after "Use it"') if not m.endswith("in a process group")]
IN_GROUP = [c for m, c in snippets('run after "Use it"') if m.endswith("in a process group")]


@pytest.mark.parametrize("code", AFTER, ids=[c.split("\n")[0][:40] for c in AFTER])
def test_readme_snippet_after_use_it(code, tmp_path, monkeypatch):
    """From per-token log-probs, from hidden states: a nonzero loss and gradient on the fresh model."""
    _run_after_use_it(code, tmp_path, monkeypatch)


@pytest.mark.parametrize("code", IN_GROUP, ids=[c.split("\n")[0][:40] for c in IN_GROUP])
def test_readme_snippet_in_a_process_group(code, tmp_path, monkeypatch):
    """Tensor and data parallelism: in a one-process gloo group."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        if "gtpo_loss(" in code and "lam=lam[mb]" not in code:
            _run_after_use_it(code, tmp_path, monkeypatch)
        else:  # the data-parallel conflict weights: those of one process
            ns = run_use_it(tmp_path, monkeypatch)
            exec(compile(code, "README snippet", "exec"), ns)
            from gtpo_kernels import conflict_weights
            lam, n_conf = conflict_weights(ns["completion_ids"], ns["completion_mask"], ns["advantages"],
                                           group_size=ns["G"])
            assert torch.equal(ns["lam"], lam) and torch.equal(ns["n_conf"], n_conf)
            assert torch.isfinite(ns["out"].loss) and float(ns["out"].loss) != 0.0
    finally:
        dist.destroy_process_group()


def test_readme_trl_snippet_runs(tmp_path, monkeypatch):
    """The TRL example trains two steps on the CPU (a tiny model built from a config, no downloads)."""
    pytest.importorskip("trl")
    (marker, code), = [(m, c) for m, c in snippets("run") if m == "run"]
    assert "GTPOTrainer(" in code and "use_cpu=True" in code
    monkeypatch.chdir(tmp_path)
    ns = {"__name__": "__main__"}
    exec(compile(code, "README TRL snippet", "exec"), ns)
    assert ns["trainer"].state.global_step == 2
    losses = [h["loss"] for h in ns["trainer"].state.log_history if "loss" in h]
    assert all(torch.isfinite(torch.tensor(x)) for x in losses)


def test_readme_excerpts_are_in_their_files():
    for marker, code in snippets("excerpt of "):
        path = marker[len("excerpt of "):]
        with open(os.path.join(ROOT, path)) as f:
            lines = {ln.split("  #")[0].strip() for ln in f}
        for ln in code.splitlines():
            part = ln.split("  #")[0].strip()
            assert not part or part in lines, f"README's excerpt of {path}: {part!r} is not a line of it"


def test_readme_outlines_compile():
    for marker, code in snippets("outline"):
        compile(code, "README outline", "exec")


def test_ci_runs_the_readme_test_commands():
    """The README's test commands (quick start's second, and verl's environment) are the lines .ci/run runs."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    ci = open(os.path.join(ROOT, ".ci", "run")).read().splitlines()
    lines = [ln for ln in readme.splitlines() if ln.startswith("pip install") and "pytest" in ln]
    assert len(lines) == 2 and any("[test,trl,demo]" in ln for ln in lines) and any("verl" in ln for ln in lines)
    for ln in lines:
        assert ln in ci, f"README's {ln!r} is not a line of .ci/run"
