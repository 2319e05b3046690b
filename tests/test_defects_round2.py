"""Silent wrong answers, round 2, on one process: each test compares with a float64 (or mpmath) evaluation
on fresh random inputs, or checks that unvalidated invalid input gives NaN (spec 6, 7)."""
import math

import pytest
import torch
from conftest import TOL, assert_grad_close

import gtpo_reference as ref
from gtpo_kernels import (GTPOConfig, conflict_weights, gtpo_loss, gtpo_loss_from_logps, linear_gtpo_loss,
                          token_logprobs)

pytestmark = pytest.mark.filterwarnings(  # random batches here may sit above the entropy threshold (tested apart)
    "ignore:gtpo_loss. the entropy filter dropped every completion:UserWarning")

F64 = torch.float64


# ---------------------------------------------------------------- the soft-cap's chain rule where it saturates
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_softcap_gradient_where_every_entry_saturates(backend):
    """float32 head, logit_softcap = 1 and every logit z in [10, 15]: tanh(z) rounds to 1 in float32, so
    dz'/dz = 1 - tanh^2 must come from exp(-2|z|), not from the rounded tanh. Gradients of hidden and
    weight against float64 on the tile's own float32 GEMM output, with the cap's derivative formed
    exactly (4 e / (1 + e)^2, e = exp(-2 z)) and the loss's gradient from gtpo_reference."""
    g = torch.Generator().manual_seed(11)
    B, T, V, D = 2, 3, 7, 2
    h = (2.5 + 0.5 * torch.rand(B, T, D, generator=g)).requires_grad_()
    w = (2.0 + 0.5 * torch.rand(V, D, generator=g)).requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.tensor([1.0, -0.7])
    old = -torch.rand(B, T, generator=g) - 1.5
    cfg = GTPOConfig.preset("grpo")
    out = linear_gtpo_loss(h, w, ids, adv, config=cfg, old_logps=old, logit_softcap=1.0, backend=backend)
    out.loss.backward()
    z = (h.detach() @ w.detach().T).double()  # the tile's GEMM output, float32, then float64
    assert z.min() > 9.5  # every entry saturates in float32
    zc = torch.tanh(z).requires_grad_()
    r = ref.gtpo_loss(zc, ids, adv, old_logps=old.double(), **cfg.__dict__)
    r["loss"].backward()
    e = torch.exp(-2.0 * z.abs())
    G = zc.grad * 4.0 * e / (1.0 + e) ** 2  # d loss / d z, exact where tanh(z) rounds to 1
    assert G.abs().max() > 0
    assert_grad_close("grad hidden", h.grad, G @ w.detach().double(), TOL[torch.float32]["grad"])
    assert_grad_close("grad weight", w.grad, torch.einsum("btv,btd->vd", G, h.detach().double()),
                      TOL[torch.float32]["grad"])


# ---------------------------------------------------------------- lam, n_conf and num_items_in_batch
def _small(seed=0, B=4, T=3, V=6):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T), generator=g),
            torch.randn(B, generator=g))


def _entry_points(x, ids, adv, **kw):
    """The loss from logits, from log-probs and from the head, on related random inputs."""
    B, T, V = x.shape
    lp = torch.log_softmax(x, -1).gather(-1, ids[..., None])[..., 0]
    ent = -(torch.softmax(x, -1) * torch.log_softmax(x, -1)).sum(-1)
    h, w = x[..., :3].contiguous(), torch.randn(V, 3, generator=torch.Generator().manual_seed(1))
    return {"logits": lambda: gtpo_loss(x, ids, adv, backend="torch", **kw),
            "logps": lambda: gtpo_loss_from_logps(lp, ids, adv, entropy=ent, **kw),
            "head": lambda: linear_gtpo_loss(h, w, ids, adv, backend="torch", **kw)}


@pytest.mark.parametrize("name", ["logits", "logps", "head"])
@pytest.mark.parametrize("bad", ["n_conf inf", "n_conf nan", "n_conf 0", "n_conf 0.5", "lam nan", "lam inf"])
def test_lam_and_n_conf_refused_or_nan(name, bad):
    """Validating, an n_conf that is not finite and >= 1, or a non-finite lam at a counted token, is refused
    naming it (n_conf = +inf gave a finite wrong loss); unvalidated, the loss is NaN."""
    x, ids, adv = _small()
    lam, n_conf = torch.ones(4, 3), torch.full((4,), 2.0)
    what, value = bad.split()
    (n_conf if what == "n_conf" else lam)[1] = float(value)
    kw = dict(lam=lam, n_conf=n_conf, config=GTPOConfig(loss_agg="gtpo-official"))
    with pytest.raises(ValueError, match=what):
        _entry_points(x, ids, adv, **kw)[name]()
    out = _entry_points(x, ids, adv, validate=False, **kw)[name]()
    assert torch.isnan(out.loss)


