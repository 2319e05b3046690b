"""A ratio that overflows float32 (spec 6, 7): old_logps 95 nats below a token's log-prob, a finite log-ratio whose
exp is inf in float32, on a completion whose advantage is 0. Every policy term multiplies that ratio by the
advantage; the product is exactly 0 for any finite ratio, so the token adds nothing and the loss and gradient are
those of the float64 reference (where e^95 is finite), on the logits path and from log-probs, on both backends.
Before, r A = inf x 0 made the whole batch's loss NaN (PPO's clip, SAPO's slope, kl_cov's term). Tolerances:
spec 7 (float32: values 1e-5, gradients 1e-4 relative)."""
import dataclasses

import pytest
import torch
from conftest import assert_grad_close, assert_value_close

import gtpo_reference as ref
from gtpo_kernels import PRESETS, GTPOConfig, gtpo_loss, gtpo_loss_from_logps

CONFIGS = {"grpo": {}, "dapo": {}, "no-clip": dict(clip=False), "dual-clip": dict(dual_clip_c=3.0),
           "delta": dict(delta=1.5), "sapo": {}, "kl-cov": {}, "clip-cov": {}, "cispo": {}, "gspo": {}, "geo-mean": {}}


def _config(name):
    preset = name if name in PRESETS else "grpo"
    return GTPOConfig.preset(preset, **CONFIGS[name])


def _batch(seed, B=4, T=4, V=12):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, generator=g)
    adv[0] = 0.0  # the overflowing token's completion
    lp, _ = ref.token_logprobs(z, ids)
    old = lp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    old[0, 1] = lp[0, 1] - 95.0  # log r = 95: e^95 = 1.8e41 > float32's largest
    return z, ids, adv, old.float()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("entry", ["logits", "logps"])
def test_an_overflowing_ratio_at_a_zero_advantage_adds_nothing(entry, name, backend):
    z, ids, adv, old = _batch(sorted(CONFIGS).index(name))
    cfg = _config(name)
    zr = z.clone().requires_grad_()
    kw = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    torch.manual_seed(0)  # (clip_cov's draws: the same on both sides)
    r = ref.gtpo_loss(zr, ids, adv.double(), group_size=2, old_logps=old.double(), **kw)
    r["loss"].backward()
    assert torch.isfinite(r["loss"]) and zr.grad[1:].abs().sum() > 0
    x = z.float().requires_grad_()
    torch.manual_seed(0)
    if entry == "logits":
        out = gtpo_loss(x, ids, adv, group_size=2, old_logps=old, config=cfg, backend=backend)
        out.loss.backward()
        grad = x.grad
    else:  # the log-probs made from x, chained back to it
        lp, _ = ref.token_logprobs(x.double(), ids)
        lpf = lp.float().detach().requires_grad_()
        out = gtpo_loss_from_logps(lpf, ids, adv, group_size=2, old_logps=old, config=cfg, backend=backend)
        out.loss.backward()
        grad, = torch.autograd.grad(lp, x, lpf.grad.double())
    assert_value_close("loss", out.loss, r["loss"], 1e-5)
    assert_grad_close("grad", grad.double(), zr.grad, 1e-4)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("name", ["grpo", "no-clip", "sapo", "kl-cov"])
@pytest.mark.parametrize("entry", ["logits", "logps"])
def test_a_nan_ratio_at_a_zero_advantage_stays_nan(entry, name, backend):
    """Invalid input, unvalidated (a NaN logit in a counted row, a NaN log-prob) on a completion whose advantage
    is 0: the loss and that row's gradient NaN (spec 6: never a finite number), where the zero above is only for
    a ratio that overflowed (a first version of it made this row's gradient 0)."""
    z, ids, adv, old = _batch(5)
    old[0, 1] = -1.0
    cfg = _config(name)
    if entry == "logits":
        x = z.float()
        x[0, 1, 3] = float("nan")
        x.requires_grad_()
        out = gtpo_loss(x, ids, adv, group_size=2, old_logps=old, config=cfg, backend=backend, validate=False)
    else:
        lp, _ = ref.token_logprobs(z, ids)
        x = lp.float()
        x[0, 1] = float("nan")
        x.requires_grad_()
        out = gtpo_loss_from_logps(x, ids, adv, group_size=2, old_logps=old, config=cfg, backend=backend,
                                   validate=False)
    out.loss.backward()
    assert torch.isnan(out.loss) and torch.isnan(x.grad[0, 1]).any()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("shift", [3.0, 4.0])
def test_a_saturated_sapo_gate_keeps_its_gradient(shift, backend):
    """SAPO where sigmoid(tau_s (r - 1)) rounds to 1 in float32 (r = e^3, e^4: tau_s (r - 1) = 19, 53): the slope
    sigma(x) sigma(-x) r (4e-7, 1e-21) is a float32 number; it was set to 0 with 1 - sigma (a gradient of 0, a
    relative error of 1). Within spec 7 of the float64 reference."""
    g = torch.Generator().manual_seed(0)
    x, ids, adv = torch.randn(2, 2, 8, generator=g), torch.tensor([[3, 1], [0, 5]]), torch.tensor([1.0, 0.5])
    lp, _ = ref.token_logprobs(x.double(), ids, 1.0)
    old = (lp - shift).float()
    cfg = GTPOConfig.preset("sapo")
    xr = x.double().requires_grad_()
    want = ref.gtpo_loss(xr, ids, adv, old_logps=old, **{k: v for k, v in vars(cfg).items() if k != "generator"})
    want["loss"].backward()
    assert xr.grad.abs().max() > 0
    z = x.clone().requires_grad_()
    out = gtpo_loss(z, ids, adv, old_logps=old, config=cfg, backend=backend)
    out.loss.backward()
    assert_value_close("loss", out.loss, want["loss"], 1e-5)
    assert_grad_close("grad", z.grad, xr.grad, 1e-5)
