"""verl's geo_mean (GMPO) on the epilogue kernel from hidden states (the LM head): each completion's log R is
formed in the kernel's pass 1 (kernels/epilogue_geo.py) and its gradient spread over the tokens the clip did
not stop, on both schedules and over several fused tiles, equal to the eager twin (the torch backend) within
spec 7's float32 tolerance; per-completion rollout weights folded into log R. The logits and log-probs entry
points are tests/test_epilogue.py's (geo-mean among OTHER)."""
import pytest
import torch

from bench.launches import counting
from conftest import assert_grad_close, assert_value_close
from gtpo_kernels import GTPOConfig, linear_gtpo_loss

TOL = 1e-5


@pytest.mark.parametrize("schedule,rows", [("fused", None), ("fused", 6), ("recompute", 6)])
def test_head_geo_mean_matches_the_twin(schedule, rows):
    g = torch.Generator().manual_seed(1)
    B, T, D, V = 6, 5, 8, 40
    h, w = torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g) / 2
    ids = torch.randint(0, V, (B, T), generator=g)
    adv, mask = torch.randn(B, generator=g), torch.rand(B, T, generator=g) > 0.2
    lp = torch.log_softmax(h @ w.T, -1).gather(-1, ids[..., None])[..., 0]
    old = lp + 0.1 * torch.randn(B, T, generator=g)
    rw = torch.rand(B, 1, generator=g) + 0.5
    cfg = GTPOConfig.preset("geo-mean", eps_low=0.03, eps_high=0.12, beta=0.04, use_bias_correction_kl=True)
    ref = lp + 0.2 * torch.randn(B, T, generator=g)
    res = {}
    for backend in ("triton", "torch"):
        x, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with counting() as n:
            out = linear_gtpo_loss(x, ww, ids, adv, mask, old_logps=old, ref_logps=ref, config=cfg, backend=backend,
                                   schedule=schedule, rollout_is_weights=rw,
                                   memory_budget=None if rows is None else rows * V * 16)
            out.loss.backward()
        res[backend] = (out, x.grad, ww.grad, n)
    (o, gh, gw, n), (t, th, tw, _) = res["triton"], res["torch"]
    assert n.triton_names.get("_epilogue_kernel", 0) >= 1, dict(n.triton_names)
    assert 0 < float(t.metrics["clip_frac"]) < 1 and tw.abs().sum() > 0
    assert_value_close("loss", o.loss.detach(), t.loss.detach(), TOL)
    assert_value_close("clip_frac", o.metrics["clip_frac"], t.metrics["clip_frac"], TOL)
    assert_grad_close("hidden grad", gh, th, TOL)
    assert_grad_close("weight grad", gw, tw, TOL)
