"""bench/'s house rules: where results go (bench/out/ by default, bench/results/ with --save and only from
a clean tree) and its structure (one subpackage per tool, every import resolving, no import cycle).
Nothing here runs a benchmark."""
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_default_folders():
    """Without --out a run writes into bench/out/ (git-ignored), with --save into bench/results/ (tracked)."""
    from bench.__main__ import parse_args
    from bench.common import record
    assert parse_args([]).out == record.SCRATCH and parse_args(["--save"]).out == record.RESULTS
    probe = os.path.join(record.SCRATCH, "latest-cpu.json")
    assert subprocess.run(["git", "check-ignore", "-q", probe], cwd=ROOT).returncode == 0, "bench/out/ not ignored"
    assert subprocess.run(["git", "check-ignore", "-q", os.path.join(record.RESULTS, "latest-cpu.json")],
                          cwd=ROOT).returncode == 1, "bench/results/ is ignored"


# ---- results are recorded only from a clean tree -------------------------------------------------

def _git(cwd, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout


def test_tracked_changes_outside_results_make_the_tree_dirty(tmp_path):
    """In a scratch repository: a clean tree, an untracked file or a changed result under bench/results/
    is clean (one suite re-measured after another leaves the first's files changed); a changed tracked
    file elsewhere is dirty, and the commit stamp then ends in '+dirty'."""
    from bench.common import record
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "bench" / "results" / "r.json").write_text("{}\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "init")
    head = _git(tmp_path, "rev-parse", "HEAD").strip()
    assert record.tracked_changes(tmp_path) == [] and record.commit(tmp_path) == head
    (tmp_path / "new.py").write_text("")
    (tmp_path / "bench" / "results" / "r.json").write_text('{"a": 1}\n')
    assert record.tracked_changes(tmp_path) == [] and record.commit(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert [ln.split()[-1] for ln in record.tracked_changes(tmp_path)] == ["code.py"]
    assert record.commit(tmp_path) == head + "+dirty"


def test_recording_into_results_is_refused_from_a_dirty_tree(monkeypatch, tmp_path):
    """With tracked changes, every writer into bench/results/ refuses before it measures, naming the
    changed files and what to do; any other folder is written as usual. (The results folder is a scratch
    one here: a writer that failed to refuse must not touch the committed record.)"""
    from bench.common import record
    changes = [" M gtpo_kernels/core/batch.py"]
    monkeypatch.setattr(record, "tracked_changes", lambda root=record.ROOT: changes)
    monkeypatch.setattr(record, "RESULTS", str(tmp_path / "results"))
    out = tmp_path / "out"
    with pytest.raises(record.DirtyTree) as e:
        record.require_clean(os.path.join(record.RESULTS, "aot"))
    assert "uncommitted changes" in str(e.value) and "gtpo_kernels/core/batch.py" in str(e.value)
    record.require_clean(str(out))  # not the record: fine
    assert os.path.exists(record.write_json(dict(device="cpu", rows=[]), str(out)))
    with pytest.raises(record.DirtyTree):
        record.write_json(dict(device="cpu", rows=[]), record.RESULTS)

    def never(*a, **k):
        raise AssertionError("measured although the record would be refused")
    from bench import __main__ as cli
    from bench.aot import __main__ as aot_cli
    from bench.aot import tune
    from bench.head_accounting import measure as head
    from bench.timing import logits_suite, parallel
    monkeypatch.setattr(logits_suite.Suite, "run", never)
    monkeypatch.setattr(aot_cli, "report", never)
    monkeypatch.setattr(tune, "static", never)
    monkeypatch.setattr(head, "measure", never)
    monkeypatch.setattr(parallel, "run", never)
    for main, argv in ((cli.main, ["--save", "--suite", "logits", "--no-aot"]), (cli.main, ["--save", "--suite", "head"]),
                       (cli.main, ["--save", "--suite", "parallel"]), (aot_cli.main, ["--save"]),
                       (tune.main, ["--save"]), (head.main, ["--save"]), (parallel.main, ["--out", record.RESULTS])):
        with pytest.raises(record.DirtyTree, match="refusing to record into .*results: the tree has uncommitted"):
            main(argv)
    assert not (tmp_path / "results").exists()


# ---- the house: subpackages by tool, no import cycle ---------------------------------------------

def _bench_imports():
    """{module: {bench modules it imports}} over every .py file under bench/, imports inside functions
    included (a lazy import is still a dependency); an import of a bench module that does not exist raises."""
    import ast
    base = os.path.join(ROOT, "bench")
    mods = {}
    for d, _, files in os.walk(base):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].split(os.sep)
                mods[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = os.path.join(d, f)
    graph = {}
    for mod, path in mods.items():
        pkg = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base_mod = node.module or ""
                if node.level:
                    up = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                    base_mod = ".".join(up + ([node.module] if node.module else []))
                deps |= {f"{base_mod}.{a.name}" if f"{base_mod}.{a.name}" in mods else base_mod for a in node.names}
        missing = {x for x in deps if x.split(".")[0] == "bench" and x not in mods}
        assert not missing, f"{path} imports what bench/ does not hold: {sorted(missing)}"
        graph[mod] = {x for x in deps if x in mods and x != mod}
    return graph


def test_bench_has_no_import_cycle_and_common_depends_on_no_tool():
    """Every import between bench's modules resolves (lazy ones too), none closes a cycle, and common/
    imports no tool."""
    graph = _bench_imports()
    assert {"bench.timing.runner", "bench.aot.compiler", "bench.aot.peers", "bench.head_accounting.counter",
            "bench.common.record", "bench.readme_numbers"} <= set(graph), sorted(graph)
    assert "bench.aot.compiler" in graph["bench.aot.peers"]  # the parser sees relative imports
    state, stack = {}, []

    def visit(m):  # depth-first search; a module met again while on the stack closes a cycle
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"
    for m in sorted(graph):
        if m not in state:
            visit(m)
    for m in (m for m in graph if m.startswith("bench.common")):
        assert all(d.startswith("bench.common") for d in graph[m]), (m, graph[m])
