"""Silent wrong answers, round 2, on one process: each test compares with a float64 (or mpmath) evaluation
on fresh random inputs, or checks that unvalidated invalid input gives NaN (spec 6, 7)."""
import math

import pytest
import torch
from conftest import TOL, assert_grad_close

import gtpo_reference as ref
from gtpo_kernels import (GTPOConfig, conflict_weights, gtpo_loss, gtpo_loss_from_logps, linear_gtpo_loss,
                          token_logprobs)

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