@pytest.mark.parametrize("dtype, value, ok", [(torch.float32, 1e-50, False), (torch.float32, 1e39, False),
                                              (torch.float64, 1e-50, True), (torch.float32, 3.5, True)])
def test_num_items_finite_and_positive_in_the_loss_dtype(dtype, value, ok):
    """num_items_in_batch = 1e-50 is > 0 but 0 in float32 (an infinite loss), 1e39 is inf there."""
    x, ids, adv = _small()
    call = _entry_points(x.to(dtype), ids, adv, num_items_in_batch=value, config=GTPOConfig(loss_agg="token-mean"),
                         group_size=2)["logits"]
    if ok:
        assert torch.isfinite(call().loss)
    else:
        with pytest.raises(ValueError, match="num_items_in_batch must be finite and > 0 in the loss's dtype"):
            call()


# ---------------------------------------------------------------- a non-finite advantage the filter drops
@pytest.mark.parametrize("name", ["logits", "logps", "head"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_advantage_on_a_dropped_completion_gives_nan(name, value):
    """validate=False, entropy filter on and dropping every completion (flat logits): a NaN or inf
    advantage still makes the loss and the gradient NaN (torch.where(kept, A, 0) used to hide it)."""
    x, ids, adv = _small()
    x = (x * 0.01).requires_grad_()  # entropy ~ log 6 > the threshold: every completion is dropped
    adv[2] = value
    cfg = GTPOConfig(entropy_threshold=0.5, use_conflict_mask=False, entropy_coef=0.01)
    out = _entry_points(x, ids, adv, config=cfg, validate=False)[name]()
    assert float(out.metrics["filtered_frac"]) == 1.0
    assert torch.isnan(out.loss)
    out.loss.backward()
    assert not torch.isfinite(x.grad).all()


# ---------------------------------------------------------------- malformed cu_seqlens, unvalidated
def test_malformed_cu_seqlens_from_logps_every_output_and_gradient_nan():
    """gtpo_loss_from_logps with an entropy bonus and a decreasing cu_seqlens, validate=False: the loss,
    every per-token output and the gradients of logps AND entropy are NaN (d/d entropy was finite)."""
    g = torch.Generator().manual_seed(2)
    N = 7
    lp = (-torch.rand(N, generator=g) - 0.1).requires_grad_()
    ent = torch.rand(N, generator=g).requires_grad_()
    ids = torch.randint(0, 9, (N,), generator=g)
    cfg = GTPOConfig(entropy_coef=0.1, entropy_threshold=None, use_conflict_mask=False)
    out = gtpo_loss_from_logps(lp, ids, torch.tensor([1.0, -1.0, 0.5]), entropy=ent, config=cfg,
                               cu_seqlens=torch.tensor([0, 5, 3, 7]), validate=False)
    out.loss.backward()
    for k in ("logps", "entropy", "per_token_loss", "seq_entropy"):
        assert torch.isnan(getattr(out, k)).all(), k
    assert torch.isnan(out.loss) and torch.isnan(lp.grad).all() and torch.isnan(ent.grad).all()


@pytest.mark.parametrize("entry", ["logits", "head", "reference"])
def test_malformed_cu_seqlens_every_metric_nan(entry):
    """validate=False, a malformed cu_seqlens: every metric NaN (no completion is known), the kept sets' metrics
    too (sets rebuilt by top_k, or recorded), on both backends, the LM head and the reference backend (they
    were finite numbers, and a different one on each path: mean_kept_size 5.78 on Triton, 5.89 on torch)."""
    from gtpo_kernels import linear_gtpo_loss
    from gtpo_reference import gtpo_sampling as rs
    g = torch.Generator().manual_seed(3)
    N, V = 9, 37
    x = torch.randn(N, V, generator=g)
    ids = torch.randint(0, V, (N,), generator=g)
    h, w = torch.randn(N, 6, generator=g), torch.randn(V, 6, generator=g)
    adv, cu = torch.tensor([1.0, -1.0, 0.5]), torch.tensor([0, 5, 3, 9])
    _, _, _, sm = rs.replay_token_logprobs(x.double()[None], ids[None], torch.ones(1, N, dtype=torch.bool), top_k=5)
    kw = dict(cu_seqlens=cu, max_seqlen=5, validate=False, config="grpo")
    for backend in (["reference"] if entry == "reference" else ["triton", "torch"]):
        for sets in ({}, dict(top_k=5), dict(sampling_mask=sm)):
            if entry == "head":
                out = linear_gtpo_loss(h, w, ids, adv, backend=backend, **kw, **sets)
            else:
                out = gtpo_loss(x.double() if backend == "reference" else x, ids, adv, backend=backend, **kw, **sets)
            assert torch.isnan(out.loss), (backend, sets)
            data = {k: v for k, v in out.metrics.items() if k != "grad_in_forward"}  # (the schedule's: a fact)
            assert all(bool(torch.isnan(v)) for v in data.values()), (backend, list(sets), out.metrics)


def test_malformed_cu_seqlens_conflict_weights_all_nan():
    """conflict_weights, validate=False, cu_seqlens [0, 3, 2, 5]: completion 1 is empty in the stand-in
    layout and got n_conf = 1; every weight and count is NaN."""
    ids = torch.tensor([3, 4, 5, 3, 4])
    lam, n_conf = conflict_weights(ids, None, torch.tensor([1.0, 1.0, -1.0]), 3,
                                   cu_seqlens=torch.tensor([0, 3, 2, 5]), validate=False)
    assert torch.isnan(lam).all() and torch.isnan(n_conf).all()


# ---------------------------------------------------------------- compile with the top-entropy quantile
@pytest.mark.parametrize("name", ["logits", "head"])
def test_compile_fullgraph_with_top_entropy_quantile(name):
    """torch.compile(fullgraph=True) traces top_entropy_quantile < 1 (its data-dependent index failed
    to trace) and gives eager's loss and gradient."""
    torch._dynamo.reset()
    x, ids, adv = _small(3)
    w = torch.randn(6, 3, generator=torch.Generator().manual_seed(4))
    cfg = GTPOConfig(top_entropy_quantile=0.5, entropy_coef=0.01)

    def step(x):
        if name == "logits":
            return gtpo_loss(x, ids, adv, group_size=2, config=cfg, backend="torch").loss
        return linear_gtpo_loss(x[..., :3], w, ids, adv, group_size=2, config=cfg).loss
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    le = step(xe)
    le.backward()
    lc = torch.compile(step, fullgraph=True, backend="aot_eager")(xc)
    lc.backward()
    assert xe.grad.abs().sum() > 0
    assert abs(float(lc.detach()) - float(le.detach())) <= 1e-6 and torch.allclose(xc.grad, xe.grad, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------- the agreement compares options by value
def test_fingerprint_compares_options_by_value():
    """1, 1.0 and tensor(1.0) are one value; -0.0 is 0.0; every NaN one NaN; a config counts by every
    field (eps_high, clip); an object's address (a torch.Generator) does not count."""
    from gtpo_kernels.distributed.digest import fingerprint

    def fp(*options):
        return int(fingerprint(options))
    one = fp("torch", GTPOConfig(temperature=1))
    assert one == fp("torch", GTPOConfig(temperature=1.0)) == fp("torch", GTPOConfig(temperature=torch.tensor(1.0)))
    assert fp(0.5) == fp(torch.tensor(0.5)) == fp(torch.tensor(0.5, dtype=F64)) and fp(-0.0) == fp(0.0)
    assert fp(float("nan")) == fp(torch.tensor(float("nan")))
    assert one != fp("torch", GTPOConfig(temperature=0.9)) and one != fp("triton", GTPOConfig())
    assert one != fp("torch", GTPOConfig(eps_high=0.28)) and one != fp("torch", GTPOConfig(clip=False))
    assert fp(torch.Generator()) == fp(torch.Generator()) and fp(True) != fp(1)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_lying_max_seqlen_makes_the_group_of_a_cut_completion_nan(backend):
    """Packed, validate=False, max_seqlen = 1 while two completions of the group hold 2 tokens: their
    tokens past max_seqlen cannot take part in the runs, so the third completion's weights would miss the
    suffix it shares with them (reference: lam 2 for its token; found by the joint generator as a finite
    1). Every weight of that group is NaN; another group, uncut, keeps the reference's weights."""
    import gtpo_reference as ref
    from gtpo_kernels import conflict_weights
    ids = torch.tensor([0, 2, 2, 1, 2, 5, 6, 6])  # group 0: [0, 2], [2], [1, 2]; group 1: [5], [6], [6]
    cu = torch.tensor([0, 2, 3, 5, 6, 7, 8])
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0, -1.0, 1.0])
    lam, n_conf = conflict_weights(ids, None, adv, 3, cu_seqlens=cu, max_seqlen=1, validate=False, backend=backend)
    assert torch.isnan(lam[:5]).all() and torch.isnan(n_conf[:3]).all()
    padded = torch.tensor([[0, 2], [2, -100], [1, 2], [5, -100], [6, -100], [6, -100]])
    m = padded != -100
    rl, rn = ref.conflict_weights(padded, m, adv, 3, 2.0, 0.0)
    assert torch.equal(lam[5:], rl[3:][m[3:]].float()) and torch.equal(n_conf[3:], rn[3:].float())
    assert float(rl[1, 0]) == 2.0  # the weight the cut layout missed
