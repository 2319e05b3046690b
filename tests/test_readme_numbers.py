"""The README's benchmark tables are the committed JSON under bench/results/, rendered (bench.readme_numbers):
a number edited by hand, a JSON re-measured without rewriting the README, or a table whose file is gone
fails here. Parsing only: no benchmark runs."""
import json
import os

from bench import readme_numbers as rn

TABLES = {"logits", "linear", "parallel", "aot", "head"}


def test_readme_tables_match_their_json():
    text = open(rn.README).read()
    found = {name: path for name, path, _ in rn.blocks(text)}
    assert set(found) == TABLES, found
    for name, path in found.items():
        assert path.startswith("bench/results/") and path.endswith(".json"), path
        if name != "parallel":  # the parallel table may still await its first measurement
            assert os.path.exists(os.path.join(os.path.dirname(rn.README), path)), path
    assert rn.drift(text) == []


def test_a_table_holds_its_files_numbers():
    """The rendering quotes the JSON's figures: each row's median time and peak memory appear in the README."""
    text = open(rn.README).read()
    for name, path, body in rn.blocks(text):
        full = os.path.join(os.path.dirname(rn.README), path)
        if not os.path.exists(full):
            assert body == rn.PLACEHOLDER + "\n"
            continue
        doc = json.load(open(full))
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
        assert doc["date"][:10] in body and (doc["commit"] or "?")[:7] in body
        for r in doc.get("rows", []):
            if r["status"] == "ok" and r.get("time_ms"):
                t = r["time_ms"]["full"] / (1e3 if name == "linear" else 1)
                assert (f"{t:.2f}" if name == "linear" else f"{t:.1f}") in body, (name, r["label"], t)


def test_drift_is_caught():
    """Any number changed in a table (or a missing JSON behind a rendered table) is reported."""
    text = open(rn.README).read()
    name, path, body = next(b for b in rn.blocks(text) if b[0] == "linear")
    digit = next(i for i, ch in enumerate(body) if ch.isdigit() and i > body.index("|"))
    edited = body[:digit] + str((int(body[digit]) + 1) % 10) + body[digit + 1:]
    assert rn.drift(text.replace(body, edited)) != []
    moved = text.replace(f"<!-- bench:linear {path} -->", "<!-- bench:linear bench/results/none.json -->")
    assert rn.drift(moved) != []
