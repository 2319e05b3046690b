"""Validation made in the kernels (one host read: the status word) against the eager path's (backend='torch')
at its edges: recorded kept sets whose offsets are malformed although no token counts, a float64 mask value
that float32 would round to 0 or 1, and the order of two errors with a per-token temperature (the Triton
path raises the torch path's error); a float64 input that overflows float32, which the host checks take (no
error, and a NaN loss, as the eager path's; an overflowing entropy that grpo never reads is NaN here where
the eager path ignores it)."""
import warnings

import pytest
import torch

from gtpo_kernels import gtpo_loss, gtpo_loss_from_logps

B, T, V = 3, 4, 12


def _batch():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.tensor([1.0, -1.0, -0.5])
    tok, off = [], [0]
    for y in ids.reshape(-1).tolist():  # each token's set: its sampled id and 3 others
        tok += [y] + [v for v in range(V) if v != y][:3]
        off.append(len(tok))
    return logits, ids, adv, (torch.tensor(tok), torch.tensor(off))


def _outcome(call, backend):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            out = call(backend)
        except ValueError as e:
            return "error", str(e)
    return "loss", out.loss.detach().double()


CASES = ["sets_none_counted_offsets_count", "sets_none_counted_offsets_start", "mask_float64_1e-12_from_logps",
         "mask_float64_1e-12_sets", "mask_float64_1e-300_from_logps", "old_float64_overflow", "adv_float64_overflow",
         "entropy_float64_overflow",
         "adv_and_temperature_sets"]


@pytest.mark.parametrize("case", CASES)
def test_kernel_validation_edges_match_the_eager_path(case):
    logits, ids, adv, sm = _batch()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    kw = dict(config="grpo")
    if case.startswith("sets_none_counted"):
        kw["completion_mask"] = torch.zeros(B, T, dtype=torch.bool)
        if case.endswith("start"):
            sm = (torch.zeros(0, dtype=torch.long), torch.ones(1, dtype=torch.long))

        def call(backend):
            return gtpo_loss(logits, ids, adv, sampling_mask=sm, backend=backend, **kw)
    elif case.startswith("mask_float64"):
        m = torch.ones(B, T, dtype=torch.float64)
        m[0, 0] = 1e-300 if "1e-300" in case else 1 + 1e-12
        if case.endswith("sets"):
            def call(backend):
                return gtpo_loss(logits, ids, adv, m, sampling_mask=sm, backend=backend, **kw)
        else:
            def call(backend):
                return gtpo_loss_from_logps(lp, ids, adv, m, backend=backend, **kw)
    elif case.endswith("overflow"):
        old, a, ent = lp.double() - 0.1, adv.double(), torch.rand(B, T, dtype=torch.float64)
        {"old": old, "adv": a, "entropy": ent}[case.split("_")[0]].reshape(-1)[1] = 1e39

        def call(backend):
            return gtpo_loss_from_logps(lp, ids, a, old_logps=old, entropy=ent, backend=backend, **kw)
    else:
        tau = torch.ones(B, T)
        tau[0, 0] = -1.0
        bad_adv = adv.clone()
        bad_adv[1] = float("nan")

        def call(backend):
            return gtpo_loss(logits, ids, bad_adv, temperature=tau, sampling_mask=sm, backend=backend, **kw)
    ours, eager = _outcome(call, "triton"), _outcome(call, "torch")
    if case.endswith("overflow"):  # finite on the host in float64: no error, and a NaN loss (never an error
        # naming a logits row); the eager path gives NaN too, except for an entropy this config never reads
        assert ours[0] == "loss" and ours[1].isnan(), ours
        assert eager[0] == "loss" and (eager[1].isnan() or case.startswith("entropy")), eager
        return
    assert ours == eager if ours[0] == "error" else False, (ours, eager)


def test_token_logprobs_without_tokens_still_checks_cu_seqlens():
    """No token: no program of the forward kernel runs to check the packed form's cu_seqlens, so validating
    takes the host checks (the torch path's error)."""
    from gtpo_kernels import token_logprobs
    errors = []
    for backend in ("triton", "torch"):
        with pytest.raises(ValueError) as e:
            token_logprobs(torch.randn(0, 16), torch.zeros(0, dtype=torch.long), cu_seqlens=torch.tensor([0, 2]),
                           backend=backend)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "cu_seqlens must start at 0" in errors[0], errors


TOKEN_CASES = ["packed", "packed_max_seqlen", "packed_max_seqlen_short", "packed_decreasing", "packed_wrong_end",
               "tau_per_completion", "tau_per_token", "tau_negative", "tau_zero_counted", "tau_nan_uncounted",
               "id_then_tau", "packed_malformed_then_tau"]


