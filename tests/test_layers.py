"""The house's layers (docs/design.md): each subpackage of gtpo_kernels imports only the layers below it,
lazy imports inside functions included, and no module imports itself back through another (no cycle)."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "gtpo_kernels"
# bottom to top; a module may import its own layer and the ones before it
LAYERS = ["core", "kernels", "objective", "distributed", "pipeline", "api", "integrations"]


def _layer(mod):
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def _imports(path, root=PKG):
    """Every gtpo_kernels module a file imports, at the top or inside a function."""
    mod = "gtpo_kernels." + ".".join(path.relative_to(root).with_suffix("").parts)
    pkg = mod.rsplit(".", 1)[0] if path.name != "__init__.py" else mod.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("gtpo_kernels"):
                out.add(target)
                out.update(f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("gtpo_kernels"))
    return mod, out


def _graph(root=PKG):
    g = {}
    for path in root.rglob("*.py"):
        mod, deps = _imports(path, root)
        g[mod.removesuffix(".__init__")] = deps
    return g


def upward_imports(root=PKG):
    """['module -> imported module'] for every import of the package at `root` that points up a layer."""
    bad = []
    for mod, deps in _graph(root).items():
        me = _layer(mod)
        if me is None:
            continue
        for d in deps:
            other = _layer(d)
            if other is not None and LAYERS.index(other) > LAYERS.index(me):
                bad.append(f"{mod} -> {d}")
    return sorted(bad)


def test_imports_point_down():
    bad = upward_imports()
    assert not bad, "imports that point up a layer:\n" + "\n".join(bad)


def test_no_import_cycle():
    graph = _graph()
    modules = {m for m in graph if m.count(".") >= 2}  # modules, not the layer packages' __init__
    g = {m: {d for d in deps if d in modules} - {m} for m, deps in graph.items() if m in modules}
    seen, stack = {}, []

    def visit(m):
        seen[m] = 1
        stack.append(m)
        for d in g.get(m, ()):
            if seen.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in seen:
                visit(d)
        stack.pop()
        seen[m] = 2

    for m in sorted(g):
        if m not in seen:
            visit(m)


def test_layer_rule_can_fail(tmp_path):
    """The checker, run on a copy of the package with one upward import added (a lazy one, inside a
    function of kernels/ops.py, as a file would write it), reports exactly that import."""
    import shutil
    copy = tmp_path / "gtpo_kernels"
    shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert upward_imports(copy) == []
    ops = copy / "kernels" / "ops.py"
    ops.write_text(ops.read_text() + "\n\ndef _late():\n    from ..api.logits import gtpo_loss\n    return gtpo_loss\n")
    assert upward_imports(copy) == ["gtpo_kernels.kernels.ops -> gtpo_kernels.api.logits",
                                    "gtpo_kernels.kernels.ops -> gtpo_kernels.api.logits.gtpo_loss"]


def test_files_stay_small():
    """No file of the package over about 300 lines (the kernels' file included)."""
    big = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 330}
    assert not big, f"files over ~300 lines: {big}"


def test_import_does_not_load_the_compiler():
    """`import gtpo_kernels` does not import torch._dynamo (about half of the import time); the head's
    options key carries the mark torch.compiler.assume_constant_result would give it."""
    import subprocess
    import sys

    import torch

    code = "import sys, gtpo_kernels; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", out
    from gtpo_kernels.pipeline.head import options_key

    def probe():
        pass
    marked = torch.compiler.assume_constant_result(probe)
    assert vars(marked) and all(getattr(options_key, k, None) == v for k, v in vars(marked).items())
