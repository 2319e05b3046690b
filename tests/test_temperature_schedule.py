"""The config's temperature as a 0-d tensor, a schedule updated in place between calls (spec 1, 13): the
kernels read it where it is, every call, without a host read. Changed in place to a valid value, a call
equals one with that number in the config; changed to a value that is not finite and > 0 (0, -1, NaN, inf),
an unvalidated call gives NaN at every counted token (log-prob, entropy, loss, a NaN in each counted row's
gradient), never a finite number, on every path that divides by tau (the vocabulary passes, the kept-set
replay, the LM head, on both backends and the oracle's, backend="reference", which refused it unvalidated),
and a validated call refuses it naming GTPOConfig.temperature."""
import math

import pytest
import torch

from gtpo_kernels import GTPOConfig, gtpo_loss, linear_gtpo_loss

B, T, V, D = 4, 3, 11, 5
PATHS = ["logits", "logits-top_k", "logits-sampling_mask", "head", "head-top_k"]


def _inputs():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(B, T, V, generator=g) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 2] = False
    return dict(x=x, ids=ids, mask=mask, adv=torch.tensor([1.0, -1.0, 0.5, -0.5]),
                old=-torch.rand(B, T, generator=g) - 1, h=torch.randn(B, T, D, generator=g),
                w=torch.randn(V, D, generator=g), keep=torch.rand(B, T, V, generator=g) < 0.6)


def _call(path, cfg, backend, validate, d):
    """(out, the leaf whose gradient is checked: (B, T, V) logits or (B, T, D) hidden) after backward."""
    kw = dict(group_size=2, old_logps=d["old"], ref_logps=d["old"] - 0.3, config=cfg, backend=backend, validate=validate,
              completion_mask=d["mask"])
    if path.endswith("top_k"):
        kw["top_k"] = 3
    if path.endswith("sampling_mask"):
        keep = d["keep"].clone()
        keep.scatter_(-1, d["ids"][..., None], True)  # every sampled id in its set
        sets = keep[d["mask"]]  # the counted tokens' sets, in order: vLLM's (token_ids, offsets)
        kw["sampling_mask"] = (sets.nonzero()[:, 1], torch.cat([torch.zeros(1, dtype=torch.long),
                                                                sets.sum(-1).cumsum(0)]))
    if path.startswith("head"):
        leaf = d["h"].clone().requires_grad_()
        out = linear_gtpo_loss(leaf, d["w"], d["ids"], d["adv"], memory_budget=2 * V * 4 * 6, **kw)
    else:
        leaf = d["x"].clone().requires_grad_()
        out = gtpo_loss(leaf, d["ids"], d["adv"], **kw)
    out.loss.backward()
    return out, leaf


@pytest.mark.parametrize("backend", ["triton", "torch", "reference"])
@pytest.mark.parametrize("path", PATHS)
def test_a_schedule_changed_in_place_is_the_value_it_holds(backend, path):
    d = _inputs()
    tau = torch.tensor(1.0)
    live = GTPOConfig.preset("grpo", temperature=tau, beta=0.04)
    tau.fill_(0.5)
    a, la = _call(path, live, backend, False, d)
    b, lb = _call(path, GTPOConfig.preset("grpo", temperature=0.5, beta=0.04), backend, False, d)
    assert torch.isfinite(a.loss) and lb.grad.abs().sum() > 0
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(a.logps, b.logps, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(la.grad, lb.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", ["triton", "torch", "reference"])
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("value", [-1.0, 0.0, math.nan, math.inf, 1e-39])
def test_a_schedule_changed_in_place_to_an_invalid_value_is_nan_or_refused(backend, path, value):
    d = _inputs()
    tau = torch.tensor(0.9)
    cfg = GTPOConfig.preset("grpo", temperature=tau, beta=0.04)
    tau.fill_(value)
    out, leaf = _call(path, cfg, backend, False, d)
    counted = d["mask"]
    assert torch.isnan(out.loss)
    assert torch.isnan(out.logps[counted]).all() and torch.isnan(out.entropy[counted]).all()
    assert torch.isnan(leaf.grad[counted]).flatten(1).any(1).all()  # a NaN in every counted row's gradient
    with pytest.raises(ValueError, match=r"GTPOConfig\.temperature must be > 0, with temperature and 1 / temperature finite in float32, got tensor\("):
        _call(path, cfg, backend, True, d)


def test_tau_or_nan_is_nan_exactly_where_tau_is_unusable():
    """core.flags.tau_or_nan, the torch passes' guard: a temperature kept where finite, > 0 and 1 / tau finite
    in float32; NaN elsewhere (0, < 0, NaN, inf, below 2.9e-39), for numbers and tensors alike."""
    from gtpo_kernels.core.flags import tau_or_nan
    values = [0.7, 3e-39, 0.0, -1.0, math.nan, math.inf, 1e-39]
    keep = [True, True, False, False, False, False, False]
    t = tau_or_nan(torch.tensor(values, dtype=torch.float64))
    assert torch.isnan(t).tolist() == [not k for k in keep]
    assert [not math.isnan(tau_or_nan(v)) for v in values] == keep
