"""Arguments of the sampler's distribution (spec 13): every refusal names the argument and what was
expected; unvalidated, the same problems come back as per-token invalid flags (the outputs' NaN)."""
import math

import pytest
import torch

from gtpo_kernels.core.sampling import (check_exclusive, check_rule, check_sampling_mask, check_temperature,
                                        mask_problems, per_token, sampler_rules)

B, T = 2, 3
N = B * T
DEV = torch.device("cpu")


def _mask():
    """Three counted tokens with sampled ids 1, 4, 2 and kept sets {0, 1}, {4}, {2, 3, 5} of V = 6."""
    return torch.tensor([0, 1, 4, 2, 3, 5]), torch.tensor([0, 2, 3, 6]), torch.tensor([1, 4, 2])


def test_valid_mask_passes():
    ids, off, y = _mask()
    t, o, invalid = check_sampling_mask((ids, off), y, 6)
    assert t.dtype == o.dtype == torch.int64 and not invalid.any()


@pytest.mark.parametrize("change, match", [
    (lambda i, o, y: (i, torch.tensor([1, 2, 3, 6]), y), r"offsets must be non-decreasing from 0"),
    (lambda i, o, y: (i, torch.tensor([0, 3, 2, 6]), y), r"offsets must be non-decreasing.*, decreasing at index 2: offsets\[1\] = 3, offsets\[2\] = 2$"),
    (lambda i, o, y: (i, torch.tensor([0, 2, 3, 5]), y), r"offsets must be non-decreasing from 0 to len\(token_ids\) = 6"),
    (lambda i, o, y: (torch.tensor([0, 1, 4, 2, 3, 6]), o, y), r"counted token 2 holds an id outside \[0, V\) = \[0, 6\)"),
    (lambda i, o, y: (torch.tensor([0, -1, 4, 2, 3, 5]), o, torch.tensor([0, 4, 2])), r"counted token 0 holds an id outside"),
    (lambda i, o, y: (torch.tensor([0, 1, 4, 2, 2, 5]), o, y), r"counted token 2 repeats an id"),
    (lambda i, o, y: (i, o, torch.tensor([1, 3, 2])), r"counted token 1 does not contain the sampled token 3"),
    (lambda i, o, y: (i, torch.tensor([0, 2, 2, 6]), torch.tensor([1, 4, 2])), r"counted token 1 does not contain"),
])
def test_mask_refusals(change, match):
    ids, off, y = change(*_mask())
    with pytest.raises(ValueError, match="sampling_mask" + ".*" + match if not match.startswith("offsets") else match):
        check_sampling_mask((ids, off), y, 6)


@pytest.mark.parametrize("change, bad", [
    (lambda i, o, y: (i, torch.tensor([0, 3, 2, 6]), y), [True, True, True]),
    (lambda i, o, y: (torch.tensor([0, 1, 4, 2, 3, 6]), o, y), [False, False, True]),
    (lambda i, o, y: (torch.tensor([0, 1, 4, 2, 2, 5]), o, y), [False, False, True]),
    (lambda i, o, y: (i, o, torch.tensor([1, 3, 2])), [False, True, False]),
])
def test_mask_unvalidated_flags(change, bad):
    ids, off, y = change(*_mask())
    _, _, invalid = check_sampling_mask((ids, off), y, 6, validate=False)
    assert invalid.tolist() == bad


def test_mask_problem_codes():
    ids, off, y = _mask()
    malformed, code = mask_problems(torch.tensor([0, 9, 4, 3, 3, 5]), off, torch.tensor([1, 4, 2]), 6)
    assert not bool(malformed) and code.tolist() == [1 | 4, 0, 2 | 4]


def test_mask_shape_and_type_refusals():
    ids, off, y = _mask()
    with pytest.raises(TypeError, match="sampling_mask must be a pair"):
        check_sampling_mask(ids, y, 6)
    with pytest.raises(ValueError, match=r"offsets must have shape \(M \+ 1,\) = \(4,\)"):
        check_sampling_mask((ids, off[:-1]), y, 6)
    with pytest.raises(TypeError, match="sampling_mask.token_ids must be an integer tensor"):
        check_sampling_mask((ids.float(), off), y, 6)
    with pytest.raises(ValueError, match="token_ids must be 1-D"):
        check_sampling_mask((ids[None], off), y, 6, validate=False)
    with pytest.raises(ValueError, match="flat position 7"):
        check_sampling_mask((ids, off), torch.tensor([1, 3, 2]), 6, positions=torch.tensor([0, 7, 9]))


