"""Spec 14's rollout/training mismatch metrics (rollout_k3, rollout_abs_diff, rollout_max_abs_diff,
rollout_outside_frac, rollout_nan_frac) on every entry point, against the float64 reference
(gtpo_family.rollout_mismatch) evaluated on the log-probs the call returned: so the tolerance is the
metric's own arithmetic (float32: 1e-5 relative), not the log-probs' (test_joint compares the whole call,
these metrics included, against the reference's own log-probs). The rollout log-probs are drawn at
distances from 1e-4 (where exp(d) - 1 - d computed naively in float32 keeps no digit) to 1, with NaN at
some counted tokens, some at every counted token, and -inf (a token the engine gave probability 0)."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gtpo_reference.gtpo_family as fam
from conftest import examples
from gtpo_kernels import (GTPOConfig, gtpo_loss, gtpo_loss_from_logps, linear_gtpo_loss, rollout_mismatch,
                          token_logprobs)

NAMES = ("rollout_k3", "rollout_abs_diff", "rollout_max_abs_diff", "rollout_outside_frac", "rollout_nan_frac")
ENTRIES = ["logits-fused", "logits-eager", "logits-torch", "logits-reference", "logps", "head", "replay",
           "public"]


def _close(got, want, where):
    for k in NAMES:
        g, w = float(got[k]), float(want[k])
        if math.isinf(w):
            assert g == w, f"{where}: {k} = {g}, reference {w}"
            continue
        assert abs(g - w) <= 1e-5 * abs(w) + 1e-12, f"{where}: {k} = {g!r}, reference {w!r}"


@st.composite
def cases(draw):
    return dict(entry=draw(st.sampled_from(ENTRIES)), B=2 * draw(st.integers(1, 3)), T=draw(st.integers(1, 6)),
                V=draw(st.integers(3, 24)), seed=draw(st.integers(0, 2**31 - 1)), packed=draw(st.booleans()),
                scale=draw(st.sampled_from([1e-4, 1e-2, 0.3, 1.0])),
                nan=draw(st.sampled_from(["none", "some", "all"])), neg_inf=draw(st.booleans()),
                preset=draw(st.sampled_from(["gtpo", "grpo", "dapo"])))


def _run(c):
    g = torch.Generator().manual_seed(c["seed"])
    B, T, V = c["B"], c["T"], c["V"]
    D = 8
    hidden = torch.randn(B, T, D, generator=g)
    weight = torch.randn(V, D, generator=g) / 2
    logits = (hidden @ weight.t()).detach()
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    lp = torch.log_softmax(logits.double(), -1).gather(-1, ids[..., None])[..., 0]
    roll = lp + c["scale"] * torch.randn(B, T, generator=g, dtype=torch.float64)
    if c["nan"] == "some":
        roll[torch.rand(B, T, generator=g) < 0.3] = float("nan")
    elif c["nan"] == "all":
        roll[:] = float("nan")
    if c["neg_inf"]:
        roll[0, 0] = -math.inf
    roll = roll.float()
    cfg = GTPOConfig.preset(c["preset"])
    kw = dict(config=cfg, group_size=2, rollout_logps=roll)
    entry = c["entry"]
    if c["packed"] and entry in ("logits-fused", "logits-eager", "logits-torch", "logps", "head"):
        keep = mask.reshape(-1)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), mask.sum(1).cumsum(0)])
        pk = dict(cu_seqlens=cu, max_seqlen=T)
        flat = lambda x: x.reshape(B * T, *x.shape[2:])[keep]  # noqa: E731
        logits, ids, hidden, roll, lp, m = flat(logits), flat(ids), flat(hidden), flat(roll), flat(lp), None
        kw["rollout_logps"] = roll
    else:
        pk, m = {}, mask
    if entry == "logits-fused":
        out = gtpo_loss(logits, ids, adv, m, backend="triton", **kw, **pk)
    elif entry == "logits-eager":  # a policy term the epilogue does not compute: the eager surrogate on Triton
        out = gtpo_loss(logits, ids, adv, m, backend="triton", **dict(kw, config=cfg.replace(policy_loss="vespo")),
                        **pk)
    elif entry == "logits-torch":
        out = gtpo_loss(logits, ids, adv, m, backend="torch", **kw, **pk)
    elif entry == "logits-reference":
        out = gtpo_loss(logits.double(), ids, adv.double(), m, backend="reference",
                        **dict(kw, rollout_logps=roll.double()))
    elif entry == "logps":
        H = None if not cfg.needs_entropy else token_logprobs(logits, ids, **pk)[1]
        out = gtpo_loss_from_logps(lp.float(), ids, adv, m, entropy=H, **kw, **pk)
    elif entry == "head":
        out = linear_gtpo_loss(hidden, weight, ids, adv, m, **kw, **pk)
    elif entry == "replay":  # kept sets: the mismatch of the replayed log-probs
        out = gtpo_loss(logits, ids, adv, m, top_k=2, **dict(kw, config=cfg.replace(temperature=0.9)))
    else:
        got = rollout_mismatch(lp.float(), roll, m)
        return got, fam.rollout_mismatch(lp.float().double(), roll.double(), torch.ones_like(lp, dtype=torch.bool)
                                         if m is None else m)
    counted = torch.ones(out.logps.shape, dtype=torch.bool) if m is None else m
    return out.metrics, fam.rollout_mismatch(out.logps.double(), roll.double(), counted)


@settings(max_examples=examples(35), deadline=None)  # CI time: nightly runs 350
@given(cases())
def test_mismatch_metrics_equal_the_reference_on_every_entry_point(c):
    got, want = _run(c)
    assert set(NAMES) <= set(got), sorted(got)
    _close(got, want, c)
    for k in NAMES:
        assert got[k].shape == () and got[k].dtype in (torch.float32, torch.float64)
    if c["nan"] == "all" and not c["neg_inf"]:
        assert float(got["rollout_nan_frac"]) == 1.0 and float(got["rollout_k3"]) == 0.0


@pytest.mark.parametrize("roll_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("entry", ["logits-fused", "logits-torch", "logps"])
def test_k3_keeps_its_digits_at_small_differences(entry, roll_dtype):
    """d = 1e-4 exactly in float32 terms: k3 = d**2 / 2 + ... = 5.0002e-9, where exp(d) - 1 - d in float32
    is off by about 1e-8 (no digit right); every path within 1e-5 of the float64 value. Float64 rollout
    log-probs (lp - 1e-4 exactly) are subtracted as given: rounded to float32 first, d would move by up to
    half an ulp of lp (1.2e-7 here, 1e-3 of d)."""
    g = torch.Generator().manual_seed(3)
    B, T, V = 2, 4, 9
    logits = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.tensor([1.0, -1.0])
    lp = token_logprobs(logits, ids)[0]
    roll = (lp.double() - 1e-4).to(roll_dtype)
    kw = dict(config="grpo", rollout_logps=roll)
    if entry == "logps":
        out = gtpo_loss_from_logps(lp, ids, adv, **kw)
    else:
        out = gtpo_loss(logits, ids, adv, backend={"logits-fused": "triton", "logits-torch": "torch"}[entry], **kw)
    d = out.logps.double() - roll.double()
    want = float((torch.expm1(d) - d).mean())
    assert want > 4e-9 and float(out.metrics["rollout_k3"]) == pytest.approx(want, rel=1e-5)


def test_metrics_absent_without_rollout_logps_and_no_gradient():
    logits = torch.randn(2, 3, 7, requires_grad=True)
    ids = torch.randint(0, 7, (2, 3))
    out = gtpo_loss(logits, ids, torch.tensor([1.0, -1.0]), config="grpo")
    assert not set(NAMES) & set(out.metrics)
    roll = token_logprobs(logits.detach(), ids)[0] + 0.1
    out = gtpo_loss(logits, ids, torch.tensor([1.0, -1.0]), config="grpo", rollout_logps=roll)
    assert all(not out.metrics[k].requires_grad for k in NAMES)
    assert float(out.metrics["rollout_abs_diff"]) == pytest.approx(0.1, rel=1e-5)
    assert float(out.metrics["rollout_outside_frac"]) == 0.0  # exp(-0.1) = 0.905: inside


def test_rollout_mismatch_refuses_bad_input():
    lp = -torch.rand(2, 3)
    with pytest.raises(ValueError, match="rollout_logps"):
        rollout_mismatch(lp, -torch.rand(2, 4))
    with pytest.raises(ValueError, match="completion_mask"):
        rollout_mismatch(lp, -torch.rand(2, 3), torch.ones(3, 2))
    with pytest.raises(TypeError, match="logps"):
        rollout_mismatch(torch.ones(2, 3, dtype=torch.long), -torch.rand(2, 3))


@pytest.mark.parametrize("band", [(0.05, 0.2), (0.3, 0.5), (2.0, 6.0)])
@pytest.mark.parametrize("entry", ["logits-fused", "logits-torch", "logps", "public"])
def test_metrics_at_every_distance_band(entry, band):
    """Every |d| in one band, both signs: across the bounds of rollout_outside_frac (exp(d) = 0.9 and 1.1
    at d = -0.105 and 0.095) and the float64 k3's series (|d| < 0.1); just under the Triton k3's switch from
    its series to the direct form (0.5, where the series' last terms weigh most); 2 to 6 (the engine gave
    the token e^-6 to e^6 times the trainer's probability: there exp(d) - 1 - d must be the direct form, a
    Taylor series to d^12 being 1e-5 to 1e-3 off). Every metric within 1e-5 of the float64 reference."""
    lo, hi = band
    g = torch.Generator().manual_seed(11)
    B, T, V = 2, 8, 11
    logits = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True
    lp = token_logprobs(logits, ids)[0]
    sign = torch.where(torch.rand(B, T, generator=g) < 0.5, -1.0, 1.0)
    roll = (lp.double() - sign * (lo + (hi - lo) * torch.rand(B, T, generator=g, dtype=torch.float64))).float()
    kw = dict(config="grpo", rollout_logps=roll)
    if entry == "public":
        got, logps = rollout_mismatch(lp, roll, mask), lp
    else:
        out = (gtpo_loss_from_logps(lp, ids, adv, mask, **kw) if entry == "logps" else
               gtpo_loss(logits, ids, adv, mask, backend={"logits-fused": "triton", "logits-torch": "torch"}[entry],
                         **kw))
        got, logps = out.metrics, out.logps
    want = fam.rollout_mismatch(logps.double(), roll.double(), mask)
    assert lo < float(want["rollout_abs_diff"]) < float(want["rollout_max_abs_diff"]) < hi
    _close(got, want, entry)


def test_rollout_mismatch_float64_and_no_counted_tokens():
    """Float64 log-probs give float64 metrics, equal to the reference to 1e-12 (k3 of d = 1e-6 keeps its
    digits: no float32 rounding on the way), with a mask and without one (every token counted); no counted
    token, or no token at all: every metric 0."""
    g = torch.Generator().manual_seed(5)
    lp = -3 * torch.rand(3, 7, generator=g, dtype=torch.float64)
    roll = lp + 1e-6 * torch.randn(3, 7, generator=g, dtype=torch.float64)
    roll[1, 2] = float("nan")
    m = torch.rand(3, 7, generator=g) > 0.3
    m[1, 2] = True
    for mask in (m, None):  # None: every token counted
        got = rollout_mismatch(lp, roll, mask)
        want = fam.rollout_mismatch(lp, roll, torch.ones_like(m) if mask is None else m)
        for k in NAMES:
            assert got[k].dtype == torch.float64
            assert abs(float(got[k]) - float(want[k])) <= 1e-12 * abs(float(want[k])), (k, got[k], want[k])
        assert 0 < float(want["rollout_k3"]) < 1e-11 and 0 < float(want["rollout_nan_frac"]) < 0.1
    none = rollout_mismatch(lp.float(), roll.float(), torch.zeros(3, 7))
    empty = rollout_mismatch(torch.zeros(0, 4), torch.zeros(0, 4))
    for got in (none, empty):
        assert {k: float(v) for k, v in got.items()} == {k: 0.0 for k in NAMES}
