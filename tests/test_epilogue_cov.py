"""verl's clip_cov and kl_cov on the epilogue kernel (kernels/epilogue_cov.py: the kernel's keys, one sort,
the epilogue) against the float64 reference and the eager twin (objective/verl_modes.py): drawn calls with
test_epilogue's options (every aggregation, masks, packed, filter, conflict weights, rollout weights, the
top-entropy mask), a fixed case per term whose choice is neither empty nor everything, the same tokens chosen
as the eager path's (clip_cov's draws from the same generator state, kl_cov's ties by index), gtpo_loss_from_logps
and the LM head on the same path, and a batch with no counted token. Tolerances: spec 7 (float32: 1e-5)."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import test_epilogue as te
from bench.launches import counting
from conftest import assert_grad_close, assert_value_close, examples
from gtpo_kernels import GTPOConfig, gtpo_loss, gtpo_loss_from_logps, linear_gtpo_loss

COV = ["clip-cov", "kl-cov"]
# options whose choice is partial on the fixed case: clip_cov's bounds around part of the covariances
_FIXED = {"clip-cov": dict(clip_cov_lb=-0.3, clip_cov_ub=0.6, clip_cov_ratio=0.5),
          "kl-cov": dict(kl_cov_ratio=0.2, ppo_kl_coef=2.0)}


def _cfg(policy, **over):
    gen = dict(generator=torch.Generator().manual_seed(7)) if policy == "clip-cov" else {}
    return GTPOConfig.preset(policy, **{**dict(entropy_threshold=None, **_FIXED[policy], **gen), **over})


@pytest.mark.parametrize("policy", COV)
@settings(max_examples=examples(5), deadline=None)  # (test_verl_modes draws both terms on both backends too)
@given(data=st.data())
def test_cov_terms_match_reference_and_twin(policy, data):
    """The drawn calls of test_epilogue with clip_cov or kl_cov: at most 4 + 3 launches (the keys' launch,
    the sort, clip_cov's draw) and the other options' own, values, outputs, clip_frac and the gradient."""
    te._check(data.draw(te.calls(presets=[policy])))


def _fixed_case(cfg, packed, bound):
    """test_epilogue's fixed batch (4 x 5, V = 16, seed 3) under cfg: (run(cfg, backend) -> (out, grad), the
    Triton call's out and grad, the reference's, the mask, the advantages), the Triton call having launched the
    forward kernel, the epilogue twice and the backward kernel, at most `bound` launches, no host read."""
    c = dict(B=4, T=5, V=16, G=2, seed=3, cfg=cfg, filt="off", packed=packed, mask="bool", old=True, lam="given",
             items=None, tau=None)
    logits, ids, mask, adv, old, ref, tau = te._inputs(c)

    def run(cfg, backend):
        f64 = (lambda x: x.double()) if backend == "reference" else (lambda x: x)  # noqa: E731
        return te._call(dict(c, cfg=cfg), f64(logits), ids, mask, adv, f64(old), f64(ref), f64(tau), backend,
                        torch.ones(4, 5))
    out, grad, k = run(cfg, "triton")
    assert k.triton_names == {"_vocab_fwd_kernel": 1, "_epilogue_kernel": 2, "_vocab_bwd_kernel": 1}, k.triton_names
    assert k.launches <= bound and k.host_reads == 0, (k.launches, k.ops)
    ref_out, ref_grad, _ = run(cfg, "reference")
    return run, out, grad, ref_out, ref_grad, mask, adv


@pytest.mark.parametrize("policy", COV)
def test_cov_terms_on_a_fixed_case(policy):
    """A fixed case: the epilogue ran twice (keys, then the loss) in at most 7 launches, the choice is partial
    (clip_frac strictly between 0 and 1 for clip_cov; for kl_cov some tokens' loss moved by the penalty), and
    the outputs match the reference and the twin, with the same tokens chosen (the per-token loss)."""
    cfg = _cfg(policy)
    run, out, grad, ref_out, ref_grad, mask, adv = _fixed_case(cfg, packed=False, bound=7 - (policy == "kl-cov"))
    assert ref_grad.abs().sum() > 0 and te._cov_margin(cfg, ref_out, adv, mask) > 1e-3
    plain = run(cfg.replace(policy_loss="ppo") if policy == "clip-cov" else cfg.replace(ppo_kl_coef=0.0),
                "reference")[0]
    moved = ((ref_out.per_token_loss - plain.per_token_loss).abs() > 1e-9) & mask
    assert 0 < int(moved.sum()) < int(mask.sum()), moved  # the choice changed some tokens' terms, not all
    if policy == "clip-cov":
        assert 0 < float(ref_out.metrics["clip_frac"]) < 1, ref_out.metrics
    te._compare("fixed", out, grad, ref_out, ref_grad, mask)
    twin, twin_grad = run(cfg, "torch")[:2]
    te._compare("fixed vs torch", out, grad, twin, twin_grad.double(), mask)
    chosen = lambda o: ((o.per_token_loss - plain.per_token_loss).abs() > 1e-5) & mask  # noqa: E731
    assert torch.equal(chosen(out), chosen(twin))


@pytest.mark.parametrize("policy", COV)
def test_cov_terms_with_the_top_entropy_mask(policy):
    """With the top-entropy mask the key launch writes the entropies' sort keys too (no key kernel), sorted
    with clip_cov's or kl_cov's in their one sort (kl_cov's descending: read from the end): 7 and 6 launches,
    as without the mask, the outputs of the reference and the twin, and the mask masking some tokens."""
    cfg = _cfg(policy, top_entropy_quantile=0.5)
    run, out, grad, ref_out, ref_grad, mask, _ = _fixed_case(cfg, packed=True, bound=7 - (policy == "kl-cov"))
    plain = run(cfg.replace(top_entropy_quantile=1.0), "reference")[0]
    assert not torch.allclose(plain.per_token_loss, ref_out.per_token_loss)  # the mask changed some terms
    te._compare("top", out, grad, ref_out, ref_grad, mask)
    twin, twin_grad = run(cfg, "torch")[:2]
    te._compare("top vs torch", out, grad, twin, twin_grad.double(), mask)


def _logps_case(seed=3, B=4, T=5, V=16):
    logits, ids, mask, adv, old, ref, _ = te._inputs(dict(B=B, T=T, V=V, seed=seed))
    logp_all = torch.log_softmax(logits, -1)
    lp = logp_all.gather(-1, ids[..., None])[..., 0]
    H = -(logp_all.exp() * logp_all).sum(-1)
    return lp, H, ids, mask, adv, old, ref


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("policy", COV)
def test_cov_terms_from_logps_match_the_twin(policy, packed):
    """gtpo_loss_from_logps takes the same path (the prep kernel, the epilogue twice, the scale kernel):
    against the eager twin with entropies, old and ref log-probs and lam: values, outputs, clip_frac and the
    gradients w.r.t. the log-probs and entropies."""
    te.from_logps_vs_twin(lambda: _cfg(policy, beta=0.04, entropy_coef=0.01), packed, 3,
                          {"_prep_kernel": 1, "_epilogue_kernel": 2, "_scale_kernel": 1})


def test_kl_cov_ties_go_by_index_and_clip_cov_draws_as_eager():
    """Equal covariances (one logp for every token, so that every covariance is 0): kl_cov chooses the first
    k counted tokens in token order, as the eager path's stable sort; clip_cov's draws from one generator
    state choose the same tokens on both paths, and other states choose others."""
    B, T = 4, 5
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.rand(B, T, generator=torch.Generator().manual_seed(2)) > 0.3
    adv = torch.randn(B, generator=torch.Generator().manual_seed(4))
    lp = torch.full((B, T), -1.5)
    old = lp - 0.1  # r = e^0.1 for every token: inside the PPO clip (clip_cov candidates)
    res = {}
    for backend in ("triton", "torch"):
        out = gtpo_loss_from_logps(lp, ids, adv, mask, old_logps=old, backend=backend, validate=False,
                                   config=GTPOConfig.preset("kl-cov", kl_cov_ratio=0.4, ppo_kl_coef=1.0))
        res[backend] = ((out.per_token_loss - (-adv[:, None] * torch.exp(lp - old))).abs() > 1e-3) & mask
    k = max(1, int(0.4 * int(mask.sum())))
    first = torch.zeros(B * T, dtype=torch.bool)
    first[mask.reshape(-1).nonzero()[:k, 0]] = True
    assert torch.equal(res["triton"], first.reshape(B, T)) and torch.equal(res["torch"], first.reshape(B, T))

    def chosen(backend, seed):
        cfg = GTPOConfig.preset("clip-cov", clip_cov_ratio=0.3, clip_cov_lb=-1.0, clip_cov_ub=1.0,
                                generator=torch.Generator().manual_seed(seed))
        out = gtpo_loss_from_logps(lp, ids, adv, mask, old_logps=old, backend=backend, validate=False, config=cfg)
        return (out.per_token_loss == 0) & mask

    for seed in (0, 1, 2):
        assert torch.equal(chosen("triton", seed), chosen("torch", seed)), seed
        assert int(chosen("triton", seed).sum()) == max(1, int(0.3 * int(mask.sum())))
    assert not torch.equal(chosen("triton", 0), chosen("triton", 1))


@pytest.mark.parametrize("policy", COV)
def test_cov_terms_in_the_lm_head_and_with_no_counted_token(policy):
    """linear_gtpo_loss (the recompute schedule: the choice spans the batch) runs the same two launches of the
    epilogue and equals its eager twin; a batch with no counted token gives the eager path's outputs."""
    g = torch.Generator().manual_seed(5)
    B, T, D, V = 4, 5, 6, 16
    h, w = torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g)
    ids, adv = torch.randint(0, V, (B, T), generator=g), torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    old = torch.log_softmax(h @ w.t(), -1).gather(-1, ids[..., None])[..., 0] + 0.2 * torch.randn(B, T, generator=g)
    res = {}
    for backend in ("triton", "torch"):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with counting() as k:
            out = linear_gtpo_loss(hh, ww, ids, adv, mask, old_logps=old, config=_cfg(policy), backend=backend,
                                   validate=False)
            out.loss.backward()
        res[backend] = (out, hh.grad, ww.grad, k)
    (o, gh, gw, k), (t, th, tw, _) = res["triton"], res["torch"]
    assert k.triton_names.get("_epilogue_kernel") == 2, k.triton_names
    assert th.abs().sum() > 0
    assert_value_close("head loss", o.loss, t.loss, te.TOL)
    assert_value_close("head per_token_loss", o.per_token_loss, t.per_token_loss, te.TOL, where=mask)
    assert_grad_close("grad hidden", gh, th.double(), te.TOL)
    assert_grad_close("grad weight", gw, tw.double(), te.TOL)
    lp, H, ids, _, adv, old, _ = _logps_case()
    none = torch.zeros_like(mask)
    outs = [gtpo_loss_from_logps(lp, ids, adv, none, entropy=H, old_logps=old, backend=b, validate=False,
                                 config=_cfg(policy)) for b in ("triton", "torch")]
    assert torch.equal(outs[0].loss, outs[1].loss) and float(outs[0].loss) == 0.0
    assert torch.equal(outs[0].per_token_loss, outs[1].per_token_loss)


def _tie_case():
    """Equal covariances: one logp for every token (each covariance 0, of either sign), r = e^0.1 (inside
    the PPO clip)."""
    B, T = 4, 5
    mask = torch.rand(B, T, generator=torch.Generator().manual_seed(2)) > 0.3
    adv = torch.randn(B, generator=torch.Generator().manual_seed(4))
    lp = torch.full((B, T), -1.5)
    return lp, lp - 0.1, torch.zeros(B, T, dtype=torch.long), adv, mask


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cov_bounds_are_strict_and_at_least_one_token_is_chosen(backend):
    """Covariances of exactly 0: clip_cov_lb = 0 or clip_cov_ub = 0 leaves no candidate (the bounds are
    strict); a ratio whose floor(ratio M) is 0 still chooses one token (kl_cov: the first counted one)."""
    lp, old, ids, adv, mask = _tie_case()

    def loss(**over):
        cfg = GTPOConfig.preset(over.pop("preset"), **over)
        return gtpo_loss_from_logps(lp, ids, adv, mask, old_logps=old, backend=backend, validate=False,
                                    config=cfg).per_token_loss
    for lb, ub in ((0.0, 1.0), (-1.0, 0.0)):
        assert not ((loss(preset="clip-cov", clip_cov_ratio=1.0, clip_cov_lb=lb, clip_cov_ub=ub) == 0) & mask).any()
    assert int(((loss(preset="clip-cov", clip_cov_ratio=1e-4, clip_cov_lb=-1.0, clip_cov_ub=1.0) == 0) &
                mask).sum()) == 1
    moved = ((loss(preset="kl-cov", kl_cov_ratio=1e-4, ppo_kl_coef=1.0) - loss(preset="kl-cov", ppo_kl_coef=0.0))
             .abs() > 1e-3) & mask
    first = torch.zeros(mask.numel(), dtype=torch.bool)
    first[mask.reshape(-1).nonzero()[0, 0]] = True
    assert torch.equal(moved.reshape(-1), first)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_clip_cov_chooses_off_the_clip_and_reports_the_dual_clip(backend):
    """clip_cov with ratio 1 chooses every candidate: the counted tokens off the PPO clip whose covariance lies
    in (clip_cov_lb, clip_cov_ub) (their term 0); the others keep the PPO term (the dual clip's cap included),
    and clip_frac counts the chosen tokens and those the dual clip capped: against the float64 formula."""
    g = torch.Generator().manual_seed(6)
    B, T = 4, 6
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = lp + 0.8 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.2
    lb, ub = -0.3, 0.4
    cfg = GTPOConfig.preset("clip-cov", clip_cov_ratio=1.0, clip_cov_lb=lb, clip_cov_ub=ub, dual_clip_c=1.5,
                            loss_agg="token-mean")
    out = gtpo_loss_from_logps(lp.float(), torch.zeros(B, T, dtype=torch.long), adv.float(), mask,
                               old_logps=old.float(), backend=backend, validate=False, config=cfg)
    r, A = torch.exp(lp - old), adv[:, None].expand(B, T)
    u1, u2 = r * A, r.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * A
    on_clip = u1 > u2
    pg = -torch.minimum(u1, u2)
    dual = (A < 0) & (pg > -A * 1.5)
    pg = torch.where(dual, -A * 1.5, pg)
    cov = (A - A[mask].mean()) * (lp - lp[mask].mean())
    assert float(torch.minimum((cov - lb).abs(), (cov - ub).abs())[mask].min()) > 1e-4
    chosen = mask & ~on_clip & (cov > lb) & (cov < ub)
    for some in (chosen, mask & on_clip, mask & ~on_clip & ~chosen, mask & dual & ~chosen):
        assert some.any(), (chosen, on_clip, dual)
    want = torch.where(chosen | ~mask, 0.0, pg)
    assert_value_close("per_token_loss", out.per_token_loss, want, te.TOL)
    clip_frac = (((chosen & (A != 0)) | dual) & mask).sum() / mask.sum()
    assert_value_close("clip_frac", out.metrics["clip_frac"], clip_frac, te.TOL)


@pytest.mark.parametrize("policy", COV)
def test_one_advantage_for_every_token_chooses_alike(policy):
    """One completion, or one advantage for every completion: A - mean A is the means' rounding alone, and
    its sign orders the covariances; both backends sum in float64 and round alike, so they choose the same
    tokens (the float32 sum of the eager path chose others)."""
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        B, T = (1, 6) if seed % 2 else (6, 3)
        lp = -torch.rand(B, T, generator=g) * 3
        old = lp + 0.05 * torch.randn(B, T, generator=g)
        adv = torch.full((B,), 0.1) if B > 1 else torch.randn(B, generator=g)
        ids = torch.zeros(B, T, dtype=torch.long)
        over = dict(clip_cov_lb=-1.0, clip_cov_ub=1.0, clip_cov_ratio=0.4) if policy == "clip-cov" else \
            dict(kl_cov_ratio=0.4, ppo_kl_coef=1.0)
        outs = [gtpo_loss_from_logps(lp, ids, adv, old_logps=old, backend=be, validate=False,
                                     config=_cfg(policy, **over)).per_token_loss for be in ("triton", "torch")]
        assert_value_close(f"per_token_loss, seed {seed}", outs[0], outs[1], te.TOL)  # a choice moves >= 0.01


def test_clip_cov_keeps_a_chosen_nan():
    """A NaN old log-prob (unvalidated) at a token clip_cov chooses stays NaN, as verl's pg * corr and the
    float64 oracle give (a choice is a product by 0, not a 0 written over the term)."""
    g = torch.Generator().manual_seed(1)
    B, T, V = 2, 3, 8
    logits, ids = torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T), generator=g)
    adv = torch.tensor([1.0, -1.0])
    old = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0] - 0.05
    old[0, 1] = float("nan")
    for be in ("triton", "torch", "reference"):
        x = logits.double() if be == "reference" else logits
        cfg = GTPOConfig.preset("clip-cov", clip_cov_ratio=1.0, clip_cov_lb=-100.0, clip_cov_ub=100.0,
                                generator=torch.Generator().manual_seed(0))
        out = gtpo_loss(x, ids, adv, old_logps=old.to(x.dtype), backend=be, validate=False, config=cfg)
        assert torch.isnan(out.per_token_loss[0, 1]) and torch.isnan(out.loss), (be, out.per_token_loss)
        assert torch.isfinite(out.per_token_loss[1]).all(), (be, out.per_token_loss)


