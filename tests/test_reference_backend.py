"""backend='reference' (the float64 oracle behind the public calls) on what the other backends take:
a 0-d tensor temperature with a truncation rule (it raised IndexError), the kept_mass metric of sets
rebuilt by the rules (it was missing), and 16-bit LM-head inputs, whose logits the head forms as the
tiles do: the GEMM's output, bias included, rounded once, then scale and soft-cap in float32 (it rounded
the bias, the scale and the soft-cap each to bfloat16: logp off by 4e-3). Validating, it refuses what the
other backends refuse, with the same error (a counted row of logits holding NaN or +inf, or giving its own
target a logit of -inf: checks.raise_on_flags), where it returned a NaN loss or NaN / -inf log-probs;
unvalidated that token's outputs stay NaN / -inf, as before."""
import pytest
import torch

import gtpo_kernels as gk


def _head(seed=7, B=2, T=3, D=8, V=16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g) * 1.5,
            torch.randint(0, V, (B, T), generator=g), torch.randn(B, generator=g))


@pytest.mark.parametrize("rule", [dict(top_p=0.85), dict(top_k=4, min_p=0.05)])
def test_a_0d_temperature_with_a_rule_equals_the_number(rule):
    """(0.75: the same value in float32 and float64.)"""
    h, w, ids, adv = _head()
    kw = dict(group_size=2, config="grpo", backend="reference", **rule)
    for call in (lambda t: gk.gtpo_loss(h @ w.t(), ids, adv, temperature=t, **kw),
                 lambda t: gk.linear_gtpo_loss(h, w, ids, adv, temperature=t, **kw)):
        a, b = call(torch.tensor(0.75)), call(0.75)
        assert torch.equal(a.logps, b.logps) and torch.equal(a.loss, b.loss)
        assert float(a.metrics["kept_mass"]) == float(b.metrics["kept_mass"])
    lp, en = gk.linear_token_logprobs(h, w, ids, torch.tensor(0.75), backend="reference", **rule)
    lp2, en2 = gk.linear_token_logprobs(h, w, ids, 0.75, backend="reference", **rule)
    assert torch.equal(lp, lp2) and torch.equal(en, en2)


@pytest.mark.parametrize("tau", ["number", "per-token"])
def test_kept_mass_of_rebuilt_sets_equals_the_other_backends(tau):
    h, w, ids, adv = _head(3, B=3, T=4, V=20)
    t = 0.7 if tau == "number" else torch.rand(3, 4, generator=torch.Generator().manual_seed(1)) + 0.5
    got = {}
    for backend in ("reference", "torch", "triton"):
        out = gk.linear_gtpo_loss(h, w, ids, adv, group_size=3, config="grpo", temperature=t, top_p=0.8,
                                  backend=backend)
        got[backend] = float(out.metrics["kept_mass"])
    assert 0.5 < got["reference"] < 1
    assert got["reference"] == pytest.approx(got["torch"], rel=1e-6) == pytest.approx(got["triton"], rel=1e-6)


def test_bf16_head_logits_are_rounded_once():
    g = torch.Generator().manual_seed(0)
    B, T, D, V = 2, 5, 8, 40
    h = torch.randn(B, T, D, generator=g).bfloat16()
    w = (torch.randn(V, D, generator=g) * 1.5).bfloat16()
    b = (torch.randn(V, generator=g) * 0.3).bfloat16()
    ids = torch.randint(0, V, (B, T), generator=g)
    scale, cap = 0.7, 2.5
    z = torch.addmm(b, h.reshape(-1, D), w.t()).reshape(B, T, V).double() * scale  # the GEMM's output
    lp64, en64 = gk.token_logprobs(cap * torch.tanh(z / cap), ids, 1.0, backend="reference")
    for backend in ("reference", "torch", "triton"):
        lp, en = gk.linear_token_logprobs(h, w, ids, 1.0, bias=b, logit_scale=scale, logit_softcap=cap,
                                          backend=backend)
        assert (lp.double() - lp64).abs().max() <= 1e-5 and (en.double() - en64).abs().max() <= 1e-5, backend


