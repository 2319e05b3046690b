"""Defects of the third trust round (issue: the sampler's rules and the head's replay), each pinned by a test
that failed before its fix: float64 rule tensors compared in float64 (spec 13), kept_mass without a
gradient."""
import math

import pytest
import torch

from gtpo_kernels import gtpo_loss, token_logprobs


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_float64_top_p_tensor_is_compared_in_float64(backend):
    """top_p given as a float64 tensor on float64 logits keeps the set the same number given as a Python
    float keeps, also with a cut 1e-8 from the boundary (it was rounded to float32 first: another set)."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    logits = torch.log(p).reshape(1, 1, 3).repeat(2, 2, 1)
    ids = torch.zeros(2, 2, dtype=torch.long)
    top_p = 0.8 - 1e-8  # 1 - top_p just above 0.2: the 0.2 token removed (float32 rounds top_p up to 0.8000000119)
    as_number, _ = token_logprobs(logits, ids, 1.0, top_p=top_p, backend=backend)
    as_tensor, _ = token_logprobs(logits, ids, 1.0, top_p=torch.full((2,), top_p, dtype=torch.float64),
                                  backend=backend)
    assert torch.allclose(as_number, torch.full((2, 2), math.log(0.5 / 0.8), dtype=torch.float64), atol=1e-12), as_number
    assert torch.equal(as_tensor, as_number), (as_tensor, as_number)


def test_kept_mass_has_no_gradient():
    """metrics['kept_mass'] is detached like every other metric (it required grad with rebuilt sets)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 3, 12, generator=g, requires_grad=True)
    ids = torch.randint(0, 12, (4, 3), generator=g)
    out = gtpo_loss(logits, ids, torch.randn(4, generator=g), group_size=2, config="grpo", top_k=4, top_p=0.9,
                    backend="torch")
    assert not out.metrics["kept_mass"].requires_grad
    assert 0 < float(out.metrics["kept_mass"]) <= 1