def test_mask_with_rules_refused():
    for kw in ({"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.1}):
        with pytest.raises(ValueError, match=f"sampling_mask is given together with {list(kw)[0]}"):
            check_exclusive(_mask()[:2], kw.get("top_k"), kw.get("top_p"), kw.get("min_p"))
    check_exclusive(_mask()[:2], None, None, None)
    check_exclusive(None, 5, 0.9, 0.1)


@pytest.mark.parametrize("name, value, err, match", [
    ("top_p", 0.0, ValueError, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.5, ValueError, r"top_p must be in \(0, 1\]"),
    ("top_p", math.nan, ValueError, r"top_p must be in \(0, 1\]"),
    ("top_k", -2, ValueError, r"top_k must be an integer >= -1"),
    ("top_k", 2.5, TypeError, r"top_k must be an int"),
    ("min_p", 1.5, ValueError, r"min_p must be in \[0, 1\]"),
    ("min_p", -0.1, ValueError, r"min_p must be in \[0, 1\]"),
    ("top_p", torch.tensor([0.9, 0.0]), ValueError, r"top_p must be in \(0, 1\] \(1: off\) at counted tokens; flat token position 3"),
    ("top_k", torch.tensor([[3, 4, -2], [0, 1, 2]]), ValueError, r"top_k must be an integer >= -1 .*position 2"),
    ("top_k", torch.tensor([3.0, 4.0]), TypeError, r"top_k must be an integer tensor"),
    ("min_p", torch.tensor([0.1, 1.5]), ValueError, r"min_p must be in \[0, 1\] .*position 3"),
    ("top_p", torch.tensor([0.9, 0.8, 0.7]), ValueError, r"top_p must be a number, a tensor per completion \(2,\)"),
])
def test_rule_refusals(name, value, err, match):
    with pytest.raises(err, match=match):
        check_rule(name, value, B, T, N, DEV)


def test_rule_unvalidated_flags_and_expansion():
    v, bad = check_rule("top_p", torch.tensor([0.9, 0.0]), B, T, N, DEV, validate=False)
    assert v.tolist() == pytest.approx([0.9] * 3 + [0.0] * 3) and bad.tolist() == [False] * 3 + [True] * 3
    v, bad = check_rule("top_k", torch.tensor([[3, 4, -2], [0, 1, 2]]), B, T, N, DEV, validate=False)
    assert v.dtype == torch.int64 and bad.tolist() == [False, False, True, False, False, False]
    # a refused value at an uncounted token is not an error
    counted = torch.tensor([True, True, False, True, True, True])
    check_rule("top_k", torch.tensor([[3, 4, -2], [0, 1, 2]]), B, T, N, DEV, counted=counted)
    assert check_rule("min_p", None, B, T, N, DEV) == (None, None)
    assert check_rule("top_k", 50, B, T, N, DEV) == (50, None)


@pytest.mark.parametrize("value, err, match", [
    (0.0, ValueError, "temperature must be finite and > 0, got 0.0"),
    (-1.0, ValueError, "temperature must be finite and > 0"),
    (math.inf, ValueError, "temperature must be finite and > 0"),
    (torch.tensor([1.0, 0.0]), ValueError, "temperature must be finite and > 0, with 1 / tau finite, at counted tokens; flat token position 3"),
    (torch.tensor([[1.0, 1.0, float("nan")], [1.0, 1.0, 1.0]]), ValueError, "position 2"),
    (torch.ones(3), ValueError, r"temperature must be a number, a tensor per completion \(2,\) or \(2, 1\), or \(2, 3\)"),
    (torch.ones(2, 2), ValueError, "temperature must be a number"),
    (torch.tensor([1, 2]), TypeError, "temperature must be a number or a floating-point tensor"),
    ("hot", TypeError, "temperature must be a torch.Tensor"),
])
def test_temperature_refusals(value, err, match):
    with pytest.raises(err, match=match):
        check_temperature(value, B, T, N, DEV)


def test_temperature_forms():
    assert check_temperature(0.7, B, T, N, DEV) == (0.7, None)
    tau, bad = check_temperature(torch.tensor([0.5, 2.0]), B, T, N, DEV)
    assert tau.tolist() == [0.5] * 3 + [2.0] * 3 and bad is None  # (validated: a bad one raises)
    tau, _ = check_temperature(torch.tensor([[0.5], [2.0]]), B, T, N, DEV)
    assert tau.tolist() == [0.5] * 3 + [2.0] * 3
    tau, bad = check_temperature(torch.tensor([1.0, -1.0]), B, T, N, DEV, validate=False)
    assert bad.tolist() == [False] * 3 + [True] * 3
    # packed: N = 5 tokens of B = 2 completions (3 + 2)
    cu = torch.tensor([0, 3, 5])
    tau, _ = check_temperature(torch.tensor([0.5, 2.0]), 2, None, 5, DEV, cu_seqlens=cu)
    assert tau.tolist() == [0.5, 0.5, 0.5, 2.0, 2.0]
    tau, _ = check_temperature(torch.arange(1.0, 6.0), 2, None, 5, DEV, cu_seqlens=cu)
    assert tau.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_sampler_rules_normalize_and_refuse():
    """A trainer's sampler settings -> the replay keywords: off values (top_k None / 0 / -1, top_p None / 1,
    min_p None / 0) None, an integral float top_k an int; bad values refused naming the field as `name`
    spells it (the ranges of check_rule's numbers, temperature finite and > 0)."""
    off = dict(temperature=1.0, top_k=None, top_p=None, min_p=None)
    for k, p, mp in ((None, None, None), (0, 1.0, 0.0), (-1, 1, 0)):
        assert sampler_rules(1, k, p, mp) == off
    got = sampler_rules(0.7, 20.0, 0.9, 0.05)
    assert got == dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05) and type(got["top_k"]) is int
    name = "cfg.{}".format
    for kw, match in [(dict(top_k=math.inf), r"cfg\.top_k must be an integer >= -1"),
                      (dict(top_k=math.nan), r"cfg\.top_k must be an integer"), (dict(top_k=2.5), r"cfg\.top_k"),
                      (dict(top_k=-2), r"cfg\.top_k"), (dict(top_k=True), r"cfg\.top_k"),
                      (dict(top_k="3"), r"cfg\.top_k"),
                      (dict(top_p=0.0), r"cfg\.top_p must be in \(0, 1\]"), (dict(top_p=math.nan), r"cfg\.top_p"),
                      (dict(top_p=math.inf), r"cfg\.top_p"), (dict(min_p=1.5), r"cfg\.min_p must be in \[0, 1\]"),
                      (dict(min_p=math.nan), r"cfg\.min_p"), (dict(min_p=False), r"cfg\.min_p"),
                      (dict(temperature=math.inf), r"cfg\.temperature must be finite and > 0"),
                      (dict(temperature=math.nan), r"cfg\.temperature"), (dict(temperature=0.0), r"cfg\.temperature"),
                      (dict(temperature=None), r"cfg\.temperature"), (dict(temperature=True), r"cfg\.temperature")]:
        with pytest.raises(ValueError, match=match):
            sampler_rules(**{**off, **kw}, name=name)


def test_packed_ambiguous_shape_refused():
    cu = torch.tensor([0, 1, 2])  # B == N == 2
    with pytest.raises(ValueError, match=r"ambiguous when B == N = 2"):
        per_token("top_p", torch.tensor([0.9, 0.8]), 2, None, 2, DEV, cu_seqlens=cu)


def test_flat_layout_mask():
    """The flat layout (one set per flat token, empty where uncounted): offsets spread without a host
    read; problems flagged at the token's flat position; a wrong number of sets makes every token invalid."""
    from gtpo_kernels.core.sampling import check_sampling_mask_flat, flat_offsets
    ids, off, y = _mask()
    counted = torch.tensor([False, True, True, False, True, False])
    flat_ids = torch.tensor([9, 1, 4, 9, 2, 9])
    flat, mismatch = flat_offsets(off, counted)
    assert flat.tolist() == [0, 0, 2, 3, 3, 6, 6] and not bool(mismatch)
    t, f, invalid = check_sampling_mask_flat((ids, off), flat_ids, counted, 6)
    assert torch.equal(f, flat) and not invalid.any()
    with pytest.raises(ValueError, match=r"counted token 1 \(flat position 2\) does not contain the sampled token 3"):
        check_sampling_mask_flat((ids, off), torch.tensor([9, 1, 3, 9, 2, 9]), counted, 6)
    _, _, invalid = check_sampling_mask_flat((ids, off), torch.tensor([9, 1, 3, 9, 2, 9]), counted, 6, validate=False)
    assert invalid.tolist() == [False, False, True, False, False, False]
    for wrong in (off[:-1], torch.cat([off, off[-1:]])):  # M - 1 or M + 1 sets
        _, _, invalid = check_sampling_mask_flat((ids, wrong), flat_ids, counted, 6, validate=False)
        assert invalid.all()
        with pytest.raises(ValueError, match=r"offsets must have shape \(M \+ 1,\) = \(4,\)"):
            check_sampling_mask_flat((ids, wrong), flat_ids, counted, 6)


def test_unvalidated_rules_and_temperature_give_nan():
    """Unvalidated, a token with top_p 0, top_k -2, min_p 1.5 or tau <= 0 gets NaN outputs after the
    recompute and the replay; the other tokens stay finite (the invalid values act as 'off' meanwhile)."""
    from gtpo_kernels.kernels.kept_set import kept_sets
    from gtpo_kernels.kernels.replay import counted_rows, replay_logprobs
    g = torch.Generator().manual_seed(0)
    Bc, Tc, V = 2, 4, 50
    z = torch.randn(Bc, Tc, V, generator=g) * 3
    y = torch.randint(0, V, (Bc, Tc), generator=g)
    counted = torch.ones(Bc, Tc, dtype=torch.bool)
    n = Bc * Tc
    args = (Bc, Tc, n, DEV)
    tau, bad_t = check_temperature(torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]]), *args, validate=False)
    k, bad_k = check_rule("top_k", torch.tensor([[5, 5, -2, 5], [5, 5, 5, 5]]), *args, validate=False)
    p, bad_p = check_rule("top_p", torch.tensor([[0.9, 0.9, 0.9, 0.0], [0.9, 0.9, 0.9, 0.9]]), *args, validate=False)
    mp, bad_m = check_rule("min_p", torch.tensor([[0.0] * 4, [1.5, 0.0, 0.0, 0.0]]), *args, validate=False)
    invalid = bad_t | bad_k | bad_p | bad_m
    assert invalid.nonzero().squeeze(1).tolist() == [1, 2, 3, 4]
    rb, rt = counted_rows(counted, (Bc, Tc))
    tau_safe = torch.where(bad_t, torch.ones_like(tau), tau)  # a kernel never divides by an invalid tau
    ids, off, _, nonfinite, _ = kept_sets(z, rb, rt, y.reshape(-1), tau_safe, k, p, mp)
    lp, h, _ = replay_logprobs(z, rb, rt, y.reshape(-1), tau_safe, ids, off, invalid=invalid | nonfinite)
    assert torch.isnan(lp[invalid]).all() and torch.isnan(h[invalid]).all()
    assert torch.isfinite(lp[~invalid]).all() and torch.isfinite(h[~invalid]).all()