@pytest.mark.parametrize("rule", [{}, dict(top_k=5)])
def test_token_logprobs_is_forward_only_on_every_backend(rule):
    """token_logprobs on logits that require grad returns tensors with no autograd history on every backend
    (backend='reference' returned them attached to the logits' graph), equal to the reference's values."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 17, generator=g).requires_grad_()
    ids = torch.randint(0, 17, (3, 4), generator=g)
    ref = gk.token_logprobs(x, ids, 0.8, backend="reference", **rule)
    for backend in ("reference", "torch", "triton"):
        lp, en = gk.token_logprobs(x, ids, 0.8, backend=backend, **rule)
        assert not lp.requires_grad and not en.requires_grad and lp.grad_fn is None, backend
        torch.testing.assert_close(lp.double(), ref[0].double(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(en.double(), ref[1].double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
@pytest.mark.parametrize("name, bad, good", [("top_k", -2, 4), ("top_p", float("nan"), 0.8), ("top_p", 0.0, 0.8),
                                             ("min_p", 1.5, 0.1)])
def test_an_invalid_rule_value_unvalidated_is_nan_on_every_backend(backend, name, bad, good):
    """A per-token rule value out of its range at one counted token, unvalidated: that token's log-prob and
    its logits row's gradient are NaN, and the loss, on every backend (the reference backend gave a finite
    log-prob and gradient, the rule taken as off); the other tokens' log-probs stay finite."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(2, 3, 10, generator=g) * 2
    x = torch.full((2, 3), good, dtype=torch.int64 if name == "top_k" else torch.float32)
    x[1, 1] = bad
    zz = z.clone().requires_grad_()
    out = gk.gtpo_loss(zz, z.argmax(-1), torch.tensor([1.0, -1.0]), group_size=2, old_logps=torch.full((2, 3), -1.0),
                       config="grpo", backend=backend, validate=False, **{name: x})
    out.loss.backward()
    others = torch.ones(2, 3, dtype=torch.bool)
    others[1, 1] = False
    assert torch.isnan(out.logps[1, 1]) and torch.isnan(out.loss) and torch.isnan(zz.grad[1, 1]).any()
    assert torch.isfinite(out.logps[others]).all()  # (NaN may spread in the gradient: spec 13)


_B, _T, _V, _D = 3, 4, 9, 5


def _inputs(value, packed):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(_B, _T, _V, generator=g)
    ids = torch.randint(0, _V, (_B, _T), generator=g)
    mask = torch.ones(_B, _T, dtype=torch.bool)
    mask[2, 3] = False
    col = int(ids[1, 2]) if value == float("-inf") else (int(ids[1, 2]) + 1) % _V
    x[1, 2, col] = value
    x[2, 3, 0] = float("nan")  # a masked-out row: never refused
    kw = dict(completion_mask=mask)
    if packed:
        x, ids = x[mask], ids[mask]
        kw = dict(cu_seqlens=torch.tensor([0, 4, 8, 11]))
    return x, ids, torch.tensor([1.0, -0.5, 0.25]), kw


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_reference_backend_refuses_the_rows_the_others_refuse(value, packed):
    """gtpo_loss and token_logprobs, padded and packed: the same error on the three backends (the reference's
    was none); unvalidated, the token's log-prob not finite and the others finite."""
    x, ids, adv, kw = _inputs(value, packed)
    errors = {}
    for backend in ("torch", "triton", "reference"):
        for name, call in (("loss", lambda: gk.gtpo_loss(x, ids, adv, group_size=1, config="grpo", backend=backend,
                                                         **kw)),
                           ("logprobs", lambda: gk.token_logprobs(x, ids, 1.0, backend=backend, **kw))):
            with pytest.raises(ValueError) as e:
                call()
            errors[backend, name] = str(e.value)
    for name in ("loss", "logprobs"):
        assert errors["reference", name] == errors["torch", name] == errors["triton", name], errors
        assert ("token (6,)" if packed else "token (1, 2)") in errors["reference", name], errors
    lp, _ = gk.token_logprobs(x, ids, 1.0, backend="reference", validate=False, **kw)
    at = 6 if packed else (1, 2)
    assert not torch.isfinite(lp[at]) and torch.isfinite(lp.reshape(-1)[:6 if packed else 4]).all()


