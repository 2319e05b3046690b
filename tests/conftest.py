"""Test set-up: Triton's interpreter (the kernels run on CPU), hypothesis profiles, error measures."""
import os

# before anything imports triton: the kernels run under Triton's interpreter on the CPU
os.environ.setdefault("TRITON_INTERPRET", "1")
# the LM head's backward by vocabulary blocks on the tests' small vocabularies (pipeline/head_backward.py)
os.environ.setdefault("GTPO_HEAD_MIN_COLS", "16")

import pytest  # noqa: E402
import torch  # noqa: E402

from bench import interpreter  # noqa: E402

# the interpreter without its repeated patching at every helper call (bench/interpreter.py): the same kernels,
# the same operations, about 40 % less time
interpreter.install()
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

# one thread per pytest-xdist worker (`-n auto` starts one worker per core): no oversubscription
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

settings.register_profile(
    "ci", max_examples=30, derandomize=True, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=15, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# a long random search (new examples every run; failures are saved in .hypothesis/ and replayed first)
settings.register_profile(
    "nightly", max_examples=500, derandomize=False, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# ci's examples without shrinking: a sweep of deliberate breaks wants to know that a test fails, fast
settings.register_profile("mutation", parent=settings.get_profile("ci"),
                          phases=(Phase.explicit, Phase.reuse, Phase.generate))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Per-test example counts for tests that set their own max_examples (tests/test_joint.py): `examples(n)`
# is 0.6 n under the ci profile (as its 30 examples are 0.6 of 50: CI's time), 10 n under nightly (the long
# search runs 10x more of every such test, as the profile's own 500 is 10x 50) and a third of n under dev.
EXAMPLE_SCALE = {"ci": 0.6, "dev": 0.3, "nightly": 10.0}


def examples(n_ci):
    return max(1, int(n_ci * EXAMPLE_SCALE.get(os.environ.get("HYPOTHESIS_PROFILE", "ci"), 1.0)))


# Cases of the multi-process sweeps over the number of ranks (each spawns a gloo group) that run only under
# the nightly profile, for CI time: every test keeps its other case in ci. The numerical sweeps keep 2 ranks,
# where they run every case (3 ranks run a subset); the tests of errors and disagreements across ranks
# keep 3 ranks, so that a middle rank stays covered.
NIGHTLY_ONLY = {
    "tests/test_parallel.py::test_vocabulary_parallel_equals_one_process[3]",
    "tests/test_parallel_replay.py::test_replay_across_a_vocabulary_split[3]",
    "tests/test_parallel_dp.py::test_data_parallel[3]",
    "tests/test_collective_failures.py::test_every_rank_raises_the_same_error[2]",
    "tests/test_gloo_scenarios.py::test_per_rank_differences[2]",
    "tests/test_parallel_bitwise.py::test_vocabulary_parallel_is_bitwise_the_single_process[4]",
}
# test_contract's out-of-range id sweep on Triton's interpreter (24 cases, about 1 s each): ci runs the half
# where (preset is gtpo) xor on_policy xor packed is true, which still has every pair of values of those three
# with every bad id (the torch backend's 24 cases, 0.01 s each, all run)
NIGHTLY_ONLY |= {
    f"tests/test_contract.py::test_out_of_range_id_without_validation_gives_nan[{preset}-{bad}-{on}-{packed}-triton]"
    for preset in ("grpo", "gtpo") for bad in (-5, 24, 10**9) for on in (False, True) for packed in (False, True)
    if not ((preset == "gtpo") ^ on ^ packed)}

# the head's launch count (tests/test_launches.py, ~10 s a case in the interpreter): ci keeps a fused padded
# case and the recompute packed one with bias; the epilogue's other policy terms (tests/test_epilogue.py): ci
# keeps sapo, geo-mean, vespo and dppo-tv drawn (every term keeps its fixed case)
NIGHTLY_ONLY |= {
    f"tests/test_launches.py::test_head_runs_the_loss_math_once_and_at_most_ten_launches_a_tile[{case}]"
    for case in ("gspo-True-False-fused", "gtpo-True-True-fused", "dapo-False-True-fused", "grpo-False-False-recompute",
                 "gspo-True-False-recompute", "dapo-False-True-recompute")}
NIGHTLY_ONLY |= {f"tests/test_epilogue.py::test_other_policy_terms_match_reference_and_twin[{term}]"
                 for term in ("gpg", "dro", "verl-cispo", "dppo-kl", "cispo")}
# the top-entropy mask: ci keeps the tie cases padded (but 0.35) and the one on the ties packed, two of the four launch
# counts (unvalidated padded, validating packed) and the from-log-probs count padded
NIGHTLY_ONLY |= {f"tests/test_top_entropy.py::test_ties_at_the_threshold_and_masked_completions[{rho}-packed]"
                 for rho in (0.31, 0.35, 0.7, 0.81)}
NIGHTLY_ONLY.add("tests/test_top_entropy.py::test_ties_at_the_threshold_and_masked_completions[0.35-padded]")
# the other token-level policy terms' launch counts: ci keeps every term padded and cispo and dppo_kl packed
NIGHTLY_ONLY |= {f"tests/test_launches.py::test_other_token_level_policy_terms_take_at_most_four[{p}-packed]"
                 for p in ("sapo", "gpg", "verl-cispo", "dppo-tv")}
NIGHTLY_ONLY |= {f"tests/test_launches.py::{t}" for t in (
    "test_top_entropy_mask_takes_at_most_eight[validating-padded]",
    "test_top_entropy_mask_takes_at_most_eight[unvalidated-packed]",
    "test_from_logps_top_entropy_mask_at_most_six_launches[packed]")}

# clip_cov's and kl_cov's launch counts: ci keeps clip_cov padded unvalidated and kl_cov packed validating; the
# entropy filter's numbers as tensors: ci keeps a number and a tensor above, and tensors equal
NIGHTLY_ONLY |= {f"tests/test_launches.py::test_cov_terms_take_at_most_eight[{p}-{f}-{v}]"
                 for p in ("clip-cov", "kl-cov") for f in ("padded", "packed") for v in ("unvalidated", "validating")
                 if (p, f, v) not in (("clip-cov", "padded", "unvalidated"), ("kl-cov", "packed", "validating"))}
NIGHTLY_ONLY |= {f"tests/test_epilogue_hyper.py::test_the_entropy_filter_numbers_as_tensors[{case}]"
                 for case in ("number-f32-below", "f64-f32-above", "f32-number-below", "f32-f64-below")}
# clip_cov's and kl_cov's from-log-probs twin check: ci keeps the padded form (the drawn test has packed)
NIGHTLY_ONLY |= {f"tests/test_epilogue_cov.py::test_cov_terms_from_logps_match_the_twin[{p}-packed]"
                 for p in ("clip-cov", "kl-cov")}

# the kept sets rebuilt by the rules' kernel (tests/test_kept_rule.py): ci keeps bf16 logits with ties (the float32
# case's rows meet the same kernel, and the loss tests draw float32 logits)
NIGHTLY_ONLY.add("tests/test_kept_rule.py::test_thresholds_keep_the_reference_sets[f32]")
# the head's compiled step: ci keeps the fused and the recompute schedules ('auto' picks one of them)
NIGHTLY_ONLY.add("tests/test_head_floor.py::test_compile_fullgraph_matches_eager[auto]")
# torch.compile of a gtpo_loss step (tests/test_contract.py, an inductor compile each, 2-17 s on a loaded 2-core
# machine): ci keeps the half of validate x packed x backend that still has every pair of their values (the
# default validate padded on torch and packed on Triton, validate=False padded on Triton and packed on torch)
NIGHTLY_ONLY |= {f"tests/test_contract.py::test_compile_fullgraph_matches_eager[{v}-{p}-{b}]"
                 for v, p, b in (("None", "True", "torch"), ("None", "False", "triton"), ("False", "True", "triton"),
                                 ("False", "False", "torch"))}
# CI time (the 720 s limit): nightly runs the torch path's resident peak (two subprocesses, ~20 s), inplace's
# launch count under clip_cov (grpo's stays) and the one-rank bitwise case (2 ranks stay). (The head's
# recompute launch count and dppo_tv's drawn epilogue case are back in ci since the interpreter runs without
# its repeated patching: bench/interpreter.py.)
NIGHTLY_ONLY |= {"tests/test_api.py::test_torch_path_peak_memory_stays_within_a_few_chunks",
                 "tests/test_epilogue_attached.py::test_inplace_takes_spec_8s_launches_flat_in_tokens[clip-cov-8]",
                 "tests/test_parallel_bitwise.py::test_vocabulary_parallel_is_bitwise_the_single_process[1]",
                 # the benchmark's head suite against TRL's and its profile, in the nightly profile only (the
                 # quick start's own `python -m bench` stays: tests/test_bench.py::test_python_m_bench_smoke)
                 "tests/test_bench.py::test_linear_suite_smoke", "tests/test_bench.py::test_profile_writes_one_row_per_call"}


def pytest_configure(config):
    config.addinivalue_line("markers", "nightly: runs only with HYPOTHESIS_PROFILE=nightly (conftest.NIGHTLY_ONLY)")


def pytest_collection_modifyitems(config, items):
    nightly = os.environ.get("HYPOTHESIS_PROFILE", "ci") == "nightly"
    for item in items:
        if item.nodeid in NIGHTLY_ONLY:
            item.add_marker(pytest.mark.nightly)
            if not nightly:
                other = "; the test's other case runs" if "[" in item.nodeid else ""
                item.add_marker(pytest.mark.skip(reason=f"nightly only (HYPOTHESIS_PROFILE=nightly){other}"))

# spec section 7: tolerances by logits dtype
TOL = {
    torch.float32: dict(value=1e-5, loss=1e-5, grad=1e-5),
    # float64 logits (backend torch; Triton refuses them) accumulate in float64. Measured against the
    # reference over 2,300 examples of the loss test's strategies and tests/accuracy.py's batches: values
    # and loss <= 5e-15; gradient <= 6e-8 while the reference formed 1 - p_y by subtraction (autograd of
    # log_softmax), <= 6.2e-9 in nightly runs since it sums the other entries' p_v instead
    torch.float64: dict(value=1e-12, loss=1e-12, grad=1e-7),
    torch.bfloat16: dict(value=1e-5, loss=1e-5, grad=1e-2),
    torch.float16: dict(value=1e-5, loss=1e-5, grad=1e-2),
}


def assert_value_close(name, x, ref, tol, where=None):
    """|x - ref| / max(1, |ref|) <= tol elementwise (spec 7); reports the worst element."""
    x = torch.as_tensor(x).detach().double()
    ref = torch.as_tensor(ref).detach().double()
    assert x.shape == ref.shape, f"{name}: shape {tuple(x.shape)} != reference {tuple(ref.shape)}"
    if where is not None:
        x, ref = x[where], ref[where]
    if x.numel() == 0:
        return
    assert torch.isfinite(x).all(), f"{name}: non-finite values {x}"
    err = (x - ref).abs() / ref.abs().clamp(min=1)
    k = int(err.reshape(-1).argmax())
    worst = float(err.reshape(-1)[k])
    assert worst <= tol, (f"{name}: error {worst:.3e} > {tol:.0e} at flat index {k}: "
                          f"got {float(x.reshape(-1)[k])!r}, reference {float(ref.reshape(-1)[k])!r}")


def assert_grad_close(name, g, ref, tol):
    """||g - ref|| / ||ref|| <= tol, and exact zeros wherever the reference row is exactly zero.

    The gradient is stored in the logits' dtype: the part of the error that rounding the reference
    itself into that dtype makes (values below float16's range, say) is not held against the kernel."""
    assert g.shape == ref.shape, f"{name}: shape {tuple(g.shape)} != {tuple(ref.shape)}"
    dtype = g.dtype
    unavoidable = float((ref.to(dtype).double() - ref.double()).norm())
    g, ref = g.double(), ref.double()
    assert torch.isfinite(g).all(), f"{name}: non-finite gradient entries"
    zero_rows = (ref == 0).all(-1)
    assert (g[zero_rows] == 0).all(), f"{name}: rows whose reference gradient is exactly zero are not zero"
    nref = ref.norm()
    if nref > 0:
        rel = (float((g - ref).norm()) - unavoidable) / float(nref)
        assert rel <= tol, f"{name}: relative error {rel:.3e} > {tol:.3g} (beyond the rounding of the " \
                           f"reference into {dtype}, {unavoidable / float(nref):.1e})"
    else:
        assert (g == 0).all(), f"{name}: reference gradient is zero but ours is not"

# the rollout weights and the off-policy mask on the epilogue (tests/test_launches.py, tests/test_epilogue_masks.py;
# ~1 s a case in the interpreter): ci keeps the mask with rollout log-probs and per-token weights packed, the
# validated read, from log-probs padded; two fixed cases (per-completion weights with a NaN rollout log-prob,
# the sequence level), a validated per-token and per-completion weight, an unvalidated one, the fused head
NIGHTLY_ONLY |= {f"tests/test_launches.py::{t}" for t in (
    "test_rollout_weights_and_off_policy_mask_take_at_most_four[token-weights-padded]",
    "test_rollout_weights_and_off_policy_mask_take_at_most_four[token-weights-packed]",
    "test_rollout_weights_and_off_policy_mask_take_at_most_four[off-policy-old-padded]",
    "test_rollout_weights_and_off_policy_mask_take_at_most_four[off-policy-old-packed]",
    "test_rollout_weights_and_off_policy_mask_take_at_most_four[off-policy-rollout-token-weights-padded]",
    "test_validated_rollout_weights_take_four_launches_and_one_read[padded]",
    "test_per_completion_rollout_weights_take_at_most_four[padded]",
    "test_from_logps_off_policy_mask_at_most_four_launches[packed]")}
NIGHTLY_ONLY |= {f"tests/test_epilogue_masks.py::{t}" for t in (
    "test_off_policy_mask_and_rollout_weights_on_fixed_cases[old-token-weights]",
    "test_off_policy_mask_and_rollout_weights_on_fixed_cases[on-policy-kl]",
    "test_off_policy_mask_and_rollout_weights_on_fixed_cases[cispo-rollout-completion-weights]",
    "test_validating_an_invalid_rollout_weight_raises_the_eager_error[token-nan]",
    "test_validating_an_invalid_rollout_weight_raises_the_eager_error[token-inf]",
    "test_validating_an_invalid_rollout_weight_raises_the_eager_error[completion--1.0]",
    "test_unvalidated_invalid_rollout_weight_gives_nan[token--0.5]",
    "test_unvalidated_invalid_rollout_weight_gives_nan[completion--1.0]",
    "test_head_with_the_off_policy_mask_matches_the_eager_path[recompute-True]")}


# compiled_ahead's process: one per test process, started at its first use, running each test's code in a fresh
# namespace (each used to start an interpreter of its own: torch, Triton and the package imported again, seconds on
# a loaded 2-core machine). A line of JSON in, a line of JSON out: [finished, stdout, traceback].
_AHEAD_SERVER = r"""
import contextlib, io, json, sys, traceback
out = sys.stdout
sys.stdout = sys.stderr  # (nothing but the replies reaches the pipe)
for line in sys.stdin:
    buf, err, ok = io.StringIO(), "", True
    with contextlib.redirect_stdout(buf):
        try:
            exec(compile(json.loads(line), "<compiled_ahead>", "exec"), {"__name__": "__main__"})
        except SystemExit as e:
            ok, err = e.code in (None, 0), f"SystemExit({e.code!r})"
        except BaseException:
            ok, err = False, traceback.format_exc()
    out.write(json.dumps([ok, buf.getvalue(), err]) + "\n")
    out.flush()
"""
_ahead = []


def compiled_ahead(code, timeout=600):
    """Runs `code` (Python that compiles kernels ahead of time with bench.aot, no GPU needed, and prints
    'compiled' at its end) in a process with Triton's interpreter off, from the repository's root, in a
    namespace of its own (the process is this test process's compile server, _AHEAD_SERVER); asserts that it
    ran to the end and returns its stdout."""
    import subprocess

    import zygote
    if not _ahead or _ahead[0].poll() is not None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        _ahead[:] = [zygote.start(_AHEAD_SERVER, dict(os.environ, TRITON_INTERPRET="0"), root, subprocess.DEVNULL)]
    ok, stdout, err = zygote.ask(_ahead[0], code, timeout, "compiled_ahead")
    assert ok and "compiled" in stdout, err[-3000:] or stdout[-3000:]
    return stdout
