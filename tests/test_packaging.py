"""The distribution ships every package of the source tree (an editable install hides a missing one)."""
import ast
import os

from setuptools import find_packages

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_setup_lists_every_subpackage():
    """setup.py's `packages` (evaluated as setup.py would, from the repository root) holds every folder of
    gtpo_kernels/ with Python files, and each of those folders is a package (has an __init__.py)."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: k.value for k in call.keywords}
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        listed = set(eval(compile(ast.Expression(kw["packages"]), "setup.py", "eval"), {"find_packages": find_packages}))
    finally:
        os.chdir(cwd)
    folders = {os.path.relpath(d, ROOT).replace(os.sep, ".") for d, _, files in os.walk(os.path.join(ROOT, "gtpo_kernels"))
               if any(f.endswith(".py") for f in files)}
    assert folders <= listed, f"not shipped: {sorted(folders - listed)}"
    assert "gtpo_reference" in listed
    assert ast.literal_eval(kw["package_dir"])["gtpo_reference"] == "reference"


def test_torch_requirement_covers_the_apis_used():
    """torch.library.custom_op / register_fake / register_autograd and torch.compiler.is_compiling: 2.4."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    reqs = ast.literal_eval({k.arg: k.value for k in call.keywords}["install_requires"])
    torch_req = next(r for r in reqs if r.startswith("torch"))
    assert torch_req == "torch>=2.4", torch_req
