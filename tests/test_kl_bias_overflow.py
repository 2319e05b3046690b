"""The bias-corrected KL term (spec 9: k3 times the ratio, TRL's use_bias_correction_kl) where k3 overflows
float32: ref - logp > 88, an ordinary log-prob of -100 against a reference's -5. The package formed beta * k3 * r,
inf times a small ratio (inf) or times one that underflowed to 0 (NaN), where the term is finite (k3 r =
e^(ref - old) - (ref - logp + 1) r) and the float64 oracle's loss is -0.3186; at the sequence level (gspo) R e^P
overflowed in the gradient too. Now k3 r is e^(d + log r) - (d + 1) r where k3 overflows, and R e^P is e^(P + log R):
loss and gradient within spec 7's float32 targets of the oracle's, on both backends, both entry points."""
import dataclasses

import pytest
import torch

import gtpo_reference as ref
from gtpo_kernels import GTPOConfig, gtpo_loss, gtpo_loss_from_logps

V = 4


def _logits(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, V, generator=g)
    ids = torch.randint(0, V, (2, 3), generator=g)
    # the first completion's log-probs about -100, the reference's and the old policy's about -5 (at the sequence
    # level P = mean(ref - logp) = 95: e^P overflows, R e^P is about 1)
    x[0, torch.arange(3), ids[0]] = -100.0
    old = -torch.rand(2, 3, generator=g) - 1.0
    old[0] = -5.0
    refl = old + 0.3 * torch.randn(2, 3, generator=g)
    refl[0] = torch.tensor([-5.0, -4.5, -5.5])
    return x, ids, old, refl


def _oracle(x, ids, adv, old, refl, cfg):
    xo = x.double().requires_grad_()
    out = ref.gtpo_loss(xo, ids, adv, group_size=2, old_logps=old.double(), ref_logps=refl.double(),
                        **{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    out["loss"].backward()
    return out["loss"].detach(), xo.grad


@pytest.mark.parametrize("preset", ["grpo", "gspo", "cispo"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_bias_corrected_kl_where_k3_overflows(preset, backend):
    x, ids, old, refl = _logits(1)
    adv = torch.tensor([1.0, -0.5])
    cfg = GTPOConfig.preset(preset, beta=0.04, use_bias_correction_kl=True)
    want, gref = _oracle(x, ids, adv, old, refl, cfg)
    assert torch.isfinite(want) and gref.abs().sum() > 0
    z = x.clone().requires_grad_()
    out = gtpo_loss(z, ids, adv, config=cfg, group_size=2, old_logps=old, ref_logps=refl, backend=backend)
    out.loss.backward()
    assert abs(float(out.loss) - float(want)) / max(1.0, abs(float(want))) <= 1e-5, (float(out.loss), float(want))
    assert torch.isfinite(z.grad).all()
    assert float((z.grad.double() - gref).norm() / gref.norm()) <= 1e-5


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_bias_corrected_kl_from_logps(backend):
    """The log-probs entry point: a token's term is beta e^(ref - old) - beta (d + 1) r = 0.04 here, not inf."""
    cfg = GTPOConfig.preset("grpo", beta=0.04, use_bias_correction_kl=True)
    logps = torch.tensor([[-100.0, -1.0]], requires_grad=True)
    old, refl = torch.tensor([[-5.0, -1.0]]), torch.tensor([[-5.0, -1.2]])
    out = gtpo_loss_from_logps(logps, torch.tensor([[0, 1]]), torch.tensor([1.0]), old_logps=old, ref_logps=refl,
                               config=cfg, backend=backend)
    out.loss.backward()
    d = -1.2 - -1.0
    want1 = -1.0 + 0.04 * (torch.tensor(d).exp() - d - 1.0)  # the second token: -A r + beta k3 (r = 1)
    torch.testing.assert_close(out.per_token_loss.detach(), torch.tensor([[0.04, float(want1)]]), rtol=1e-5,
                               atol=1e-7)
    assert torch.isfinite(logps.grad).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_sequence_kl_gradient_where_a_token_lies_far_above_its_completion_s_mean(backend):
    """gspo: d = ref - logp of [134, 0, 0] around its mean P = 44.7 (d - P = 89.3: expm1 overflows float32) with
    log R = -145: R e^P expm1(d - P) is about 1e-7, but expm1 alone was inf (gradient [nan, inf, inf], the torch
    backend's loss NaN). Now e^(P + log R + d - P) - e^(P + log R) past d - P = 80: the float64 run's gradient."""
    cfg = GTPOConfig.preset("gspo", beta=0.04, use_bias_correction_kl=True)
    lp = torch.tensor([[-140.0, -160.0, -160.0], [-1.0, -1.2, -0.8]])
    old = torch.tensor([[-5.0, -10.0, -10.0], [-1.1, -1.0, -0.9]])
    refl = torch.tensor([[-6.0, -160.0, -160.0], [-1.0, -1.1, -1.0]])
    adv, ids = torch.tensor([1.0, -0.5]), torch.zeros(2, 3, dtype=torch.long)
    runs = []
    for dt, be in ((torch.float64, "torch"), (torch.float32, backend)):
        x = lp.to(dt).requires_grad_()
        out = gtpo_loss_from_logps(x, ids, adv, old_logps=old.to(dt), ref_logps=refl.to(dt), config=cfg,
                                   group_size=2, backend=be)
        out.loss.backward()
        runs.append((out.loss.double(), x.grad.double()))
    (want, gwant), (got, ggot) = runs
    assert abs(float(got - want)) <= 1e-5 * max(1.0, abs(float(want)))
    assert torch.isfinite(ggot).all() and float((ggot - gwant).norm() / gwant.norm()) <= 1e-5
    torch.testing.assert_close(ggot[0], gwant[0], rtol=1e-4, atol=0)  # the far token's row, about 1e-7
