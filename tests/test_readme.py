"""The README's "Use it" snippet runs exactly as written (so the README cannot silently rot)."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_block(heading):
    """The first ```python block of the README section `heading` (a '## ' title)."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, f"README.md has no '## {heading}' section"
    block = re.search(r"^```python\n(.*?)^```", section.group(1), re.M | re.S)
    assert block, f"README.md's '## {heading}' section has no python code block"
    return block.group(1)


def test_readme_use_it_snippet_runs(tmp_path):
    code = readme_block("Use it")
    assert "gtpo_loss(" in code and ".backward()" in code
    script = tmp_path / "use_it.py"
    script.write_text(code)
    # as a reader would run it: a file of its own, from another folder, on the CPU
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "filtered_frac" in p.stdout, p.stdout
    assert "gtpo_loss:" not in p.stderr, p.stderr  # e.g. the entropy filter dropping every completion
