"""A per-token temperature (spec 13): gtpo_loss(temperature=...) and token_logprobs with a tensor
per completion ((B,), (B, 1)) or per token ((B, T); packed (N,)), against the float64 reference on logits
divided row by row by their own tau (the same math: s = z / tau_t), on every backend; refusals and
NaN for invalid values. Tolerances: spec 7 (conftest.TOL)."""
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import gtpo_reference as ref
from batches import cases_and_configs
from conftest import TOL, assert_grad_close, assert_value_close, examples
from gtpo_kernels import GTPOConfig, gtpo_loss, linear_gtpo_loss, token_logprobs

BACKENDS = ["triton", "torch", "reference"]


def _tau(kind, B, T, gen):
    per_token = torch.rand(B, T, generator=gen, dtype=torch.float64) * 1.6 + 0.3
    return {"B": per_token[:, 0].contiguous(), "B1": per_token[:, :1].contiguous(), "BT": per_token}[kind]


def _per_token(tau, B, T):
    return tau.reshape(B, -1).expand(B, T) if tau.numel() != B * T else tau.reshape(B, T)


def _scaled(case, tau64):
    """The case's logits (float64, in autograd) with each predicting row divided by its token's tau."""
    z = case.logits.detach().double().clone().requires_grad_()
    s, T = case.logits_start, case.ids.shape[1]
    zs = torch.cat([z[:, :s], z[:, s:s + T] / tau64[..., None], z[:, s + T:]], 1)
    return z, zs


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(9))  # CI time: nightly runs 90
@given(data=st.data(), kind=st.sampled_from(["B", "B1", "BT"]), seed=st.integers(0, 2**20))
def test_loss_with_per_token_temperature_matches_reference(backend, data, kind, seed):
    dtypes = [torch.float32, torch.bfloat16] + ([torch.float64] if backend != "triton" else [])
    case, cfg = data.draw(cases_and_configs(dtypes=dtypes, min_V=2, nonempty=True), label="case, config")
    B, T = case.ids.shape
    gen = torch.Generator().manual_seed(seed)
    tau = _tau(kind, B, T, gen)
    tau64 = _per_token(tau, B, T)
    z, zs = _scaled(case, tau64)
    kw = cfg.__dict__ | {"temperature": 1.0}
    if cfg.entropy_threshold is not None:  # keep the filter's decisions away from its threshold
        _, ent = ref.token_logprobs(zs[:, case.logits_start:case.logits_start + T].detach(), case.ids, 1.0,
                                    case.counted)
        hbar = ent.sum(1) / case.counted.sum(1).clamp(min=1)
        assume(((hbar - cfg.entropy_threshold).abs() > 1e-4).all())
    refl = None
    if cfg.beta > 0:  # the KL term's reference log-probs: near the policy's
        lp, _ = ref.token_logprobs(zs[:, case.logits_start:case.logits_start + T].detach(), case.ids, 1.0,
                                   case.counted)
        refl = torch.where(case.counted, lp + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64), 0.0)
        if case.logits.dtype != torch.float64:  # ours takes them in float32: the reference the same values
            refl = refl.float().double()
    r = ref.gtpo_loss(zs, case.ids, case.adv, case.mask, group_size=case.G, logits_start=case.logits_start,
                      ref_logps=refl, **kw)
    r["loss"].sum().backward()
    x = case.logits.detach().clone().requires_grad_()
    out = gtpo_loss(x, case.ids, case.adv, case.mask, group_size=case.G, logits_start=case.logits_start,
                    ref_logps=None if refl is None else refl.to(case.logits.dtype if case.logits.dtype == torch.float64
                                                                    else torch.float32), config=cfg, temperature=tau,
                    backend=backend)
    out.loss.sum().backward()
    tol = TOL[case.logits.dtype]
    if cfg.loss_agg != "none":
        assert_value_close("loss", out.loss.detach(), r["loss"].detach(), tol["loss"])
    for name in ("logps", "entropy", "per_token_loss"):
        assert_value_close(name, getattr(out, name).detach(), r[name], tol["value"])
    assume((z.grad != 0).any())
    if cfg.loss_agg != "none":
        assert_grad_close("grad logits", x.grad, z.grad, tol["grad"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["B", "B1", "BT"])
def test_token_logprobs_with_per_token_temperature(backend, kind):
    gen = torch.Generator().manual_seed(11)
    B, T, V = 4, 5, 37
    z = torch.randn(B, T, V, generator=gen) * 3
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.rand(B, T, generator=gen) > 0.25
    tau = _tau(kind, B, T, gen)
    lp, ent = token_logprobs(z, ids, tau, mask, backend=backend)
    rlp, rent = ref.token_logprobs(z.double() / _per_token(tau, B, T)[..., None], ids, 1.0, mask)
    assert_value_close("logps", lp, rlp, 1e-5)
    assert_value_close("entropy", ent, rent, 1e-5)
    # a number tau equals the same tau as a tensor
    lp1, _ = token_logprobs(z, ids, 0.7, mask, backend=backend)
    lp2, _ = token_logprobs(z, ids, torch.full((B,), 0.7), mask, backend=backend)
    assert_value_close("logps", lp2, lp1, 1e-6)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_packed_per_token_temperature_equals_padded(backend):
    gen = torch.Generator().manual_seed(3)
    B, T, V = 4, 6, 29
    z = torch.randn(B, T, V, generator=gen) * 2
    ids = torch.randint(0, V, (B, T), generator=gen)
    adv = torch.randn(B, generator=gen)
    tau = torch.rand(B, T, generator=gen) + 0.5
    cfg = GTPOConfig(entropy_threshold=None)
    pad = gtpo_loss(z, ids, adv, group_size=2, temperature=tau, config=cfg, backend=backend)
    cu = torch.arange(0, B * T + 1, T, dtype=torch.int32)
    pk = gtpo_loss(z.reshape(B * T, V), ids.reshape(-1), adv, group_size=2, cu_seqlens=cu, max_seqlen=T,
                   temperature=tau.reshape(-1), config=cfg, backend=backend)
    assert_value_close("loss", pk.loss, pad.loss, 1e-6)
    assert_value_close("logps", pk.logps, pad.logps.reshape(-1), 1e-6)


def _small(seed, B, T, V):
    """Random logits (B, T, V), ids and advantages."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, V, generator=gen), torch.randint(0, V, (B, T), generator=gen),
            torch.randn(B, generator=gen))


def test_bad_temperatures_are_refused_or_nan():
    z, ids, adv = _small(5, 2, 3, 11)
    for bad in (torch.tensor([1.0, 0.0]), torch.tensor([1.0, float("nan")]), torch.tensor([-1.0, 1.0])):
        with pytest.raises(ValueError, match="temperature must be finite and > 0"):
            gtpo_loss(z, ids, adv, group_size=2, temperature=bad, backend="torch")
        with pytest.raises(ValueError, match="temperature must be finite and > 0"):
            token_logprobs(z, ids, bad, backend="torch")
        for backend in ("torch", "triton"):  # triton: the 3-launch path, where the kernels read a bad tau as NaN
            out = gtpo_loss(z, ids, adv, group_size=2, temperature=bad, config="grpo", backend=backend,
                            validate=False)
            assert torch.isnan(out.loss) and torch.isnan(out.logps[1 if bad[0] == 1.0 else 0]).all(), backend
            assert torch.isfinite(out.logps[0 if bad[0] == 1.0 else 1]).all(), backend
    for backend in ("torch", "triton"):  # per token, +inf and 0 at one token each: those tokens alone NaN
        tau = torch.full(ids.shape, 0.8)
        tau[0, 1], tau[1, 2] = float("inf"), 0.0
        x = z.clone().requires_grad_()
        out = gtpo_loss(x, ids, adv, group_size=2, temperature=tau, config="grpo", backend=backend, validate=False)
        out.loss.backward()
        bad = tau != 0.8
        assert torch.isnan(out.logps[bad]).all() and torch.isfinite(out.logps[~bad]).all(), backend
        assert torch.isnan(out.entropy[bad]).all() and torch.isnan(x.grad[bad]).all(), backend
    # validating, a bad tau at a masked-out token is accepted: that token counts for nothing
    mask = torch.ones(ids.shape, dtype=torch.bool)
    mask[1, 2] = False
    for bad in (0.0, -1.0, float("nan")):
        tau = torch.full(ids.shape, 0.8)
        want = gtpo_loss(z, ids, adv, mask, group_size=2, temperature=tau, config="grpo", backend="torch")
        tau[1, 2] = bad
        got = gtpo_loss(z, ids, adv, mask, group_size=2, temperature=tau, config="grpo", backend="torch")
        assert torch.equal(got.loss, want.loss) and torch.equal(got.logps, want.logps), bad
    with pytest.raises(ValueError, match="temperature must be a number, a tensor per completion"):
        gtpo_loss(z, ids, adv, group_size=2, temperature=torch.ones(3), backend="torch")
    # a bad number from the call's `temperature=` is named as that argument, not as the config's field
    for call in (lambda: gtpo_loss(z, ids, adv, group_size=2, temperature=0.0, backend="torch"),
                 lambda: token_logprobs(z, ids, 0, backend="torch"),
                 lambda: linear_gtpo_loss(z, torch.eye(11), ids, adv, group_size=2, temperature=-1.0),
                 lambda: token_logprobs(z, ids, 1e-39, backend="triton"),  # (1 / tau overflows float32)
                 lambda: token_logprobs(z, ids, 1e39, backend="triton", top_k=3),  # (tau overflows float32)
                 lambda: gtpo_loss(z, ids, adv, group_size=2, temperature=1e39, backend="torch", top_p=0.9)):
        with pytest.raises(ValueError, match=r"^temperature \(the call's argument\) must be > 0, with temperature and "
                                             r"1 / temperature finite in float32, got (0|-1|1e-39|1e\+39)(\.0)?$"):
            call()
    with pytest.raises(ValueError, match="GTPOConfig.temperature must be > 0"):
        GTPOConfig(temperature=0.0)
    GTPOConfig(temperature=3e-39)  # (1 / tau finite in float32: taken)
    with pytest.raises(TypeError, match="temperature must be a number > 0 or a floating-point tensor"):
        gtpo_loss(z, ids, adv, group_size=2, temperature="hot", backend="torch")
    # a number overrides the config's
    a = gtpo_loss(z, ids, adv, group_size=2, temperature=0.6, config="grpo", backend="torch")
    b = gtpo_loss(z, ids, adv, group_size=2, config=GTPOConfig.preset("grpo", temperature=0.6), backend="torch")
    assert torch.equal(a.logps, b.logps) and torch.equal(a.loss, b.loss)


def test_a_zero_dim_temperature_is_one_value():
    """A 0-d tensor is one temperature (a schedule updated in place, as in the config), not a per-token one."""
    z, ids, adv = _small(9, 2, 4, 13)
    tau = torch.tensor(0.8)
    a = gtpo_loss(z, ids, adv, group_size=2, temperature=tau, config="grpo", backend="torch")
    b = gtpo_loss(z, ids, adv, group_size=2, temperature=0.8, config="grpo", backend="torch")
    assert torch.equal(a.logps, b.logps)
    lp_t, _ = token_logprobs(z, ids, tau, backend="torch")
    lp_n, _ = token_logprobs(z, ids, 0.8, backend="torch")
    assert torch.equal(lp_t, lp_n)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("schedule", ["fused", "recompute"])
@pytest.mark.parametrize("kind", ["B", "B1", "BT"])
def test_the_head_takes_a_per_token_temperature(backend, schedule, kind):
    """linear_gtpo_loss / linear_token_logprobs with tau per completion or per token = the float64
    reference on the materialized logits, each row divided by its own tau (gradients of hidden and weight
    through float64 autograd); tiles of 6 rows, so a tile holds rows of several temperatures."""
    from gtpo_kernels import linear_gtpo_loss, linear_token_logprobs
    gen = torch.Generator().manual_seed(7)
    B, T, D, V = 4, 5, 8, 37
    h = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    w = torch.randn(V, D, generator=gen, dtype=torch.float64) * 0.7
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.rand(B, T, generator=gen) > 0.2
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    tau = _tau(kind, B, T, gen).float()  # float32 values: the call's dtype for them
    tau64 = _per_token(tau.double(), B, T)
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    cfg = GTPOConfig.preset("gtpo", entropy_threshold=None)  # (the filter would drop every row at this V)
    r = ref.gtpo_loss((hr @ wr.t()) / tau64[..., None], ids, adv, mask, group_size=2, **cfg.__dict__)
    r["loss"].backward()
    assert hr.grad.abs().sum() > 0 and wr.grad.abs().sum() > 0
    hc, wc = h.float().requires_grad_(), w.float().requires_grad_()
    budget = 6 * 2 * V * 4  # 6 rows a tile: rows of two completions
    out = linear_gtpo_loss(hc, wc, ids, adv.float(), mask, group_size=2, config=cfg, temperature=tau,
                           memory_budget=budget, schedule=schedule, backend=backend)
    out.loss.backward()
    tol = TOL[torch.float32]
    assert_value_close("loss", out.loss, r["loss"], tol["loss"])
    assert_value_close("logps", out.logps, r["logps"], tol["value"], mask)
    assert_value_close("entropy", out.entropy, r["entropy"], tol["value"], mask)
    assert_grad_close("grad hidden", hc.grad, hr.grad, 1e-4)  # GEMMs over V (tests/test_linear.py)
    assert_grad_close("grad weight", wc.grad, wr.grad, 1e-4)
    lp, ent = linear_token_logprobs(hc.detach(), wc.detach(), ids, tau, mask, memory_budget=budget, backend=backend)
    assert_value_close("linear_token_logprobs", lp, r["logps"], tol["value"], mask)
    assert_value_close("linear_token_logprobs entropy", ent, r["entropy"], tol["value"], mask)


def test_the_head_takes_one_temperature_keyword():
    from gtpo_kernels import linear_gtpo_loss
    gen = torch.Generator().manual_seed(2)
    h, w = torch.randn(2, 3, 8, generator=gen), torch.randn(11, 8, generator=gen)
    ids, adv = torch.randint(0, 11, (2, 3), generator=gen), torch.randn(2, generator=gen)
    a = linear_gtpo_loss(h, w, ids, adv, group_size=2, config="grpo", temperature=0.7, backend="torch")
    b = linear_gtpo_loss(h, w, ids, adv, group_size=2, config=GTPOConfig.preset("grpo", temperature=0.7),
                         backend="torch")
    assert torch.equal(a.logps, b.logps)


def _huge_tau_rank(rank, world):
    """In a process with GTPO_VOCAB_BLOCK=64: V = 200 in 4 blocks, one row's first block all -inf (the row's
    start merges with an empty block), another row's second block all -inf and a third row's lanes -inf at
    every other entry (lanes that never see a finite entry)."""
    from gtpo_kernels.core import vocab_block
    assert vocab_block.VOCAB_BLOCK == 64
    gen = torch.Generator().manual_seed(5)
    B, T, V = 2, 3, 200
    z = torch.randn(B, T, V, generator=gen) * 3
    z[0, 0, :64] = float("-inf")
    z[0, 1, 64:128] = float("-inf")
    z[1, 2, ::2] = float("-inf")
    ids = torch.tensor([[70, 3, 130], [9, 150, 41]])
    adv = torch.tensor([1.0, -0.5])
    out = {}
    for backend in ("triton", "torch"):
        for tau in (0.7, 1e36, 1e37, 1e38, 3e38):
            for form in ("number", "tensor"):
                t = tau if form == "number" else torch.full((B,), tau)
                lp, ent = token_logprobs(z, ids, t, backend=backend)
                rlp, rent = ref.token_logprobs(z.double() / tau, ids, 1.0)
                out[f"{backend}/{tau:g}/{form}"] = (float((lp.double() - rlp).abs().max()),
                                             float((ent.double() - rent).abs().max()))
            x = z.clone().requires_grad_()
            o = gtpo_loss(x, ids, adv, group_size=2, config=GTPOConfig.preset("grpo", temperature=tau),
                          backend=backend)
            o.loss.backward()
            xr = z.double().requires_grad_()
            r = ref.gtpo_loss(xr, ids, adv, group_size=2, **dict(GTPOConfig.preset("grpo", temperature=tau).__dict__))
            r["loss"].backward()
            g, gr = x.grad.double(), torch.nan_to_num(xr.grad)  # (-inf entries: 0 on every backend)
            out[f"{backend}/{tau:g}/loss"] = (abs(float(o.loss) - float(r["loss"])) / max(abs(float(r["loss"])), 1e-30),
                                           float((g - gr).norm() / gr.norm()) if float(gr.norm()) > 0 else float("inf"))
    return out


def test_a_huge_temperature_gives_the_reference(monkeypatch):
    """tau up to FLT_MAX is valid (finite and > 0): the logits over it are all but uniform, and neither a lane
    nor a block that has not yet seen a finite entry may add mass (its start maximum is -FLT_MAX, within
    reach of a finite logit once divided by such a tau)."""
    from gloo import run_ranks_ok
    monkeypatch.setenv("GTPO_VOCAB_BLOCK", "64")
    res = run_ranks_ok(_huge_tau_rank, 1)[0]
    assert len(res) == 2 * 5 * 3, sorted(res)
    for key, (a, b) in res.items():  # logp, H (absolute); the loss, its gradient (relative): spec 7, float32
        assert a <= 1e-5 and b <= 1e-5, (key, a, b)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_temperature_whose_inverse_overflows_is_refused_or_nan(backend):
    """A float32 tau of 1e-39 is finite and > 0, but 1 / tau is inf: NaN at its tokens unvalidated (every
    other token as with tau 1), refused naming the temperature validating (not blamed on the logits)."""
    gen = torch.Generator().manual_seed(2)
    B, T, V = 3, 4, 19
    z = torch.randn(B, T, V, generator=gen)
    ids = torch.randint(0, V, (B, T), generator=gen)
    tau = torch.tensor([1.0, 1e-39, 1.0])
    lp, _ = token_logprobs(z, ids, tau, validate=False, backend=backend)
    assert torch.isnan(lp[1]).all() and not torch.isnan(lp[[0, 2]]).any()
    rlp, _ = ref.token_logprobs(z.double(), ids, 1.0)
    assert_value_close("logps", lp[[0, 2]], rlp[[0, 2]], 1e-5)
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        token_logprobs(z, ids, tau, backend=backend)
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        gtpo_loss(z, ids, torch.tensor([1.0, -1.0, 0.5]), group_size=3, temperature=tau, backend=backend)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_rules_with_a_temperature_per_completion(packed):
    """The sets rebuilt by top_k / top_p / min_p with a temperature per completion: the rules' kernel reads it
    at each token's completion (padded: its row; packed: found in cu_seqlens), where it was spread on the
    tokens first. token_logprobs against the float64 replay; gtpo_loss's log-probs, loss and gradient equal to
    the same temperature spread per token by hand (validated and not); the torch backend alike."""
    import gtpo_reference as ref
    gen = torch.Generator().manual_seed(13)
    B, T, V = 4, 5, 31
    z = torch.randn(B, T, V, generator=gen) * 3
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.rand(B, T, generator=gen) > 0.2
    mask[:, 0] = True
    adv = torch.randn(B, generator=gen)
    tau = torch.tensor([0.4, 1.3, 0.8, 2.0])
    rules = dict(top_k=7, top_p=0.85, min_p=0.02)
    rlp, rent = ref.replay_token_logprobs(z.double() / tau.double()[:, None, None], ids, mask, **rules)[:2]
    if packed:
        lengths = mask.sum(1)
        form = dict(cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
                    max_seqlen=int(lengths.max()))
        x, y, m, rlp, rent = z[mask], ids[mask], None, rlp[mask], rent[mask]
        per_token = tau.repeat_interleave(lengths)
    else:
        form, x, y, m, per_token = {}, z, ids, mask, tau[:, None].expand(B, T).contiguous()
    assert not torch.equal(rlp, ref.replay_token_logprobs(z.double(), ids, mask, **rules)[0][mask] if packed
                           else ref.replay_token_logprobs(z.double(), ids, mask, **rules)[0])  # (tau matters)
    for backend in ("triton", "torch"):
        for validate in (False, True):
            lp, ent = token_logprobs(x, y, tau, m, **rules, validate=validate, backend=backend, **form)
            assert_value_close("logps", lp, rlp, 1e-5)
            assert_value_close("entropy", ent, rent, 1e-5)
            outs = []
            for t in (tau, per_token):
                xx = x.clone().requires_grad_()
                out = gtpo_loss(xx, y, adv, m, group_size=2, temperature=t, config="gspo", **rules,
                                validate=validate, backend=backend, **form)
                out.loss.backward()
                outs.append((out.loss.detach(), out.logps.detach(), xx.grad))
            for a, b in zip(*outs):
                assert_value_close("per completion vs per token", a, b, 1e-6)
            assert_value_close("logps", outs[0][1], rlp, 1e-5)
            assert (outs[0][2] != 0).any()
