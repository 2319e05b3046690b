"""verl's geo_mean (GMPO) and TRL's vespo on the epilogue kernel from hidden states (the LM head): each
completion's log R (geo_mean; its gradient spread over the tokens the clip did not stop) or phi (vespo) is
formed in the kernel's pass 1 (kernels/epilogue_geo.py), on both schedules and over several fused tiles,
equal to the eager twin (the torch backend) within spec 7's float32 tolerance; per-completion rollout
weights folded in. The logits and log-probs entry points are tests/test_epilogue.py's (both among OTHER)."""
import pytest
import torch

from bench.launches import counting
from conftest import assert_grad_close, assert_value_close
from gtpo_kernels import GTPOConfig, gtpo_loss, linear_gtpo_loss

TOL = 1e-5


_CFG = {"geo-mean": dict(eps_low=0.03, eps_high=0.12), "vespo": dict(vespo_k_pos=1.0, vespo_lambda_pos=0.5)}


@pytest.mark.parametrize("schedule,rows", [("fused", None), ("fused", 6), ("recompute", 6)])
@pytest.mark.parametrize("policy", ["geo-mean", "vespo"])
def test_head_per_completion_terms_match_the_twin(policy, schedule, rows):
    g = torch.Generator().manual_seed(1)
    B, T, D, V = 6, 5, 8, 40
    h, w = torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g) / 2
    ids = torch.randint(0, V, (B, T), generator=g)
    adv, mask = torch.randn(B, generator=g), torch.rand(B, T, generator=g) > 0.2
    lp = torch.log_softmax(h @ w.T, -1).gather(-1, ids[..., None])[..., 0]
    old = lp + 0.1 * torch.randn(B, T, generator=g)
    rw = torch.rand(B, 1, generator=g) + 0.5
    cfg = GTPOConfig.preset(policy, beta=0.04, use_bias_correction_kl=True, **_CFG[policy])
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
    assert (0 < float(t.metrics["clip_frac"]) < 1 or policy == "vespo") and tw.abs().sum() > 0
    assert_value_close("loss", o.loss.detach(), t.loss.detach(), TOL)
    assert_value_close("clip_frac", o.metrics["clip_frac"], t.metrics["clip_frac"], TOL)
    assert_grad_close("hidden grad", gh, th, TOL)
    assert_grad_close("weight grad", gw, tw, TOL)


def _vespo_call(backend, old_edit, validate=True):
    g = torch.Generator().manual_seed(5)
    B, T, V = 4, 5, 16
    logits = torch.randn(B, T, V, generator=g) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    lp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    old = lp + 0.1 * torch.randn(B, T, generator=g)
    old_edit(old, lp)
    adv = torch.tensor([0.0, 1.0, -0.5, -1.0])  # an advantage of 0: vespo's positive pair (A >= 0)
    cfg = GTPOConfig.preset("vespo", entropy_penalty=0.1, entropy_threshold=None, vespo_k_pos=1.0,
                            vespo_lambda_pos=0.5, vespo_k_neg=2.0, vespo_lambda_neg=1e-6)
    x = logits.clone().requires_grad_()
    out = gtpo_loss(x, ids, adv, old_logps=old, config=cfg, backend=backend, validate=validate)
    out.loss.backward()
    return out, x.grad


def _far(old, lp):  # log r = +25 (clamped to 20 in L) and -10 in completion 0; completion 3's too
    old[0, 1], old[0, 2] = lp[0, 1] - 25.0, lp[0, 2] + 10.0
    old[3, 1], old[3, 2] = lp[3, 1] - 25.0, lp[3, 2] + 10.0


def test_vespo_edges_match_the_twin():
    """vespo's edges on the epilogue, against the eager twin: an advantage of exactly 0 with entropy shaping
    (Ahat != 0; phi takes the positive pair), lambda below its floor of 1e-4, log-ratios past +-20 (clamped
    in L), and an unvalidated NaN old log-prob (its completion's phi NaN, not 0: the loss is NaN)."""
    (o, g), (t, tg) = _vespo_call("triton", _far), _vespo_call("torch", _far)
    assert torch.isfinite(t.loss) and tg.abs().sum() > 0
    assert_value_close("loss", o.loss.detach(), t.loss.detach(), TOL)
    assert_grad_close("grad", g, tg, TOL)

    def nan(old, lp):
        old[2, 0] = float("nan")
    (o, _), (t, _) = _vespo_call("triton", nan, False), _vespo_call("torch", nan, False)
    assert torch.isnan(t.loss) and torch.isnan(o.loss)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fused_head_keeps_the_gradient_of_tokens_with_lam_zero_under_geo_mean(backend):
    """geo_mean's log R spreads d loss / d log R over the completion's unclipped tokens, a token with lam = 0
    (a conflict token of a negative completion) included: the fused schedule may not skip such a row's
    gradient GEMMs (tile_plan.prior_live); its gradients equal the recompute schedule's."""
    g = torch.Generator().manual_seed(1)
    B, T, D, V = 6, 5, 8, 40
    h, w = torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g) / 2
    ids, adv = torch.randint(0, V, (B, T), generator=g), torch.randn(B, generator=g)
    old = torch.log_softmax(h @ w.T, -1).gather(-1, ids[..., None])[..., 0] + 0.1 * torch.randn(B, T, generator=g)
    lam = torch.ones(B, T)
    lam[0, 1] = lam[2, 2] = 0.0
    cfg = GTPOConfig.preset("geo-mean", eps_low=0.03, eps_high=0.12)
    grads = {}
    for schedule in ("fused", "recompute"):
        x, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        linear_gtpo_loss(x, ww, ids, adv, old_logps=old, lam=lam, config=cfg, backend=backend,
                         schedule=schedule).loss.backward()
        grads[schedule] = (x.grad, ww.grad)
    assert grads["recompute"][0][0, 1].abs().sum() > 0 and grads["recompute"][0][2, 2].abs().sum() > 0
    assert_grad_close("hidden grad", grads["fused"][0], grads["recompute"][0], TOL)
    assert_grad_close("weight grad", grads["fused"][1], grads["recompute"][1], TOL)