def test_reference_head_refuses_a_nan_row():
    """The head's hidden state NaN at a counted token: its row of logits NaN, refused as on the other backends."""
    g = torch.Generator().manual_seed(6)
    h, w = torch.randn(_B, _T, _D, generator=g), torch.randn(_V, _D, generator=g)
    h[0, 1, 2] = float("nan")
    ids, adv = torch.randint(0, _V, (_B, _T), generator=g), torch.tensor([1.0, -0.5, 0.25])
    for backend in ("triton", "reference"):
        with pytest.raises(ValueError, match=r"token \(0, 1\) contains NaN or \+inf"):
            gk.linear_gtpo_loss(h, w, ids, adv, group_size=1, config="grpo", backend=backend)
        with pytest.raises(ValueError, match=r"token \(0, 1\) contains NaN or \+inf"):
            gk.linear_token_logprobs(h, w, ids, 1.0, backend=backend)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_rebuilt_sets_over_a_non_finite_row_unvalidated_are_nan(value):
    """Sets rebuilt by top_k over a counted row holding NaN (outside the top 4) or +inf, unvalidated: the token's
    log-prob, entropy, the loss and the row's gradient NaN on the three backends (the reference returned a
    finite log-prob, entropy and gradient for NaN, as its statement passes over a NaN entry; -inf for +inf)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 12, generator=g)
    x[0, 0, x[0, 0].argmin()] = value
    ids, adv = torch.randint(0, 12, (2, 3), generator=g), torch.tensor([1.0, -0.5])
    for backend in ("triton", "torch", "reference"):
        z = x.clone().requires_grad_()
        out = gk.gtpo_loss(z, ids, adv, group_size=1, config="grpo", backend=backend, validate=False, top_k=4)
        out.loss.backward()
        assert torch.isnan(out.logps[0, 0]) and torch.isnan(out.entropy[0, 0]) and torch.isnan(out.loss), backend
        assert torch.isnan(z.grad[0, 0]).any() and torch.isfinite(z.grad[1]).all(), backend
        assert torch.isfinite(out.logps[1]).all(), backend


def test_a_recorded_set_reads_only_its_own_logits():
    """Validating, a NaN logit outside a recorded set is not read (spec 13): the reference returns what the other
    backends return, where it refused the row."""
    z = torch.randn(1, 1, 8, generator=torch.Generator().manual_seed(0))
    z[0, 0, 6] = float("nan")
    ids, sm = torch.tensor([[2]]), (torch.tensor([1, 2, 3]), torch.tensor([0, 3]))
    got = [gk.token_logprobs(z, ids, 1.0, backend=b, sampling_mask=sm)[0] for b in ("triton", "torch", "reference")]
    want = torch.log_softmax(z[0, 0, 1:4].double(), -1)[1]
    assert all(abs(float(g) - float(want)) < 1e-6 for g in got), (got, want)


def test_a_short_max_seqlen_steers_nothing_in_the_reference():
    """Packed, unvalidated, max_seqlen shorter than a completion: the reference gives the values of the true
    max_seqlen (it raised IndexError: its padded window was max_seqlen long), as the Triton backend does."""
    g = torch.Generator().manual_seed(4)
    cu, ids = torch.tensor([0, 6, 10, 15, 18]), torch.tensor([5, 7, 9, 4, 8, 2, 5, 7, 8, 2, 1, 2, 3, 4, 5, 1, 2, 5])
    x, adv = torch.randn(18, 20, generator=g), torch.tensor([1.0, -1.0, 0.5, -0.5])  # (shared prefixes: conflicts)
    cfg = gk.GTPOConfig.preset("gtpo", entropy_threshold=None)
    outs = [gk.gtpo_loss(x, ids, adv, group_size=2, config=cfg, cu_seqlens=cu, max_seqlen=ms, validate=False,
                         backend="reference") for ms in (6, 4)]
    assert torch.isfinite(outs[0].loss) and torch.equal(outs[0].loss, outs[1].loss)
    assert torch.equal(outs[0].logps, outs[1].logps) and torch.equal(outs[0].lam, outs[1].lam)
    assert (outs[0].lam != 1).any()
    lp = [gk.token_logprobs(x, ids, 0.9, backend="reference", cu_seqlens=cu, max_seqlen=ms, validate=False, top_k=5)[0]
          for ms in (6, 4)]
    assert torch.equal(lp[0], lp[1]) and torch.isfinite(lp[0]).all()


@pytest.mark.parametrize("dtype", [torch.int16, torch.int8, torch.uint8])
def test_small_integer_ids_validated(dtype):
    """completion_ids of any integer dtype (spec 6), validating: the reference gathered with them and raised
    'Expected dtype int32/int64 for index'; now the value of the other backends."""
    g = torch.Generator().manual_seed(8)
    x, ids, adv = torch.randn(2, 3, 9, generator=g), torch.randint(0, 9, (2, 3), generator=g), torch.tensor([1.0, -1.0])
    old = -torch.rand(2, 3, generator=g) - 0.5
    got = [gk.gtpo_loss(x, ids.to(dtype), adv, group_size=1, old_logps=old, config="grpo", backend=b).loss
           for b in ("reference", "torch")]
    assert torch.isfinite(got[0]) and abs(float(got[0]) - float(got[1])) < 1e-6, got


@pytest.mark.parametrize("fill", [float("nan"), 0.0])
def test_a_temperature_at_masked_out_tokens_is_not_read(fill):
    """A temperature per token holding NaN or 0 where the mask is 0 (not read, validation takes it): the masked-out
    rows' gradient exactly 0 on the three backends (the reference divided every row by its tau: NaN there)."""
    g = torch.Generator().manual_seed(9)
    x, ids, adv = torch.randn(2, 3, 9, generator=g), torch.randint(0, 9, (2, 3), generator=g), torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    tau = torch.rand(2, 3, generator=g) + 0.5
    tau[~mask] = fill
    old = -torch.rand(2, 3, generator=g) - 0.5
    for backend in ("triton", "torch", "reference"):
        z = x.clone().requires_grad_()
        out = gk.gtpo_loss(z, ids, adv, mask, group_size=1, old_logps=old, config="grpo", temperature=tau,
                           backend=backend)
        out.loss.backward()
        assert torch.equal(z.grad[~mask], torch.zeros_like(z.grad[~mask])), backend
        assert z.grad[mask].abs().sum() > 0 and torch.isfinite(out.loss), backend


