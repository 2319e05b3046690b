"""Tests added by the third mutation sweep (tests/mutation_sweep.py): each kills mutants
of the sampler replay (spec 13), the verl modes or the per-token temperature code that the suite let
survive, through the public calls and against the float64 reference (reference/). The mutant ids in the
docstrings are the sweep's."""
import math

import pytest
import torch

from gtpo_kernels import gtpo_loss, linear_token_logprobs, token_logprobs
from gtpo_reference import gtpo_sampling as rs


def _logp_over(row, keep, y, tau=1.0):
    """log p^K_y of one float64 row over the ids `keep`."""
    s = row.double()[torch.tensor(keep)] / tau
    return float(s[keep.index(y)] - torch.logsumexp(s, 0))


# ---- the rebuild's rules (kernels/kept_set.py) ---------------------------------------------------------------

@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_top_p_removes_the_prefix_whose_mass_equals_one_minus_top_p(backend):
    """K3: four equal logits (the others -inf), top_p = 0.75: the cumulative masses 0.25, 0.5, 0.75, 1 are
    exact and the first (lowest id: ties by ascending id) is <= 1 - top_p = 0.25, so it is removed: 3 kept
    (vLLM's `<=`), log p = log(1/3)."""
    row = torch.tensor([1.5, 1.5, 1.5, 1.5, -float("inf"), -float("inf")])
    logits = row.reshape(1, 1, -1).repeat(2, 3, 1)
    ids = torch.full((2, 3), 3)
    lp, _ = token_logprobs(logits, ids, 1.0, top_p=0.75, backend=backend)
    ref, _, _, (tid, off) = rs.replay_token_logprobs(logits.double(), ids, top_p=0.75)
    assert tid[:3].tolist() == [1, 2, 3] and off[1] == 3
    assert abs(float(ref[0, 0]) - math.log(1 / 3)) < 1e-12
    torch.testing.assert_close(lp.double(), ref, atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_top_p_one_keeps_entries_whose_probability_underflows(backend):
    """K4: top_k = 3 and top_p off (None, or exactly 1): the 3 largest values are kept although two of them
    have a probability that underflows to 0 in float32 (top-p would remove a prefix of mass 0 <= 1 - 1):
    mean_kept_size 3, nothing restored, as the float64 reference."""
    V = 8
    row = torch.full((V,), -1000.0)
    row[2], row[5], row[6] = 0.0, -150.0, -151.0
    logits = row.reshape(1, 1, V).repeat(2, 2, 1)
    ids = torch.full((2, 2), 2)
    adv = torch.tensor([1.0, -1.0])
    for top_p in (None, 1.0):
        out = gtpo_loss(logits, ids, adv, group_size=2, config="grpo", top_k=3, top_p=top_p, backend=backend)
        _, _, met, _ = rs.replay_token_logprobs(logits.double(), ids, top_k=3, top_p=top_p)
        assert float(met["mean_kept_size"]) == 3.0
        for k in ("mean_kept_size", "replay_restored_frac", "kept_mass"):
            torch.testing.assert_close(out.metrics[k].double(), met[k], atol=1e-6, rtol=0, msg=k)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tiny_top_p_keeps_the_largest_entry(backend):
    """K5: top_p = 1e-8 (1 - top_p rounds to 1 in float32, so every cumulative mass is <= it): the largest
    entry is still kept, and the sampled token (not the largest) restored beside it."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 10, generator=g) * 2
    am = logits.argmax(-1)
    ids = (am + 1) % 10
    lp, _ = token_logprobs(logits, ids, 1.0, top_p=1e-8, backend=backend)
    ref, _, _, (tid, off) = rs.replay_token_logprobs(logits.double(), ids, top_p=1e-8)
    assert (off.diff() == 2).all()
    assert (ref < -1e-3).all()  # two entries in every set: log p of the sampled one is not 0
    torch.testing.assert_close(lp.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_plus_inf_logit_with_min_p_gives_nan(backend):
    """K15: a row holding +inf with min_p: its kept set means nothing, so the token's log-prob is NaN
    unvalidated (min-p's exp(s - inf) removed everything but the restored sampled token: it was a finite 0);
    the other tokens equal the reference's. (Validating it should raise: the strict xfail below.)"""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 9, generator=g)
    ids = torch.randint(0, 9, (2, 3), generator=g)
    bad = logits.clone()
    bad[1, 2, (int(ids[1, 2]) + 1) % 9] = float("inf")
    lp, ent = token_logprobs(bad, ids, 1.0, min_p=0.1, validate=False, backend=backend)
    assert torch.isnan(lp[1, 2]) and torch.isnan(ent[1, 2]), (lp, ent)
    ok = torch.ones(2, 3, dtype=torch.bool)
    ok[1, 2] = False
    ref, _, _, _ = rs.replay_token_logprobs(logits.double(), ids, min_p=0.1)
    torch.testing.assert_close(lp[ok].double(), ref[ok], atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
@pytest.mark.parametrize("rule", [dict(top_k=3), dict(top_p=0.9), dict(min_p=0.1)])
def test_nonfinite_row_with_rules_is_refused_when_validating(rule, value, backend):
    """A counted row holding NaN or +inf is invalid input (spec 6) with rebuilt sets as without: refused
    when validating (on logits and on the head), NaN for that token alone when not (once made NaN but
    not refused: the rebuild drops such an entry, and only the token was marked invalid)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 9, generator=g)
    ids = torch.randint(0, 9, (2, 3), generator=g)
    logits[1, 2, (int(ids[1, 2]) + 1) % 9] = value
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        token_logprobs(logits, ids, 1.0, backend=backend, **rule)
    lp, _ = token_logprobs(logits, ids, 1.0, backend=backend, validate=False, **rule)
    bad = torch.zeros(2, 3, dtype=torch.bool)
    bad[1, 2] = True
    assert torch.isnan(lp[bad]).all() and torch.isfinite(lp[~bad]).all()
    # the head: that token's hidden state holds the value, so its row of logits does (NaN / +inf)
    hidden = torch.randn(2, 3, 4, generator=g)
    hidden[1, 2, 1] = value
    weight = torch.randn(9, 4, generator=g)
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        linear_token_logprobs(hidden, weight, ids, 1.0, backend=backend, **rule)


# ---- recorded sets on packed logits with logits_start (kernels/replay.py) -------------------------------------

@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_packed_recorded_sets_with_logits_start(backend):
    """R2: packed logits (1 + N, V) with logits_start = 1 (row 1 + k predicts token k) and recorded sets: the
    log-probs, entropies and the gradient are the reference's on rows 1.. (they were read one row early)."""
    g = torch.Generator().manual_seed(11)
    N, V = 7, 16
    z = torch.randn(N + 1, V, generator=g) * 2
    ids = torch.randint(0, V, (N,), generator=g)
    cu = torch.tensor([0, 3, N], dtype=torch.int32)
    tau = 0.7
    rlp, rent, _, sm = rs.replay_token_logprobs(z[1:].double(), ids, top_k=5, temperature=tau, cu_seqlens=cu)
    x = z.clone().requires_grad_()
    lp, ent = token_logprobs(x, ids, tau, cu_seqlens=cu, max_seqlen=4, logits_start=1, sampling_mask=sm,
                             backend=backend)
    torch.testing.assert_close(lp.double(), rlp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), rent, atol=1e-5, rtol=0)
    adv = torch.tensor([1.0, -0.5])
    out = gtpo_loss(x, ids, adv, cu_seqlens=cu, max_seqlen=4, logits_start=1, lam=torch.ones(N), n_conf=torch.ones(2),
                    config="grpo", temperature=tau, sampling_mask=sm, backend=backend)
    torch.testing.assert_close(out.logps.double(), rlp, atol=1e-5, rtol=0)
    out.loss.backward()
    assert x.grad[0].eq(0).all() and x.grad[1:].abs().sum() > 0


# ---- the rules' invalid values, unvalidated (pipeline/replay.py, pipeline/head_replay.py) ------------------

@pytest.mark.parametrize("bad_rule", ["top_k", "top_p", "min_p"])
def test_one_invalid_rule_among_several_gives_nan(bad_rule):
    """P2: per-token top_k, top_p and min_p tensors, validate=False, one of them invalid at one token: that
    token's log-prob and entropy are NaN (any invalid rule: the flags are or-ed, not and-ed), through the
    logits and the head; the other tokens equal the float64 reference's."""
    from gtpo_kernels import linear_token_logprobs
    g = torch.Generator().manual_seed(21)
    B, T, D, V = 2, 3, 6, 14
    h = torch.randn(B, T, D, generator=g)
    w = torch.randn(V, D, generator=g)
    logits = h @ w.t()
    ids = torch.randint(0, V, (B, T), generator=g)
    rules = dict(top_k=torch.full((B, T), 6), top_p=torch.full((B, T), 0.9), min_p=torch.full((B, T), 0.01))
    bad = {k: v.clone() for k, v in rules.items()}
    bad[bad_rule][0, 1] = {"top_k": -2, "top_p": 1.5, "min_p": -0.5}[bad_rule]
    ok = torch.ones(B, T, dtype=torch.bool)
    ok[0, 1] = False
    ref, _, _, _ = rs.replay_token_logprobs((h.double() @ w.double().t()), ids, **rules)
    for lp, ent in (token_logprobs(logits, ids, 1.0, validate=False, backend="torch", **bad),
                    linear_token_logprobs(h, w, ids, 1.0, validate=False, backend="torch", **bad)):
        assert torch.isnan(lp[0, 1]) and torch.isnan(ent[0, 1]), lp
        torch.testing.assert_close(lp[ok].double(), ref[ok], atol=1e-5, rtol=0)


# ---- the head's replay (pipeline/head_replay.py) --------------------------------------------------------------

def _head(seed=31, B=4, T=3, D=8, V=24):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.8
    ids = torch.randint(0, V, (B, T), generator=g)
    return h, w, ids, torch.randn(B, generator=g)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_head_rebuilt_sets_use_the_temperature_and_report_restored(backend):
    """H7, H8: linear_gtpo_loss with top_k / top_p rebuilt at temperature 0.6, sampled ids drawn at random
    (some left out by the rules: restored): log-probs and the metrics replay_restored_frac, mean_kept_size,
    kept_mass equal the float64 reference's on the materialized logits."""
    from gtpo_kernels import linear_gtpo_loss
    h, w, ids, adv = _head()
    ids[:, 0] = (h @ w.t())[:, 0].argmax(-1)  # these kept by the rules, the others mostly restored
    rules = dict(top_k=5, top_p=0.7)
    out = linear_gtpo_loss(h, w, ids, adv, group_size=2, config="grpo", temperature=0.6, backend=backend, **rules)
    rlp, _, met, _ = rs.replay_token_logprobs(h.double() @ w.double().t(), ids, temperature=0.6, **rules)
    assert 0 < float(met["replay_restored_frac"]) < 1
    torch.testing.assert_close(out.logps.double(), rlp, atol=1e-5, rtol=0)
    for k in ("replay_restored_frac", "mean_kept_size", "kept_mass"):
        torch.testing.assert_close(out.metrics[k].double(), met[k], atol=1e-5, rtol=0, msg=k)


def test_head_recorded_sets_refuse_a_nonfinite_kept_logit():
    """H10: linear_token_logprobs with recorded sets whose kept column holds +inf (a weight row of inf):
    validating, the flagged row is refused naming the logits; unvalidated its token is NaN."""
    from gtpo_kernels import linear_token_logprobs
    h, w, ids, _ = _head()
    logits = (h.double() @ w.double().t())
    _, _, _, (tid, off) = rs.replay_token_logprobs(logits, ids, top_k=4)
    col = next(int(v) for v in tid[off[1]:off[2]] if int(v) != int(ids[0, 1]))  # in token 1's set
    w = w.clone()
    w[col] = 0.0
    w[col, 0] = math.copysign(float("inf"), float(h[0, 1, 0]))  # token 1's logit of `col`: +inf
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        linear_token_logprobs(h, w, ids, 1.0, sampling_mask=(tid, off), backend="torch")
    lp, _ = linear_token_logprobs(h, w, ids, 1.0, sampling_mask=(tid, off), backend="torch", validate=False)
    assert torch.isnan(lp[0, 1])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rebuilt_sets_refuse_a_sampled_token_at_minus_inf(backend):
    """P8: the sampled token's own logit is -inf (the rules leave it out; it is restored): validating, the
    replay kernel's flag is read and the call refuses naming that token; unvalidated its log-prob is NaN and
    the others are the reference's."""
    g = torch.Generator().manual_seed(41)
    logits = torch.randn(2, 3, 10, generator=g)
    ids = torch.randint(0, 10, (2, 3), generator=g)
    bad = logits.clone()
    bad[1, 0, int(ids[1, 0])] = -float("inf")
    with pytest.raises(ValueError, match=r"completion token \(1, 0\) gives its own target token a logit of -inf"):
        token_logprobs(bad, ids, 1.0, top_k=3, backend=backend)
    lp, _ = token_logprobs(bad, ids, 1.0, top_k=3, validate=False, backend=backend)
    assert torch.isnan(lp[1, 0])
    ok = torch.ones(2, 3, dtype=torch.bool)
    ok[1, 0] = False
    ref, _, _, _ = rs.replay_token_logprobs(logits.double(), ids, top_k=3)
    torch.testing.assert_close(lp[ok].double(), ref[ok], atol=1e-5, rtol=0)


# ---- the replay kernels (kernels/replay_torch.py, replay_triton.py, replay_ops.py) ---------------------------

@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_recorded_set_with_a_nonfinite_kept_logit(backend, value):
    """T4: a kept (not sampled) logit of +inf or NaN in a recorded set: validating, the call refuses naming
    the row; unvalidated that token's log-prob and entropy are NaN and the others the reference's."""
    g = torch.Generator().manual_seed(51)
    logits = torch.randn(2, 3, 12, generator=g)
    ids = torch.randint(0, 12, (2, 3), generator=g)
    ref, _, _, (tid, off) = rs.replay_token_logprobs(logits.double(), ids, top_k=4)
    col = next(int(v) for v in tid[off[4]:off[5]] if int(v) != int(ids[1, 1]))  # token (1, 1)'s set
    bad = logits.clone()
    bad[1, 1, col] = value
    with pytest.raises(ValueError, match=r"completion token \(1, 1\) contains NaN or \+inf"):
        token_logprobs(bad, ids, 1.0, sampling_mask=(tid, off), backend=backend)
    lp, ent = token_logprobs(bad, ids, 1.0, sampling_mask=(tid, off), validate=False, backend=backend)
    assert torch.isnan(lp[1, 1]) and torch.isnan(ent[1, 1])
    ok = torch.ones(2, 3, dtype=torch.bool)
    ok[1, 1] = False
    torch.testing.assert_close(lp[ok].double(), ref[ok], atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attach_replay_grad_scales_by_the_upstream_gradient(backend):
    """O1: attach_replay_grad's backward multiplies the coefficients by the upstream gradient: d(2.5 L)/dz
    = 2.5 dL/dz, with dL/dz the float64 reference's."""
    from gtpo_kernels.core.sampling import check_sampling_mask_flat
    from gtpo_kernels.kernels.replay import flat_rows
    from gtpo_kernels.kernels.replay_ops import attach_replay_grad, replay_fwd
    g = torch.Generator().manual_seed(52)
    B, T, V = 2, 3, 12
    z = torch.randn(B, T, V, generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    _, _, _, (tid, off) = rs.replay_token_logprobs(z.double(), y, top_k=5)
    counted = torch.ones(B * T, dtype=torch.bool)
    tok, f_off, invalid = check_sampling_mask_flat((tid, off), y.reshape(-1), counted, V, validate=False)
    rb, rt = flat_rows((B, T), 0, z.device)
    w1, w2 = torch.randn(B * T, generator=g), torch.randn(B * T, generator=g)
    tau = torch.tensor(0.8)
    x = z.clone().requires_grad_()
    logp, ent, stats, _ = replay_fwd(x.detach(), rb, rt, y.reshape(-1), tau, tok, f_off, invalid, counted, 1.0, None,
                                     backend)
    value = attach_replay_grad(x, (w1 * logp + w2 * ent).sum(), rb, rt, y.reshape(-1), tau, tok, f_off, stats, ent,
                               w1, w2, 1.0, None, backend)
    (2.5 * value).backward()
    rows = z.reshape(B * T, V).double().requires_grad_()
    rlp, rh = rs.replay_logprobs(rows, y.reshape(-1), (tid, off), 0.8)
    (2.5 * (w1.double() * rlp + w2.double() * rh).sum()).backward()
    assert rows.grad.abs().sum() > 0
    torch.testing.assert_close(x.grad.reshape(B * T, V).double(), rows.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_replay_kernel_flags_bad_sets_by_itself(backend):
    """X3, X4: replay_logprobs without `invalid` (the kernel's own checks, spec 13's contract of its flags):
    a set holding the sampled id twice, or an id outside [0, V), is flagged and its token NaN; the other
    tokens equal the float64 reference's."""
    from gtpo_kernels.kernels.replay import counted_rows, replay_logprobs
    g = torch.Generator().manual_seed(53)
    B, T, V = 1, 4, 10
    z = torch.randn(B, T, V, generator=g)
    y = torch.tensor([2, 5, 7, 1])
    sets = [[1, 2, 4], [5, 5, 6], [0, 7, V + 3], [1, 3, 9]]  # token 1: y twice; token 2: an id out of range
    tid = torch.tensor([v for s in sets for v in s])
    off = torch.tensor([0, 3, 6, 9, 12])
    rb, rt = counted_rows(torch.ones(B, T, dtype=torch.bool), (B, T))
    lp, ent, flags = replay_logprobs(z, rb, rt, y, 1.0, tid, off, backend=backend)
    assert flags.tolist()[0] == 0 and flags.tolist()[3] == 0 and (flags[1:3] != 0).all(), flags
    assert torch.isnan(lp[1:3]).all() and torch.isnan(ent[1:3]).all()
    good = torch.tensor([0, 3])
    good_sets = (torch.tensor([1, 2, 4, 1, 3, 9]), torch.tensor([0, 3, 6]))
    rlp, rh = rs.replay_logprobs(z[0, good].double(), y[good], good_sets)
    torch.testing.assert_close(lp[good].double(), rlp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent[good].double(), rh, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_entropy_only_gradient_over_recorded_sets(backend):
    """T9, X6: recorded sets, completions with advantage 0 beside others and an entropy bonus: the tokens
    whose only coefficient is the entropy's (c = 0, e != 0) get their gradient (it was left 0), equal to
    the float64 reference's."""
    from conftest import assert_grad_close
    from gtpo_kernels import GTPOConfig
    g = torch.Generator().manual_seed(54)
    logits = torch.randn(4, 3, 12, generator=g) * 1.5
    ids = torch.randint(0, 12, (4, 3), generator=g)
    _, _, _, sm = rs.replay_token_logprobs(logits.double(), ids, top_k=5)
    adv = torch.tensor([0.0, 1.2, 0.0, -0.8])
    cfg = GTPOConfig.preset("grpo", entropy_coef=0.1)
    grads = {}
    for b, x in ((backend, logits.clone()), ("reference", logits.double())):
        x.requires_grad_()
        gtpo_loss(x, ids, adv.to(x.dtype), group_size=2, config=cfg, sampling_mask=sm, backend=b).loss.backward()
        grads[b] = x.grad
    assert grads["reference"][0].abs().sum() > 0  # the zero-advantage completion's rows move
    assert_grad_close("grad", grads[backend], grads["reference"], 1e-5)


# ---- per-token temperature (core/sampling.py, pipeline/loss.py, kernels/ops.py, ...) --------------------------

@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_infinite_per_token_temperature_refused_or_nan(backend):
    """S2: a per-token temperature of +inf at one counted token is not finite: refused when validating,
    NaN at that token unvalidated; the others equal the reference's at their own temperatures."""
    g = torch.Generator().manual_seed(61)
    logits = torch.randn(2, 3, 9, generator=g)
    ids = torch.randint(0, 9, (2, 3), generator=g)
    tau = 0.5 + torch.rand(2, 3, generator=g)
    bad = tau.clone()
    bad[0, 2] = float("inf")
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        token_logprobs(logits, ids, bad, backend=backend)
    lp, _ = token_logprobs(logits, ids, bad, validate=False, backend=backend)
    assert torch.isnan(lp[0, 2])
    ok = torch.ones(2, 3, dtype=torch.bool)
    ok[0, 2] = False
    ref = torch.log_softmax(logits.double() / tau.double()[..., None], -1).gather(-1, ids[..., None])[..., 0]
    torch.testing.assert_close(lp[ok].double(), ref[ok], atol=1e-5, rtol=0)


def test_float64_per_token_temperature_is_not_rounded():
    """U7: float64 logits with a float64 per-token temperature (values float32 cannot hold): the log-probs
    meet the float64 reference to spec 7's float64 tolerance (1e-12), with and without kept sets (a float32
    rounding of tau is ~1e-8 off)."""
    g = torch.Generator().manual_seed(62)
    logits = torch.randn(2, 4, 11, generator=g, dtype=torch.float64) * 3
    ids = torch.randint(0, 11, (2, 4), generator=g)
    tau = 0.6 + torch.rand(2, 4, generator=g, dtype=torch.float64) / 3
    assert (tau.float().double() != tau).all()
    ref = torch.log_softmax(logits / tau[..., None], -1).gather(-1, ids[..., None])[..., 0]
    lp, _ = token_logprobs(logits, ids, tau, backend="torch")
    assert (lp - ref).abs().max() <= 1e-12 * max(1.0, float(ref.abs().max()))
    rlp, _, _, sm = rs.replay_token_logprobs(logits, ids, temperature=tau, top_k=6)
    for kw in (dict(top_k=6), dict(sampling_mask=sm)):
        lp, _ = token_logprobs(logits, ids, tau, backend="torch", **kw)
        assert (lp - rlp).abs().max() <= 1e-12 * max(1.0, float(rlp.abs().max())), kw


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_float64_min_p_tensor_is_compared_in_float64(backend):
    """S12: min_p as a float64 tensor on float64 logits keeps what the same number keeps, with a cut 1e-9
    below a boundary: p = (0.5, 0.3, 0.2), min_p = 0.4 - 1e-9 keeps the 0.2 token (p >= min_p max p); float32
    rounds min_p up to 0.40000000596 and would remove it."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    logits = torch.log(p).reshape(1, 1, 3).repeat(2, 2, 1)
    ids = torch.zeros(2, 2, dtype=torch.long)
    min_p = 0.4 - 1e-9
    assert float(torch.tensor(min_p, dtype=torch.float32)) > 0.4
    as_number, _ = token_logprobs(logits, ids, 1.0, min_p=min_p, backend=backend)
    as_tensor, _ = token_logprobs(logits, ids, 1.0, min_p=torch.full((2,), min_p, dtype=torch.float64),
                                  backend=backend)
    assert torch.allclose(as_number, torch.full((2, 2), math.log(0.5), dtype=torch.float64), atol=1e-12), as_number
    assert torch.allclose(as_tensor, as_number, atol=1e-12, rtol=0), (as_tensor, as_number)


# ---- verl's modes (objective/verl_modes.py) -------------------------------------------------------------------

def _verl_case(seed=71):
    g = torch.Generator().manual_seed(seed)
    B, T, V = 4, 6, 9
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 1.5
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 2:] = False  # uneven lengths: the uncounted tokens carry their completion's advantage
    mask[3, 4:] = False
    lp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    old = lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    return logits, ids, mask, old


@pytest.mark.parametrize("preset,over", [("kl_cov", dict(kl_cov_ratio=0.3, ppo_kl_coef=0.5)),
                                         ("clip_cov", dict(clip_cov_ratio=0.5, clip_cov_lb=-0.05, clip_cov_ub=0.6))])
def test_covariance_means_over_counted_tokens(preset, over):
    """V13: kl_cov / clip_cov with uneven completion lengths: the covariance's means are over the counted
    tokens only (the advantage's too), so the chosen tokens, the loss and the gradient equal the float64
    reference's."""
    from gtpo_kernels import GTPOConfig
    logits, ids, mask, old = _verl_case()
    adv = torch.tensor([2.0, -0.5, 0.3, -1.0], dtype=torch.float64)
    outs, grads = {}, {}
    for b in ("torch", "reference"):
        cfg = GTPOConfig.preset(preset, entropy_threshold=None, generator=torch.Generator().manual_seed(3), **over)
        x = logits.clone().requires_grad_()
        outs[b] = gtpo_loss(x, ids, adv, mask, group_size=2, old_logps=old, config=cfg, backend=b)
        outs[b].loss.backward()
        grads[b] = x.grad
    assert grads["reference"].abs().sum() > 0
    want = float(outs["reference"].loss.detach())
    assert abs(float(outs["torch"].loss.detach()) - want) <= 1e-12 * max(1, abs(want))
    torch.testing.assert_close(grads["torch"], grads["reference"], atol=1e-10, rtol=1e-7)


def test_clip_cov_clip_frac_counts_zero_advantages():
    """V17: clip_cov choosing every candidate (ratio 1, wide bounds; a clip range the ratios stay inside), with
    completions of advantage 0: their chosen tokens count as clipped too, as in verl's pg_clipfrac (every
    corr == 0), so clip_frac is 1, equal to the reference's."""
    from gtpo_kernels import GTPOConfig
    logits, ids, mask, old = _verl_case(72)
    adv = torch.tensor([1.0, 0.0, -1.0, 0.0], dtype=torch.float64)
    fr = []
    for b in ("torch", "reference"):
        cfg = GTPOConfig.preset("clip_cov", entropy_threshold=None, clip_cov_ratio=1.0, clip_cov_lb=-10.0,
                                clip_cov_ub=10.0, eps_low=0.9, eps_high=0.99,
                                generator=torch.Generator().manual_seed(0))
        fr.append(gtpo_loss(logits, ids, adv, mask, group_size=1, old_logps=old, config=cfg,
                            backend=b).metrics["clip_frac"])
    assert float(fr[1]) == 1.0
    torch.testing.assert_close(fr[0], fr[1])


def test_clip_cov_clip_frac_equals_the_reference_where_the_ppo_clip_binds():
    """clip_frac with policy_loss='clip-cov' is verl's pg_clipfrac, as the reference: the covariance
    selection (and the dual clip), not the tokens the PPO clip stopped (once counted too)."""
    from gtpo_kernels import GTPOConfig
    logits, ids, mask, old = _verl_case(72)
    adv = torch.tensor([1.0, 0.0, -1.0, 0.5], dtype=torch.float64)
    fr = [gtpo_loss(logits, ids, adv, mask, group_size=1, old_logps=old, backend=b,
                    config=GTPOConfig.preset("clip_cov", entropy_threshold=None, clip_cov_ratio=0.5, eps_low=0.05,
                                             eps_high=0.05, generator=torch.Generator().manual_seed(0))
                    ).metrics["clip_frac"] for b in ("torch", "reference")]
    torch.testing.assert_close(fr[0], fr[1])


# ---- rebuilt sets across a vocabulary split (distributed/vocab_replay.py) -------------------------------------

def _split_rank(rank, world):
    import torch.distributed as dist
    g = torch.Generator().manual_seed(81)
    B, T, V, cut = 4, 3, 20, 9
    x = torch.randn(B, T, V, generator=g) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[:, 0] = x[:, 0].argmax(-1)  # kept by the rules; most others restored
    part = x[..., :cut] if rank == 0 else x[..., cut:]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    res = {}
    rules = dict(top_k=3, top_p=0.8)
    out = gtpo_loss(part.contiguous(), ids, adv, group_size=2, config="grpo", backend="torch",
                    process_group=dist.group.WORLD, **rules)
    rlp, _, met, _ = rs.replay_token_logprobs(x.double(), ids, **rules)
    res["ref_restored"] = float(met["replay_restored_frac"])
    res["metrics"] = {k: abs(float(out.metrics[k]) - float(met[k])) for k in met}
    res["logps"] = float((out.logps.double() - rlp).abs().max())
    # top_k = 0 at a token: its set cannot be rebuilt from the ranks' candidates (refused)
    k = torch.full((B, T), 3)
    k[2, 1] = 0
    try:
        token_logprobs(part.contiguous(), ids, 1.0, top_k=k, backend="torch", process_group=dist.group.WORLD)
        res["k0"] = "accepted"
    except ValueError as e:
        res["k0"] = str(e)
    # unvalidated, top_k = 0 at every token (no candidate to gather: it raised IndexError): every token NaN
    lp0, _ = token_logprobs(part.contiguous(), ids, 1.0, top_k=0, validate=False, backend="torch",
                            process_group=dist.group.WORLD)
    res["k0_nan"] = bool(torch.isnan(lp0).all())
    # unvalidated, an invalid rule value at one token (top_p = 1.5): that token NaN, the others finite
    p = torch.full((B, T), 0.8)
    p[1, 2] = 1.5
    lp, _ = token_logprobs(part.contiguous(), ids, 1.0, top_k=3, top_p=p, validate=False, backend="torch",
                           process_group=dist.group.WORLD)
    res["bad_nan"] = bool(torch.isnan(lp[1, 2]))
    ok = torch.ones(B, T, dtype=torch.bool)
    ok[1, 2] = False
    res["others"] = float((lp[ok].double() - rlp[ok]).abs().max())
    return res


def test_rebuilt_sets_across_a_vocabulary_split():
    """D4, D6, D7: on 2 gloo ranks (a split at 9 of 20 ids), rules rebuilt from each rank's top_k candidates:
    the log-probs and the metrics (replay_restored_frac among them) equal the float64 reference's; a token
    with top_k = 0 is refused naming sampling_mask (unvalidated, top_k = 0 everywhere is NaN everywhere); unvalidated,
    a token with an invalid top_p is NaN."""
    from gloo import run_ranks_ok
    ranks = run_ranks_ok(_split_rank, 2, watchdog=120)
    for r, res in enumerate(ranks):
        assert 0 < res["ref_restored"] < 1
        assert res["logps"] <= 1e-5 and all(v <= 1e-6 for v in res["metrics"].values()), (r, res)
        assert "top_k with process_group must be > 0" in res["k0"] and res["k0_nan"], (r, res["k0"])
        assert res["bad_nan"] and res["others"] <= 1e-5, (r, res)


def test_triton_takes_the_number_and_the_schedule_temperature():
    """U4, U5: on the Triton backend, paths that pass the temperature to the kernels as a tensor (ops.
    temperature_param): the LM head with a number, a loss off the 4-launch path (rollout weights) with the
    config's number, and a float64 0-d schedule tensor (copied to float32 once): log-probs at tau = 0.7 equal
    the float64 reference's."""
    from gtpo_kernels import GTPOConfig, linear_token_logprobs
    g = torch.Generator().manual_seed(91)
    B, T, D, V = 2, 3, 6, 11
    h = torch.randn(B, T, D, generator=g)
    w = torch.randn(V, D, generator=g)
    z = h @ w.t()
    ids = torch.randint(0, V, (B, T), generator=g)
    ref = torch.log_softmax(h.double() @ w.double().t() / 0.7, -1).gather(-1, ids[..., None])[..., 0]
    lp, _ = linear_token_logprobs(h, w, ids, 0.7, backend="triton")
    torch.testing.assert_close(lp.double(), ref, atol=1e-5, rtol=0)
    adv = torch.tensor([1.0, -1.0])
    out = gtpo_loss(z, ids, adv, group_size=2, config=GTPOConfig.preset("grpo", temperature=0.7),
                    rollout_is_weights=torch.full((B, T), 0.9), backend="triton")
    torch.testing.assert_close(out.logps.double(), ref, atol=1e-5, rtol=0)
    sched = torch.tensor(0.7, dtype=torch.float64)
    out = gtpo_loss(z, ids, adv, group_size=2, config="grpo", temperature=sched, backend="triton")
    torch.testing.assert_close(out.logps.double(), ref, atol=1e-5, rtol=0)
    lp, _ = token_logprobs(z, ids, sched, backend="triton")
    torch.testing.assert_close(lp.double(), ref, atol=1e-5, rtol=0)