def _head_case(seed=1, B=3, T=4, D=8, V=20):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, B, D, generator=g).transpose(0, 1)  # dense, permuted strides
    weight = torch.randn(V, D, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    sets, offsets = [], [0]
    for y in ids.reshape(-1).tolist():  # every token counted: the sampled id and 4 others
        s = sorted(set([y] + torch.randint(0, V, (4,), generator=g).tolist()))
        sets += s
        offsets.append(len(sets))
    mask = (torch.tensor(sets), torch.tensor(offsets))
    return hidden, weight, ids, torch.randn(B, generator=g), mask


def test_head_replay_takes_permuted_hidden():
    """linear_gtpo_loss with sampling_mask and a dense but permuted hidden: backward ran into 'view size is
    not compatible' (the gradient buffer kept hidden's strides); now its gradients equal the reference's."""
    from conftest import assert_grad_close
    from gtpo_kernels import linear_gtpo_loss
    hidden, weight, ids, adv, mask = _head_case()
    grads = {}
    for backend in ("torch", "reference"):
        h = hidden.double().clone().requires_grad_() if backend == "reference" else hidden.clone().requires_grad_()
        w = weight.double().clone().requires_grad_() if backend == "reference" else weight.clone().requires_grad_()
        out = linear_gtpo_loss(h, w, ids, adv, group_size=3, config="grpo", sampling_mask=mask, backend=backend)
        out.loss.backward()
        grads[backend] = (h.grad, w.grad)
    assert grads["reference"][0].abs().sum() > 0
    assert_grad_close("dh", grads["torch"][0], grads["reference"][0], 1e-5)
    assert_grad_close("dw", grads["torch"][1], grads["reference"][1], 1e-5)


def test_head_replay_kept_id_out_of_range_gives_nan():
    """validate=False, a kept id outside [0, V): that token's log-prob is NaN (spec 13), the others are
    finite; it raised 'IndexError: index out of range in self' (the weight's rows gathered by the union)."""
    from gtpo_kernels import linear_gtpo_loss, linear_token_logprobs
    hidden, weight, ids, adv, (token_ids, offsets) = _head_case()
    token_ids = token_ids.clone()
    token_ids[int(offsets[2])] = weight.shape[0] + 5  # token 2's set
    lp, _ = linear_token_logprobs(hidden, weight, ids, sampling_mask=(token_ids, offsets), validate=False,
                                  backend="torch")
    flat = lp.reshape(-1)
    assert torch.isnan(flat[2]) and torch.isfinite(flat[torch.arange(flat.numel()) != 2]).all(), flat
    out = linear_gtpo_loss(hidden, weight, ids, adv, group_size=3, config="grpo", sampling_mask=(token_ids, offsets),
                           validate=False, backend="torch")
    assert torch.isnan(out.loss) and torch.isnan(out.logps.reshape(-1)[2])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compiled_step_takes_a_preset_name(backend):
    """torch.compile(fullgraph=True) of a step passing config='grpo' (a preset name) traces (it failed in
    dynamo on GTPOConfig.preset's dataclass fields) and equals the eager call."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 10, generator=g, requires_grad=True)
    ids = torch.randint(0, 10, (4, 3), generator=g)
    adv = torch.randn(4, generator=g)

    def step(x, ids, adv):
        return gtpo_loss(x, ids, adv, group_size=2, config="grpo", backend=backend, validate=False).loss
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)(x, ids, adv)
    torch.testing.assert_close(compiled, step(x, ids, adv))


def _replay_case(seed=3, B=4, T=3, V=12):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    return logits, ids, torch.randn(B, generator=g)


def test_invalid_per_token_rule_unvalidated_gives_nan():
    """top_k as a per-token tensor with -2 at one token, validate=False: that token's log-prob is NaN (spec 13:
    never a finite wrong number), the others equal the reference's."""
    logits, ids, _ = _replay_case()
    k = torch.full(ids.shape, 4)
    k[1, 2] = -2
    lp, _ = token_logprobs(logits, ids, 1.0, top_k=k, validate=False, backend="torch")
    assert torch.isnan(lp[1, 2]), lp
    ok = torch.ones_like(ids, dtype=torch.bool)
    ok[1, 2] = False
    ref, _ = token_logprobs(logits.double(), ids, 1.0, top_k=torch.where(ok, k, 4), backend="reference")
    torch.testing.assert_close(lp[ok].double(), ref[ok], atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_replay_metrics_equal_the_reference(backend):
    """The logits path's replay metrics against the reference's, with tokens whose sampled id the rules leave
    out (top_k = 1 on random ids: restored): replay_restored_frac, mean_kept_size, kept_mass."""
    from gtpo_reference import gtpo_sampling
    logits, ids, adv = _replay_case()
    out = gtpo_loss(logits, ids, adv, backend=backend, group_size=2, config="grpo", top_k=1, top_p=0.9)
    rows = logits.reshape(-1, logits.shape[-1]).double()
    token_ids, offsets, restored = gtpo_sampling.kept_sets(rows, 1.0, top_k=1, top_p=0.9, targets=ids.reshape(-1))
    ref = gtpo_sampling.sampling_metrics(rows, (token_ids, offsets), 1.0, restored)
    assert float(ref["replay_restored_frac"]) > 0
    for k in ("replay_restored_frac", "mean_kept_size", "kept_mass"):
        torch.testing.assert_close(out.metrics[k].double(), ref[k], atol=1e-6, rtol=0, msg=k)


def test_all_masked_batch_with_kept_sets_has_zero_metrics():
    """No counted token, kept sets on: the replay metrics are 0, not NaN (the token count is at least 1)."""
    logits, ids, adv = _replay_case()
    out = gtpo_loss(logits, ids, adv, torch.zeros(ids.shape, dtype=torch.bool), group_size=2, config="grpo",
                    top_k=3, backend="torch")
    for k in ("replay_restored_frac", "mean_kept_size", "kept_mass"):
        assert float(out.metrics[k]) == 0.0, (k, out.metrics[k])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_replay_gradient_from_the_entropy_alone(backend):
    """A loss whose only gradient is the entropy bonus (advantages 0, no shaping): the replay's backward runs
    for tokens with c = 0 and e != 0; the gradient equals the reference's."""
    from conftest import assert_grad_close
    from gtpo_kernels import GTPOConfig
    logits, ids, _ = _replay_case()
    cfg = GTPOConfig.preset("grpo", entropy_coef=0.05)
    grads = {}
    for b, x in ((backend, logits.clone()), ("reference", logits.double())):
        x.requires_grad_()
        gtpo_loss(x, ids, torch.zeros(ids.shape[0], dtype=x.dtype), group_size=2, config=cfg, top_k=4,
                  backend=b).loss.backward()
        grads[b] = x.grad
    assert grads["reference"].abs().sum() > 0
    assert_grad_close("grad", grads[backend], grads["reference"], 1e-5)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_dppo_tv_step_exactly_at_eps_high_is_valid(backend):
    """verl's DPPO-TV keeps a step up of exactly eps_high (p - p_old <= eps_high): p = 0.5 from two equal
    logits, p_old = 0.25, eps_high = 0.25 (all exact in float64); the token keeps its gradient, clip_frac 0."""
    from gtpo_kernels import GTPOConfig
    logits = torch.zeros(2, 1, 2, dtype=torch.float64, requires_grad=True)
    ids = torch.zeros(2, 1, dtype=torch.long)
    old = torch.full((2, 1), math.log(0.25), dtype=torch.float64)
    cfg = GTPOConfig.preset("dppo-tv", eps_high=0.25)
    out = gtpo_loss(logits, ids, torch.tensor([1.0, 1.0], dtype=torch.float64), group_size=1, config=cfg,
                    old_logps=old, backend=backend)
    out.loss.backward()
    assert float(out.metrics["clip_frac"]) == 0.0
    assert logits.grad.abs().sum() > 0


def test_dppo_clip_frac_leaves_out_zero_advantages():
    """DPPO's clip_frac counts the invalid tokens of completions with A != 0 only, as the reference does:
    completions with A = 0 whose tokens step far down are not 'clipped'."""
    from gtpo_kernels import GTPOConfig
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 5, 8, generator=g, dtype=torch.float64) * 2
    ids = torch.randint(0, 8, (4, 5), generator=g)
    lp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    old = torch.log(torch.clamp(torch.exp(lp) + 0.6, max=0.999))  # every step down beyond eps_low
    adv = torch.tensor([1.0, 0.0, -1.0, 0.0], dtype=torch.float64)
    outs = [gtpo_loss(logits, ids, adv, group_size=1, config=GTPOConfig.preset("dppo-tv"), old_logps=old,
                      backend=b).metrics["clip_frac"] for b in ("torch", "reference")]
    assert 0 < float(outs[1]) < 1
    torch.testing.assert_close(outs[0], outs[1])
