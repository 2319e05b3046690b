"""The kept-set replay in bench/: its static figures as docs/benchmarks.md shows them (bench.aot.replay,
rendered from bench/results/aot-replay.json and recounted from the SASS committed beside it), the check
that the offsets into the logits are int64, and a smoke run of the GPU timing module (bench.timing.replay)
at a tiny size, its Triton kernels in the interpreter (conftest sets TRITON_INTERPRET=1). No compile here:
tests/test_bench.py's AOT test compiles the replay kernels."""
import json
import os

import pytest

pytest.importorskip("triton")

from bench.aot import compiler, replay, sass  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _table():
    text = open(replay.DOC).read()
    (path, body), = replay.BLOCK.findall(text)
    return text, path, body


def test_docs_replay_table_is_its_file():
    text, path, body = _table()
    assert path == "bench/results/" + replay.FILE
    assert replay.drift(text) == []
    doc = json.load(open(os.path.join(ROOT, path)))
    assert doc["commit"] and not doc["commit"].endswith("+dirty") and doc["commit"][:7] in body
    for r in doc["rows"]:
        assert r["ok"] and r["spill_bytes"] == 0 and r["int64_offsets"], r
        if r["dtype"] == "bfloat16":
            assert f"{r['instr_per_kept_elem']:.2f}" in body and f", {r['regs']}" in body, (r["arch"], r["kernel"])
    digit = next(i for i, ch in enumerate(body) if ch.isdigit() and i > body.index("| sm_"))
    edited = body[:digit] + str((int(body[digit]) + 1) % 10) + body[digit + 1:]
    assert replay.drift(text.replace(body, edited)) != []


def test_replay_records_recount_from_their_sass():
    """Each bf16 record's loops, instructions per kept element and instructions outside the loops are
    what sass.kept_loop_stats counts in the SASS file the record names."""
    _, path, _ = _table()
    rows = [r for r in json.load(open(os.path.join(ROOT, path)))["rows"] if r["sass"]]
    assert {r["arch"] for r in rows} == {"sm_90", "sm_80", "sm_100"} and len(rows) == 9
    for r in rows:
        text = open(os.path.join(ROOT, r["sass"])).read()
        loops, per_elem, mufu, bar, note = sass.kept_loop_stats(text, r["block_k"], r["num_warps"], 2)
        assert note == "" and [x["instr"] for x in loops] == [x["instr"] for x in r["loops"]], r["sass"]
        assert round(per_elem, 3) == r["instr_per_kept_elem"] and round(mufu, 3) == r["mufu_per_kept_elem"]
        body = sum(x["instr"] for x in loops)
        assert len([1 for _, t in sass.sass_instructions(text) if not t.startswith("NOP")]) - body == r["other_instr"]


def test_int64_offsets_check():
    """The TTIR check: every offset added to the logits pointer (and pointers made from it) is int64."""
    ttir = "\n".join([
        "%row_8 = tt.addptr %logits_ptr, %row_7 : !tt.ptr<bf16>, i64 loc(#loc84)",
        "%3 = tt.splat %row_8 : !tt.ptr<bf16> -> tensor<128x!tt.ptr<bf16>> loc(#loc43)",
        "%4 = tt.addptr %3, %v_25 : tensor<128x!tt.ptr<bf16>>, tensor<128xi64> loc(#loc44)",
        "%5 = tt.addptr %stats_ptr, %c1_i32 : !tt.ptr<f32>, i32 loc(#loc45)"])  # not the logits: not checked
    assert compiler.int64_offsets(ttir)
    assert not compiler.int64_offsets(ttir.replace("tensor<128xi64>", "tensor<128xi32>"))
    assert not compiler.int64_offsets(ttir.replace(", i64 loc", ", i32 loc"))
    assert not compiler.int64_offsets("")  # nothing found is no pass


def test_replay_timing_smoke(tmp_path):
    """bench.timing.replay end to end at 8 tokens x V = 256 (interpreted: the times mean nothing): every
    call timed, the sets rebuilt in the call (--rules) among them, the replayed values checked against float64
    and the rebuilt ones against the recorded sets, the kept sets' sizes and the bytes model."""
    from bench.timing import replay as timing
    assert timing.main(["--device", "cpu", "--tokens", "8", "--vocab", "256", "--rounds", "1", "--warmup", "0",
                        "--rules", "--out", str(tmp_path)]) == 0
    doc = json.load(open(tmp_path / "latest-replay-cpu.json"))
    rows = {r["label"]: r for r in doc["rows"]}
    assert len(rows) == 8 and all(r["status"] == "ok" for r in rows.values()), rows
    assert doc["check"]["tokens"] == doc["counted"] > 0
    assert doc["check"]["logp"] < 1e-5 and doc["check"]["entropy"] < 1e-5, doc["check"]
    assert doc["check"]["rules"]["logp"] < 1e-5 and doc["check"]["rules"]["entropy"] < 1e-5, doc["check"]
    s = doc["sets"]
    assert 1 <= s["p10"] <= s["p50"] <= s["p90"] <= s["max"] and s["kept_ids"] > doc["counted"], s
    e, M, V, K = 2, doc["counted"], doc["V"], s["kept_ids"]
    L = doc["B"] * (doc["T"] + 1) * V
    assert rows["token_logprobs full vocabulary"]["bytes"] == M * V * e
    assert rows["gtpo_loss full vocabulary"]["bytes"] == 2 * M * V * e + L * e
    assert rows["token_logprobs replay"]["bytes"] == K * (8 + e)
    assert rows["gtpo_loss replay"]["bytes"] == 2 * K * (8 + e) + L * e + K * e
    assert rows["gtpo_loss replay"]["sector_bytes"] == 2 * K * (8 + 32) + L * e + K * 32
    assert all("vs_full" in r for r in rows.values() if r["sets"] in ("replay", "rules"))
    assert rows["gtpo_loss rules, validate=False"]["bytes"] == 3 * M * V * e + L * e


def test_gpu_check_runs_the_replay_step_within_its_budget():
    """bench/gpu_check.sh: the step limits add up to the total its header states, and step 7 times the
    replay (bench.timing.replay at 16384 x 151936) after step 6's profile has compiled the replay kernels."""
    import re
    text = open(os.path.join(ROOT, "bench", "gpu_check.sh")).read()
    total = int(re.search(r"each step has its own time limit, (\d+) s in all", text).group(1))
    assert sum(int(t) for t in re.findall(r"\btimeout (\d+) ", text)) == total
    profile, replay_step = text.index("python -m bench.timing.profile"), text.index("python -m bench.timing.replay")
    assert profile < replay_step and "--tokens 16384 --vocab 151936" in text[replay_step:].splitlines()[0]