@pytest.mark.parametrize("backend", ["torch", "triton", "reference"])
def test_vllms_off_and_end_values_are_taken(backend):
    """vLLM's own ranges: top_k -1 is off (as 0: "0 (or -1) to consider all tokens"), per token too; min_p 1
    keeps the entries tied at the maximum (vllm SamplingParams: min_p in [0, 1]). Validated, every backend."""
    from gtpo_kernels import token_logprobs
    g = torch.Generator().manual_seed(3)
    z = torch.randn(2, 3, 9, generator=g)
    z[0, 1, [2, 5]] = z[0, 1].max() + 1.0  # two entries tied at the maximum
    ids = torch.randint(0, 9, (2, 3), generator=g)
    ids[0, 1] = 5
    off, _ = token_logprobs(z, ids, backend=backend)
    for k in (-1, torch.tensor([[-1, 0, 3], [-1, -1, 0]])):
        lp, _ = token_logprobs(z, ids, top_k=k, backend=backend)
        cut = torch.isfinite(lp) if isinstance(k, int) else (k <= 0).expand_as(lp)
        torch.testing.assert_close(lp[cut], off[cut], rtol=1e-6, atol=1e-6)
    lp, ent = token_logprobs(z, ids, min_p=1.0, backend=backend)
    torch.testing.assert_close(lp[0, 1], torch.tensor(-math.log(2.0)), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent[0, 1], torch.tensor(math.log(2.0)), rtol=1e-6, atol=1e-6)