@pytest.mark.parametrize("case", TOKEN_CASES)
def test_token_logprobs_packed_and_per_token_temperature_check_in_the_kernel(case):
    """token_logprobs validating, packed or with a temperature per completion / token: the forward kernel's
    status word holds the cu_seqlens, max_seqlen and temperature checks too (one host read, one launch: a
    per-completion tau is read at each token's completion in the kernel), and a failure raises the torch path's error
    (the batch's, then the temperature's); valid calls equal the torch path's log-probs and entropies."""
    from bench.launches import counting
    from gtpo_kernels import token_logprobs
    g = torch.Generator().manual_seed(4)
    z, ids = torch.randn(4, 5, 16, generator=g), torch.randint(0, 16, (4, 5), generator=g)
    mask = torch.rand(4, 5, generator=g) > 0.3
    mask[:, 0] = True
    cu = torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(1).cumsum(0)])
    tau_c = torch.tensor([0.7, 1.0, 1.3, 0.9])
    tau_t = torch.rand(4, 5, generator=g) + 0.5
    if case.startswith("packed") or case == "id_then_tau":
        kw = dict(logits=z[mask], completion_ids=ids[mask].clone(), cu_seqlens=cu.clone())
    else:
        kw = dict(logits=z, completion_ids=ids.clone(), completion_mask=mask)
    if "max_seqlen" in case:
        kw["max_seqlen"] = int(mask.sum(1).max()) - case.endswith("short")
    if case == "packed_decreasing" or case == "packed_malformed_then_tau":
        kw["cu_seqlens"][2] = cu[1] - 1
    if case == "packed_wrong_end":
        kw["cu_seqlens"][-1] -= 1
    if case in ("tau_per_completion", "tau_negative", "id_then_tau", "packed_malformed_then_tau"):
        kw["temperature"] = tau_c.clone() if "packed" not in case and case != "id_then_tau" else tau_c[:, None].clone()
    if case in ("tau_per_token", "tau_zero_counted", "tau_nan_uncounted"):
        kw["temperature"] = tau_t.clone()
    if case in ("tau_negative", "id_then_tau", "packed_malformed_then_tau"):
        kw["temperature"][1] = -1.0
    if case == "tau_zero_counted":
        kw["temperature"][0, 0] = 0.0
    if case == "tau_nan_uncounted":
        kw["temperature"][~mask] = float("nan")
    if case == "id_then_tau":
        kw["completion_ids"][3] = 16
    out = {}
    for backend in ("triton", "torch"):
        token_logprobs(**dict(kw, logits=z[:1, :1], completion_ids=ids[:1, :1], completion_mask=None,
                              cu_seqlens=None, max_seqlen=None, temperature=1.0), backend="triton")  # (the counter)
        with counting() as c:
            try:
                out[backend] = token_logprobs(backend=backend, **kw)
            except ValueError as e:
                out[backend] = str(e)
        if backend == "triton":
            assert c.triton_names.get("_vocab_fwd_kernel") == 1, dict(c.triton_names)
            if not isinstance(out["triton"], str):
                assert c.host_reads == 1 and c.launches == 1, \
                    (c.launches, dict(c.reads), dict(c.ops))
    if isinstance(out["torch"], str):
        assert out["triton"] == out["torch"]
        return
    for a, b in zip(out["triton"], out["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)


STATUS_AOT = '''
import torch
from bench.aot.compiler import _compile_ahead
from gtpo_kernels.kernels import vocab_fwd_triton as F
from gtpo_kernels.kernels.vocab_triton import fwd_block_v
i64, i32 = torch.int64, torch.int32
# (arch, logits dtype, packed, tau per completion (unvalidated: no status word, a malformed cu_seqlens NaN))
for arch, dt, cu, per_seq in ((90, torch.bfloat16, True, 0), (80, torch.float32, False, 0),
                              (100, torch.float16, True, 0), (90, torch.bfloat16, True, 2), (80, torch.float16, False, 1)):
    tau = {} if per_seq else dict(temp_ptr=0.7)
    ck = _compile_ahead(F._vocab_fwd_kernel, arch, dict(logits_ptr=dt, ids_ptr=i64, mask_ptr=torch.float32,
                        bad_ptr=torch.int8, status_ptr=i32, work_ptr=i64, cu_ptr=i64, rows_ptr=i64),
                        torch.float32, dict(stride_lb=151936 * 512, stride_lt=151936, T=512, V=151936,
                        logits_start=0, temp_stride=1 if per_seq else 0, scale=1.0, softcap=0.0, NB=1,
                        n_seq=64, max_seqlen=-1, id_start=0, **tau),
                        dict(HAS_SCALE=False, HAS_SOFTCAP=False, BLOCK_V=fwd_block_v(151936), TEMP_BY_VALUE=not per_seq,
                             NAN_FLAGGED=True, HAS_STATUS=not per_seq, MASK_VALUES=not per_seq, CU_CHECK=cu and not per_seq,
                             CU_NAN=cu and per_seq > 0, TEMP_PER_SEQ=per_seq, num_warps=8))
    assert ("atom" in ck.asm["ptx"]) == (not per_seq), arch
print("compiled")
'''


def test_the_status_word_compiles_for_the_gpus():
    """The forward kernel with token_logprobs' status word (its counter's atomic, the mask values, the packed
    form's cu_seqlens check) compiled ahead of time for sm_90, sm_80 and sm_100, and unvalidated with a tau per
    completion (padded, and packed: found in cu_seqlens, a malformed one NaN) for sm_90 and sm_80 (Triton's
    compiler in a process without the interpreter)."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-c", STATUS_AOT], env=env, cwd=root, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0 and "compiled" in p.stdout, p.stderr[-3000:]