@pytest.mark.parametrize("ratio", [0.4, 1.5])
def test_the_reference_kl_cov_breaks_ties_by_position(ratio):
    """The float64 oracle chooses kl_cov's tokens as the kernel does: ties by token position (every
    covariance 0: uniform logits), and a ratio past 1 chooses every counted token (torch.topk broke ties
    otherwise and refused k past the count)."""
    _, _, ids, adv, mask = _tie_case()
    V = 8
    logits = torch.zeros(*ids.shape, V)
    old = torch.full(ids.shape, -math.log(V) - 0.1)
    out = {be: gtpo_loss(logits.double() if be == "reference" else logits, ids, adv, mask,
                         old_logps=(old.double() if be == "reference" else old), backend=be, validate=False,
                         config=GTPOConfig.preset("kl-cov", kl_cov_ratio=ratio, ppo_kl_coef=1.0)).per_token_loss
           for be in ("reference", "triton")}
    assert_value_close("per_token_loss", out["triton"], out["reference"], te.TOL)


@pytest.mark.parametrize("entry", ["logits", "logps"])
def test_a_failed_validation_leaves_clip_cov_generator_as_the_eager_path(entry):
    """Validating, the kernel checks the inputs after clip_cov drew its uniforms; when a check fails the
    generator's state is put back, as the eager path (which checks first) leaves it: the same error, and
    the next call chooses the same tokens on both backends."""
    g = torch.Generator().manual_seed(0)
    B, T, V = 2, 3, 8
    logits, ids = torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T), generator=g)
    adv = torch.tensor([1.0, -1.0])
    lp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    bad = lp.clone()
    bad[0, 0] = float("nan")
    states = {}
    for be in ("triton", "torch"):
        gen = torch.Generator().manual_seed(42)
        cfg = GTPOConfig.preset("clip-cov", clip_cov_lb=-100.0, clip_cov_ub=100.0, clip_cov_ratio=0.5,
                                generator=gen)
        call = (lambda o: gtpo_loss(logits, ids, adv, old_logps=o, config=cfg, backend=be)) if entry == "logits" \
            else (lambda o: gtpo_loss_from_logps(lp, ids, adv, old_logps=o, config=cfg, backend=be))
        with pytest.raises(ValueError, match="old_logps must be finite"):
            call(bad)
        states[be] = (gen.get_state(), call(lp - 0.01).per_token_loss)
    assert torch.equal(states["triton"][0], torch.Generator().manual_seed(42).get_state())
    assert torch.equal(states["triton"][0], states["torch"][0])
    assert_value_close("next call", states["triton"][1], states["torch"][1], te.TOL)