def test_the_loss_constants_take_no_gradient_on_any_backend():
    """Advantages, old / reference log-probs and rollout weights are constants of the loss (spec 10: it is
    differentiable w.r.t. the logits): the reference backend passed them to the oracle in autograd, so each
    got a gradient there (adv.grad -0.22 ...) and None on the others."""
    g = torch.Generator().manual_seed(1)
    B, T, V = 4, 3, 11
    x = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    lp = torch.log_softmax(x, -1).gather(-1, ids[..., None])[..., 0]
    for backend in ("torch", "triton", "reference"):
        adv = torch.tensor([1.0, -0.8, 0.5, -0.3], requires_grad=True)
        old = (lp + 0.1).detach().requires_grad_()
        ref = (lp - 0.2).detach().requires_grad_()
        w = (torch.rand(B, T, generator=torch.Generator().manual_seed(2)) + 0.5).requires_grad_()
        z = x.clone().requires_grad_()
        out = gk.gtpo_loss(z, ids, adv, group_size=2, old_logps=old, ref_logps=ref, rollout_is_weights=w,
                           config=gk.GTPOConfig.preset("grpo", beta=0.05), backend=backend)
        out.loss.backward()
        assert z.grad is not None and (z.grad != 0).any(), backend
        assert adv.grad is None and old.grad is None and ref.grad is None and w.grad is None, backend


