"""The README's "Use it" snippet runs exactly as written (so the README cannot silently rot)."""
import os
import re
import runpy
import warnings

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


def test_readme_use_it_snippet_runs(tmp_path, capsys, monkeypatch):
    code = readme_block("Use it")
    assert "gtpo_loss(" in code and ".backward()" in code
    script = tmp_path / "use_it.py"
    script.write_text(code)
    # as a reader would run it: a file of its own, from another folder (in this process: no second
    # torch import, so the test stays fast)
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert "filtered_frac" in out, out
    ours = [str(w.message) for w in caught if str(w.message).startswith("gtpo_loss:")]
    assert not ours, ours  # e.g. the entropy filter dropping every completion
