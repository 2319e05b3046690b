"""Tests of bench/: the interpreter byte counter (self-test, then our kernels' traffic against spec
section 8's ideal), the ahead-of-time GPU compile (no compile error, no spill, 16-byte logits loads),
and smoke runs of `python -m bench` at a tiny size, into temporary folders. The kernels run in Triton's interpreter
(conftest sets TRITON_INTERPRET=1); the AOT compile runs in a child process without it."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from bench.timing import traffic  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAFFIC_BOUND = 1.02  # forward read, backward read, backward write: within 2% of the ideal


def test_traffic_counter_self_test():
    res = traffic.self_test()
    assert res["ok"], res
    assert res["read_ratio"] == 2.0 and res["write_ratio"] == 1.0


@pytest.mark.parametrize("tokens,V,dtype,preset", [
    (64, 5000, torch.bfloat16, "gtpo"),   # three blocks of 2048, the last partial
    (64, 300, torch.float32, "grpo"),     # one block of 512, partial
])
def test_traffic_of_our_kernels(tokens, V, dtype, preset):
    res = traffic.run(tokens, V, dtype, preset)
    for k, r in res["ratios"].items():
        assert 1.0 <= r <= TRAFFIC_BOUND, f"{k}: {r:.4f} of the ideal ({res['bytes'][k]} / {res['ideal'][k]} bytes)"
    assert res["stray"] == {"fwd_write_logits": 0, "bwd_read_grad": 0}, res["stray"]


def test_aot_compile_registers_spills_wide_loads():
    """Every kernel compiles for every target (bench.aot; the ci profile compiles float16 and float32 on sm_90
    alone, bfloat16 everywhere; nightly every dtype on every target): no spill, 16-byte loads, the main
    loop found, the instruction budgets."""
    from bench import aot
    from bench.aot.compiler import dtypes_on
    elsewhere = None if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "nightly" else (torch.bfloat16,)
    results = aot.report_in_subprocess(elsewhere=elsewhere)
    assert {(r.arch, r.dtype) for r in results if r.V == aot.V_REAL} == {
        (a, str(dt).replace("torch.", "")) for a in aot.ARCHS for dt in dtypes_on(a, elsewhere=elsewhere)}
    assert results, "no kernel compiled"
    bad = [(r.kernel, r.variant, r.dtype, r.arch, r.problems()) for r in results if not r.ok]
    assert not bad, "\n" + aot.format_table(results)
    # the real-vocabulary rows read the logits with 16-byte loads
    assert any(r.expect_vector for r in results) and all(r.ldg128 > 0 for r in results if r.expect_vector)
    # the main loop is found in every kernel's SASS, and its loads cover the elements it is counted for
    for r in results:
        assert r.loop_instr > 0 and r.elems_per_thread > 0, (r.kernel, r.variant, r.dtype, r.arch)
        assert not r.loop_note or not r.expect_vector, (r.kernel, r.variant, r.dtype, r.arch, r.loop_note)
        assert r.warps_per_sm >= r.num_warps, (r.kernel, r.variant, r.dtype, r.arch, r.warps_per_sm)
    # issue 10's budgets, bf16 on sm_90 at V = 151936: instructions per logit element in the main loop,
    # no barrier inside it
    budget = {("_vocab_fwd_kernel", ""): 14, ("_vocab_bwd_kernel", "no E"): 10,
              ("_vocab_bwd_kernel", "HAS_E"): 14}
    for r in results:
        if r.arch == 90 and r.dtype == "bfloat16" and r.V == aot.V_REAL and r.family == "vocab":
            assert r.instr_per_elem <= budget[(r.kernel, r.variant)], "\n" + aot.format_table(results)
            assert r.bar_per_iter == 0, "\n" + aot.format_table(results)
    # the kept-set replay kernels, as replay_triton launches them, on the NVIDIA targets: no spill, int64
    # offsets into the logits and the gradient, their loops found (forward two passes, backward one), each
    # whole unrolled iterations of kept ids; instructions per kept element as first measured (sm_90
    # bf16: forward 69.25, backward 43.5 / 44.0) with room for a compiler's drift, no barrier in a loop
    replay = [r for r in results if r.family == "replay"]
    variants = (("_replay_fwd_kernel", ""), ("_replay_bwd_kernel", "no E"), ("_replay_bwd_kernel", "HAS_E"))
    assert {(r.kernel, r.variant, r.dtype, r.arch) for r in replay} == {
        (k, v, str(dt).replace("torch.", ""), a) for k, v in variants for a in aot.ARCHS
        for dt in dtypes_on(a, elsewhere=elsewhere) if not isinstance(a, str)}
    for r in replay:
        assert r.ok and r.spill_stores == r.spill_loads == 0 and r.int64_offsets, (r.kernel, r.dtype, r.arch)
        assert all(x["unroll"] >= 1 for x in r.loops) and r.other_instr > 0 and r.bar_per_iter == 0, r.loops
        assert r.instr_per_elem <= (80 if "fwd" in r.kernel else 50), "\n" + aot.format_table(replay)
    recs = aot.records(results)
    assert {(c["kernel"], c["variant"], c["device"]) for c in recs} == {
        (k, v, d) for k, v in (("_vocab_fwd_kernel", "-"), ("_vocab_bwd_kernel", "no E"),
                               ("_vocab_bwd_kernel", "HAS_E")) for d in aot.DEVICES}
    need = {"provider", "kernel", "variant", "dtype", "block", "num_warps", "instr_per_elem", "bar_per_iter",
            "regs", "est_ms", "sass"}
    assert all(need <= set(c) and c["est_ms"] > 0 for c in recs)
    # a CPU run of python -m bench prints the report as one line, pointing at the full one
    import dataclasses
    line = aot.summary_line(results)
    assert f"{len(results)} kernels for sm_90, sm_80, sm_100, gfx942: all ok" in line and "\n" not in line, line
    assert line.endswith("Full report: python -m bench.aot") and "fwd " in line and "bwd HAS_E " in line, line
    failed = aot.summary_line(results[:-1] + [dataclasses.replace(results[-1], spill_stores=8, ok=False)])
    assert "1 FAILED (" in failed and "all ok" not in failed, failed


def _tree_state():
    """The repository as a bench run could change it: every tracked file's content and the set of untracked
    and ignored files (bench/out/ included), Python's and the test tools' caches left out."""
    import hashlib
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split("\0")
    tracked = {n: hashlib.sha256(open(os.path.join(ROOT, n), "rb").read()).hexdigest()
               for n in names if n and os.path.isfile(os.path.join(ROOT, n))}
    other = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all", "-z"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    caches = ("__pycache__", ".pyc", ".hypothesis", ".pytest_cache", ".venv", ".egg-info", "build/")
    return tracked, {x for x in other if x[:2] in ("??", "!!") and not any(c in x for c in caches)}


def test_python_m_bench_smoke(tmp_path):
    """A run with --out writes its JSON and plots there and nowhere else: the repository's tree (tracked files,
    bench/out/, bench/results/) is left as it was."""
    before = _tree_state()
    cmd = [sys.executable, "-m", "bench", "--device", "cpu", "--suite", "logits", "--tokens", "64", "--vocab", "300",
           "--impls", "triton,torch,eager,liger", "--repeats", "2", "--warmup", "1", "--traffic-size", "64x300",
           "--no-aot", "--modes", "full,fwd,bwd", "--settle", "0", "--out", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, TRITON_INTERPRET="1"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert _tree_state() == before, "a bench run with --out changed the repository's tree"
    assert "eager baseline" in p.stdout and "not run: needs CUDA" in p.stdout
    assert [ln for ln in p.stderr.splitlines() if "needs CUDA" in ln] == [  # once, not a line per size
        next(ln for ln in p.stderr.splitlines() if ln.endswith("liger: not run at any size (not run: needs CUDA)"))]
    # progress on stderr: each configuration numbered, no wait with --settle 0
    assert "[1/1] tokens=64 V=300: check torch, eager, then time them in 1 warm-up + 2" in p.stderr, p.stderr
    assert "waiting up to" not in p.stderr
    rel = next(ln.split()[1] for ln in p.stdout.splitlines() if ln.startswith("results: "))
    path = os.path.join(ROOT, rel)
    assert os.path.dirname(os.path.abspath(path)) == str(tmp_path), rel
    assert "pass --save" in p.stdout
    doc = json.loads(open(path).read())
    assert doc == json.loads((tmp_path / "latest-cpu.json").read_text())
    assert {"date", "commit", "machine", "versions", "rows", "traffic"} <= set(doc)
    by = {(r["impl"], r["tokens"]): r for r in doc["rows"]}
    assert by[("eager", 64)]["status"] == "ok" and by[("eager", 64)]["peak_bytes"] > 0
    assert by[("torch", 64)]["saved_bytes_per_token"] < by[("eager", 64)]["saved_bytes_per_token"]
    assert by[("triton", 64)]["status"] == "ok" and "time_ms" not in by[("triton", 64)]  # interpreted
    # interleaved rounds: every figure a median with its range, ratios per round, the load recorded
    assert doc["repeats"] == 2 and doc["timing"] == "interleaved rounds" and doc["rule"]
    assert set(doc["load"]) >= {"cores", "before", "after", "loaded"} and len(doc["load"]["before"]) == 3
    for impl in ("torch", "eager"):
        r = by[(impl, 64)]
        assert all(len(r["rounds_ms"][m]) == 2 for m in ("full", "fwd", "bwd")), r["rounds_ms"]
        assert r["rounds_ms"]["bwd"] == [a - b for a, b in zip(r["rounds_ms"]["full"], r["rounds_ms"]["fwd"])]
        assert r["time_range_ms"]["full"][0] <= r["time_ms"]["full"] <= r["time_range_ms"]["full"][1]
        # forward alone beyond fwd+bwd's slowest round (one noisy round of two can do it): flagged, never shown
        # as a measurement
        above = r["time_ms"]["fwd"] > r["time_range_ms"]["full"][1]
        assert above == bool(r.get("fwd_above_full")), r
        assert {"median", "min", "max", "spread", "unreliable"} <= set(r["vs_eager"]["full"])
        assert not above or all(v["unreliable"] for v in r["vs_eager"].values())
    assert by[("eager", 64)]["vs_eager"]["full"]["median"] == 1.0
    assert "fwd+bwd vs eager (per round)" in p.stdout and "load average (1 min)" in p.stdout
    from bench import readme_numbers
    rendered = readme_numbers.render_logits(doc, rel)
    assert "| gtpo-kernels torch | 64 x 300 |" in rendered and "interleaved" in rendered
    bad = subprocess.run([sys.executable, "-m", "bench", "--save", "--out", "x"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "not both" in bad.stderr
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return  # plots are optional
    plots = [ln.split()[1] for ln in p.stdout.splitlines() if ln.startswith("plot: ")]
    assert plots and all(os.path.dirname(os.path.abspath(os.path.join(ROOT, x))) == str(tmp_path) for x in plots), plots
    # no empty line or panel: what has no data (Liger on the CPU, interpreted Triton) is left out and said so
    assert "no line for liger triton_grpo_loss (unavailable: not run: needs CUDA)" in p.stdout


def test_linear_suite_smoke(tmp_path):
    """`python -m bench --suite linear` at a tiny size with several tiles: every implementation of the loss
    from hidden states runs (Liger-Kernel's only when installed), all agree on the loss and the gradients
    of hidden and weight, and the JSON has the fields the README and the plots read. (Peak memory off: CI
    time. The memory children run in test_python_m_bench_smoke; our head's and TRL's peaks are
    checked by test_linear.py and test_trl_models.py.)"""
    pytest.importorskip("trl.kernels")
    from bench.timing.linear import PROVIDERS
    LOSS_TOL, GRAD_TOL = 1e-5, 1e-4  # float32 inputs: against each other and the float64 evaluation
    cmd = [sys.executable, "-m", "bench", "--device", "cpu", "--suite", "linear", "--linear-size", "256,64,1000",
           "--linear-tile", "0.25", "--repeats", "1", "--linear-warmup", "0", "--settle", "0", "--no-memory", "--out", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "latest-linear-cpu.json").read_text())
    assert {"date", "commit", "machine", "versions", "rows", "suite", "device", "dtype", "preset", "tile_bytes",
            "threads", "load", "rule", "timing", "tolerance"} <= set(doc)
    assert doc["suite"] == "linear" and doc["dtype"] == "float32" and doc["preset"] == "grpo"
    by = {r["impl"]: r for r in doc["rows"]}
    assert set(by) == set(PROVIDERS)
    ok = [i for i in PROVIDERS if by[i]["status"] == "ok"]
    assert set(PROVIDERS) - {"liger"} <= set(ok), {i: (r["status"], r.get("note")) for i, r in by.items()}
    if "liger" not in ok:
        assert by["liger"]["status"] == "unavailable", by["liger"]
    losses = [by[i]["loss"] for i in ok]
    assert max(losses) - min(losses) <= LOSS_TOL, dict(zip(ok, losses))
    for i in ok:
        r = by[i]
        assert r["errors"]["loss"] <= LOSS_TOL and max(r["errors"]["grad_hidden"], r["errors"]["grad_weight"]) \
            <= GRAD_TOL, (i, r["errors"])
        assert r["time_ms"]["full"] > 0 and len(r["times_ms"]) == 1 and r["time_range_ms"]["full"], i
        assert "vs_trl" in r and (r["N"], r["D"], r["V"]) == (256, 64, 1000), i
    assert by["trl"]["vs_trl"]["full"]["median"] == 1.0
    from bench import readme_numbers
    assert "| linear_gtpo_loss fused | 256 x 64 x 1000 |" in readme_numbers.render_linear(doc, "x.json")
    # several tiles: 0.25 MiB of float32 logits at V = 1000 is 65 tokens for ours, 277 columns for TRL
    assert by["fused"]["tile"] == "tiles of 65 tokens x 1000", by["fused"]["tile"]
    assert by["trl"]["tile"].endswith(" x 277"), by["trl"]["tile"]
    assert "linear_gtpo_loss fused" in p.stdout and "vs TRL" in p.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "linear-cpu-float32-time.png").exists()
    assert not (tmp_path / "linear-cpu-float32-memory.png").exists()  # --no-memory: no peaks to plot


# ---- the timing machinery (no benchmark runs) ---------------------------------------------------

def test_interleaved_rounds_order_warmup_and_errors():
    """Rounds run every step once in order (A, B, C, A, B, C); warm-up rounds are not recorded; a step
    that raises is dropped and reported, the others go on."""
    from bench.timing.runner import interleaved
    calls, failed = [], []

    def step(name, fail=False):
        def fn():
            calls.append(name)
            if fail and calls.count(name) == 2:
                raise RuntimeError("boom")
        return fn
    ts = interleaved({"A": step("A"), "B": step("B", fail=True), "C": step("C")}, rounds=3, warmup=1,
                     on_error=lambda k, e: failed.append((k, str(e))))
    assert calls == ["A", "B", "C", "A", "B", "C", "A", "C", "A", "C"]
    assert set(ts) == {"A", "C"} and all(len(t) == 3 and min(t) >= 0 for t in ts.values())
    assert failed == [("B", "boom")]


def test_long_rounds_say_where_the_timing_is(monkeypatch):
    """A round longer than LONG_ROUND_S (a large problem on a CPU) is followed by a line naming the next
    one, so a run of long rounds is never silent for more than a round; short rounds say nothing."""
    from bench.timing import runner
    said = []
    runner.interleaved({"A": lambda: None}, rounds=2, warmup=1, progress=said.append)
    assert said == []
    monkeypatch.setattr(runner, "LONG_ROUND_S", -1.0)
    runner.interleaved({"A": lambda: None}, rounds=2, warmup=1, progress=said.append)
    assert [s.split(" took ")[0] for s in said] == ["round 1/3", "round 2/3", "round 3/3"], said
    assert said[0].endswith("now round 2/3 (timed)") and said[-1].endswith("timing done"), said


def test_per_round_ratios_and_the_unreliable_rule():
    """Ratios are taken round by round (a load spike in one round hits both sides), then summarized; the
    rule flags a range above 25% of the median, or a run that shared the machine (load above half the
    cores before it, or above 1.5 x cores after it)."""
    from bench.timing import runner
    a, b = [10.0, 30.0, 11.0, 10.5, 10.0], [20.0, 60.0, 22.0, 21.0, 20.0]
    r = runner.per_round_ratio(a, b)
    assert r["median"] == 0.5 and r["min"] == r["max"] == 0.5 and r["spread"] == 0.0
    snap = lambda x: dict(load_average=[x, 0, 0], cores=2)  # noqa: E731
    # the run's own threads may load every core (2.9 after on 2 cores is its own); others may not
    quiet = runner.load_record(snap(0.2), snap(2.9))
    busy_before = runner.load_record(snap(1.1), snap(1.0))
    busy_after = runner.load_record(snap(0.2), snap(3.1))
    assert not quiet["loaded"] and busy_before["loaded"] and busy_after["loaded"]
    assert busy_before["limit"] == 1.0 and busy_after["limit_after"] == 3.0
    assert not runner.unreliable(r, quiet) and runner.unreliable(r, busy_before) and runner.unreliable(r, busy_after)
    wide = runner.per_round_ratio([1.0, 1.3, 1.0], [1.0, 1.0, 1.0])
    assert abs(wide["spread"] - 0.3) < 1e-12 and runner.unreliable(wide, quiet)
    assert runner.mode_times({"full": [5.0, 6.0], "fwd": [2.0, 2.5]}, ("full", "bwd")) == \
        {"full": [5.0, 6.0], "bwd": [3.0, 3.5]}
    # a row whose forward alone took longer than its slowest forward+backward: every ratio of it unreliable
    assert not runner.fwd_above_full({"full": [5.0, 6.0], "fwd": [2.0, 6.0]})
    assert runner.fwd_above_full({"full": [0.5, 0.6], "fwd": [0.3, 32.0, 30.0]})
    assert not runner.fwd_above_full({"full": [5.0, 6.0]})
    assert runner.unreliable(r, quiet, {"fwd_above_full": True}) and not runner.unreliable(r, quiet, {})
    from bench.timing.report import _note
    assert "unreliable: fwd alone above" in _note({"status": "ok", "fwd_above_full": True})


def test_parallel_summary_and_tables():
    """The parallel suite's result from its ranks' rounds: per-round speed-ups, the load, the tables."""
    from bench import readme_numbers
    from bench.timing import parallel
    from bench.timing.runner import load_record
    rounds = {"2 ranks": [100.0, 110.0, 300.0], "1 rank": [200.0, 220.0, 600.0], "1 rank, 2 threads": [100.0] * 3}
    ranks = [dict(all_reduce_bytes=32 * 64, all_gather_bytes=72, rounds_ms=rounds, loss_rel_err=1e-7,
                  grad_rel_err=2e-7, grad_norm=1.0), dict(all_reduce_bytes=32 * 64, all_gather_bytes=72,
                                                          rounds_ms={}, loss_rel_err=0, grad_rel_err=0, grad_norm=1.0)]
    load = load_record(dict(load_average=[0.1, 0, 0], cores=2), dict(load_average=[0.2, 0, 0], cores=2))
    res = parallel.summarize(ranks, 64, 1000, 3, 1, load)
    sp = res["speedup_of_ranks_over"]
    assert sp["1 rank"]["median"] == 2.0 and sp["1 rank"]["spread"] == 0 and not sp["1 rank"]["unreliable"]
    assert sp["1 rank, 2 threads"]["min"] == 1 / 3 and sp["1 rank, 2 threads"]["unreliable"]
    assert res["time"]["2 ranks"]["median"] == 110.0 and res["bytes"]["ours_per_token"] == 32
    assert "2 ranks vs 1 rank: 2.00x (2.00-2.00) faster" in parallel.table(res)
    res.update(date="2026-12-03T00:00:00", commit="abcdef0", machine=dict(cpu="x", cpu_count=2))
    md = readme_numbers.render_parallel(res, "p.json")
    assert "| V=32000 fp32 | 128,000 | 32 | 4,000x |" in md and "| 2 ranks | 1 | 110.0 (100.0-300.0) |" in md


def test_missing_peers_say_how_to_get_them(monkeypatch):
    import importlib.util

    from bench.timing import providers
    real = importlib.util.find_spec
    # TRL missing, Liger present, whatever this machine has installed
    fake = {"trl": None, "liger_kernel": object()}
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: fake[n] if n in fake else real(n, *a))
    lines = providers.missing_peers()
    assert len(lines) == 1 and lines[0].startswith("TRL") and 'pip install -e ".[bench]"' in lines[0]


def test_settle_waits_for_the_load_to_fall_and_zero_does_not_wait(monkeypatch):
    """--settle: before a suite the run waits (at most SETTLE_S) for an earlier run's 1-minute load to fall
    below the limit, and says so (what it waits for, how to skip it, when it starts); 0 starts at once,
    whatever the load (the test suite's own runs)."""
    from bench.timing import runner
    slept, said = [], []
    monkeypatch.setattr(runner.os, "getloadavg", lambda: (9.0 if len(slept) < 2 else 0.1, 0.0, 0.0))
    monkeypatch.setattr(runner.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(runner.time, "sleep", slept.append)
    monkeypatch.setattr(runner, "SETTLE_S", 60)
    snap = runner.load_snapshot(settle=True, log=said.append)
    assert len(slept) == 2 and snap["load_average"][0] == 0.1
    assert len(said) == 2, said
    assert "waiting up to 60 s for the 1-minute load average (9.00) to fall below 1" in said[0], said
    assert "--settle 0" in said[0] and said[1].startswith("load 0.10 after ") and said[1].endswith("starting")
    slept.clear(), said.clear()
    monkeypatch.setattr(runner.os, "getloadavg", lambda: (9.0, 0.0, 0.0))
    monkeypatch.setattr(runner, "SETTLE_S", 0)
    assert runner.load_snapshot(settle=True, log=said.append)["load_average"][0] == 9.0
    assert slept == [] and said == []
    assert runner.load_snapshot(settle=False, log=said.append) and said == []


def test_profile_writes_one_row_per_call(tmp_path):
    """python -m bench.timing.profile: wall time, operators and host reads of one call per implementation."""
    from bench.timing import profile
    profile.main(["--device", "cpu", "--size", "64x300", "--impls", "triton-novalidate,eager,nothing",
                  "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "profile-cpu.json").read_text())["rows"]
    by = {r["impl"]: r for r in rows}
    assert by["triton-novalidate"]["wall_ms"] > 0 and by["triton-novalidate"]["syncs"] == 0
    assert by["eager"]["ops"] > 0 and by["eager"]["top"]
    assert "error" in by["nothing"]  # an unknown implementation is a row that says so


# ---- the head over the sampler's kept sets in the linear suite ------------------------------------

def test_kept_sets_are_drawn_as_the_sampler_keeps_them():
    """linear.make_inputs(kept=True): each counted token's set is what top_k = 512 / top_p = 0.95 keep
    from the head's own logits (rebuilt here in float64 by the reference's statement of vLLM's rules on a
    sample of tokens), its sampled id is in it, the sizes range from one id to hundreds with most tokens
    confident, and consecutive tokens share ids (a tile's sets hold more ids than their union)."""
    from bench.timing import linear
    from gtpo_reference.gtpo_sampling import kept_set_row
    inp = linear.make_inputs(256, 64, 2000, kept=True)
    token_ids, offsets = inp.sampling_mask
    sizes = offsets.diff()
    assert sizes.numel() == inp.counted and int(offsets[-1]) == token_ids.numel()
    y = inp.ids[inp.mask]
    z = (inp.hidden.detach()[inp.mask] @ inp.weight.detach().t()).double()
    for m in range(0, inp.counted, 7):
        got = token_ids[offsets[m]:offsets[m + 1]]
        assert bool((got == y[m]).any()), m
        assert got.tolist() == kept_set_row(z[m], linear.TOP_K, linear.TOP_P).tolist(), m
    tiles = [(m0, min(inp.counted, m0 + 32)) for m0 in range(0, inp.counted, 32)]
    st = linear.set_stats(token_ids, offsets, 2000, tiles)
    assert st["median_kept"] <= 16 and 64 <= st["max_kept"] <= linear.TOP_K, st
    assert st["sum_kept_over_union"] > 1.2 and st["union_over_V"] < 0.5, st


def test_linear_suite_times_the_replay_head_against_the_full_head(monkeypatch):
    """The suite with 'replay' and 'rebuild': every implementation runs on the kept-set inputs, the two are
    checked against a float64 evaluation over the sets (the full heads over the vocabulary), each gets its
    per-round time over the fused head's, and the result and table carry the sets' and unions' sizes."""
    from bench.timing import linear_suite, runner
    monkeypatch.setattr(runner, "SETTLE_S", 0)
    suite = linear_suite.LinearSuite("cpu", ["fused", "recompute", "replay", "rebuild"], [(256, 64, 1000)],
                                     tile_bytes=1 << 18, repeats=1, warmup=0, memory=False, progress=lambda m: None)
    res = suite.run()
    by = {r["impl"]: r for r in res["rows"]}
    assert all(r["status"] == "ok" for r in by.values()), {i: (r["status"], r.get("note")) for i, r in by.items()}
    for impl in ("replay", "rebuild"):
        r = by[impl]
        assert r["errors"]["loss"] <= 1e-5 and max(r["errors"]["grad_hidden"], r["errors"]["grad_weight"]) <= 1e-4
        assert r["vs_full"]["against"] == "fused" and r["vs_full"]["full"]["median"] > 0
        assert "|U|" in r["tile"], r["tile"]
    assert "vs_full" not in by["fused"]
    st = res["sets"]["256x64x1000"]
    assert st["tiles"] >= 2 and 0 < st["union_over_V"] <= 1 and st["mean_kept"] < st["mean_union"]
    text = linear_suite.table(res)
    assert "vs full head" in text and "kept sets at 256x64x1000" in text


@pytest.mark.parametrize("command", ["bench.aot.__main__", "bench.__main__"])
def test_help_states_each_default_once(capsys, command):
    """A flag whose help states its default gets no second "(default: ...)" (python -m bench.aot --help,
    python -m bench --help)."""
    import importlib
    main = importlib.import_module(command).main
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in out and "(default: 60.0)" not in out, out
    if command == "bench.aot.__main__":
        assert "(default: bench/out/, git-ignored)" in out, out


def test_check_only_checks_and_times_nothing():
    """`python -m bench --check-only --suite linear`: the checks, no timing (it crashed on the median of no
    rounds), exit 0, the table saying it was not timed."""
    pytest.importorskip("trl.kernels")
    cmd = [sys.executable, "-m", "bench", "--device", "cpu", "--suite", "linear", "--linear-size", "64,16,200",
           "--check-only", "--settle", "0"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "checked only, not timed" in p.stdout and "interleaved rounds" not in p.stdout, p.stdout[-2000:]


def test_launches_parallel_command_runs_clip_cov_on_fresh_ranks():
    """`python -m bench.launches_parallel` spawns fresh ranks, whose default generators torch seeds at random:
    its clip-cov row (draws from the default generator, compared by the agreement) runs only because the
    ranks seed it alike; the command prints the row and exits 0."""
    p = subprocess.run([sys.executable, "-m", "bench.launches_parallel", "--configs", "clip-cov"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, TRITON_INTERPRET="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [line for line in p.stdout.splitlines() if line.startswith("| clip-cov")]
    assert len(rows) == 2 and all(int(r.split("|")[2]) <= 12 for r in rows), p.stdout