def test_clip_cov_packed_draws_one_number_a_token_on_every_backend():
    """clip_cov's draws in the packed form: one per packed token on every backend (the reference drew them
    in the padded layout, so it chose other tokens: loss 0.0529 against 0.0902)."""
    g = torch.Generator().manual_seed(0)
    B, T, V = 4, 5, 12
    x = 3 * torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, -1] = False
    mask[2, -2:] = False
    adv = torch.tensor([1.0, -0.7, 0.4, -1.3])
    old = torch.log_softmax(x, -1).gather(-1, ids[..., None])[..., 0] + 0.2 * torch.randn(B, T, generator=g)
    cu = torch.tensor([0] + mask.sum(1).cumsum(0).tolist())
    outs = {}
    for backend in ("reference", "torch", "triton"):
        cfg = gk.GTPOConfig.preset("clip-cov", clip_cov_ratio=0.3, clip_cov_lb=-5.0,
                                   generator=torch.Generator().manual_seed(3))
        outs[backend] = gk.gtpo_loss(x[mask], ids[mask], adv, old_logps=old[mask], cu_seqlens=cu, max_seqlen=5,
                                     config=cfg, backend=backend)
    zeroed = {k: (o.per_token_loss == 0).nonzero().flatten().tolist() for k, o in outs.items()}
    assert zeroed["reference"] == zeroed["torch"] == zeroed["triton"] and zeroed["torch"], zeroed
    assert abs(float(outs["reference"].loss) - float(outs["torch"].loss)) < 1e-6, outs


@pytest.mark.parametrize("bad", [None, "adv", "old"])
def test_geo_mean_clip_frac_agrees_with_a_nan(bad):
    """geo_mean's clip_frac counts the tokens whose log r the clip stopped; unvalidated, a NaN advantage or a
    -inf old log-prob counted its tokens as clipped on torch and Triton (clip_frac 0.25 / 0.0625, finite, where
    the oracle's comparisons give 0): the three backends agree, clipped tokens present."""
    g = torch.Generator().manual_seed(4)
    B, T, V = 4, 4, 9
    x = torch.randn(B, T, V, generator=g) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    lp = torch.log_softmax(x, -1).gather(-1, ids[..., None])[..., 0]
    old = lp + torch.tensor([[0.6, -0.6, 0.05, 0.9]]).expand(B, T)  # log r = -0.6, 0.6, -0.05, -0.9
    adv = torch.tensor([1.0, -0.8, 0.5, -0.3])
    if bad == "adv":
        adv[0] = float("nan")
    if bad == "old":
        old[0, 1] = float("-inf")
    fr = {}
    for backend in ("torch", "triton", "reference"):
        out = gk.gtpo_loss(x, ids, adv, group_size=2, old_logps=old, config="geo-mean", backend=backend,
                           validate=bad is None)
        fr[backend] = float(out.metrics["clip_frac"])
        assert torch.isfinite(out.loss) == (bad is None)
    assert fr["torch"] == fr["triton"] == fr["reference"], fr
    assert fr["torch"] >= (0.375 if bad is None else 0.25), fr


@pytest.mark.parametrize("block", [None, 8])  # (8: the Triton kernels' whole blocks and a partial one)
def test_rules_a_nan_coefficient_leaves_zeros_outside_the_set(block, monkeypatch):
    """Sets rebuilt by top_k, unvalidated, a NaN old log-prob at one counted token: its gradient row is NaN on
    its kept set and exactly 0 outside it (spec 13) on every backend (the Triton backward multiplied the NaN
    coefficient into every entry: 12 of 12 NaN where the others give 4 and 8 zeros); the other rows finite."""
    from gtpo_kernels.kernels import vocab_triton
    if block:
        monkeypatch.setattr(vocab_triton, "MAX_BLOCK_V", block)
    g = torch.Generator().manual_seed(5)
    B, T, V = 4, 3, 12
    x = torch.randn(B, T, V, generator=g) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    lp = torch.log_softmax(x, -1).gather(-1, ids[..., None])[..., 0]
    old = lp + 0.1
    old[0, 1] = float("nan")
    adv = torch.tensor([1.0, -0.8, 0.5, -0.3])
    pattern = {}
    for backend in ("torch", "triton", "reference"):
        z = x.clone().requires_grad_()
        out = gk.gtpo_loss(z, ids, adv, group_size=2, old_logps=old, config="grpo", top_k=3, validate=False,
                           backend=backend)
        out.loss.backward()
        row = z.grad[0, 1]
        pattern[backend] = torch.isnan(row).tolist()
        assert 3 <= int(torch.isnan(row).sum()) <= 4 and bool((row[~torch.isnan(row)] == 0).all()), (backend, row)
        others = torch.ones(B, T, dtype=torch.bool)
        others[0, 1] = False
        assert torch.isfinite(z.grad[others]).all() and (z.grad[others] != 0).any(), backend
    assert pattern["torch"] == pattern["triton"] == pattern["reference"], pattern
