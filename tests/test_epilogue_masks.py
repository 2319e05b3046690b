"""The epilogue kernel's off-policy sequence mask and rollout weights (spec 9) on fixed cases, beside the
drawn ones of tests/test_epilogue.py: each case's mask drops a completion and keeps another whose advantage
is negative (so that the mask decides), a NaN rollout log-prob counts as 0 in a kept completion, weights per
token and per completion, the sequence level and another policy term; against the float64 reference and the
eager twin (spec 7: float32 1e-5). Validating, an invalid counted rollout weight raises the eager path's
error; unvalidated it gives NaN on both paths."""
import pytest
import torch

from gtpo_kernels import GTPOConfig, conflict_weights, gtpo_loss
from test_epilogue import _check, _inputs, _off_policy_threshold, _rollout

# (preset and options, seed, old, rollout log-probs, weights, packed, the NaNs' completions: one the mask
# keeps, one it drops)
CASES = {
    "old-token-weights": (dict(preset="gtpo"), 4, True, None, "token", False, None),
    "rollout-nan-completion-weights-packed": (dict(preset="gtpo"), 3, True, "nan", "completion", True, (3, 1)),
    "on-policy-kl": (dict(preset="grpo", beta=0.04), 3, False, None, None, False, None),
    "gspo-token-weights-packed": (dict(preset="gspo"), 4, True, None, "token", True, None),
    "cispo-rollout-completion-weights": (dict(preset="cispo", eps_high=1.05), 3, True, "given", "completion",
                                         False, None),
}


def _case(name):
    opts, seed, old, roll, rw, packed, nan_at = CASES[name]
    opts = dict(opts)
    cfg = GTPOConfig.preset(opts.pop("preset"), entropy_threshold=None, **opts)
    return dict(B=4, T=5, V=16, G=2, seed=seed, cfg=cfg, filt="off", packed=packed, mask="bool", old=old,
                lam="given", items=None, tau=None, rw=rw, roll=roll, off=True, nan_at=nan_at)


@pytest.mark.parametrize("name", list(CASES))
def test_off_policy_mask_and_rollout_weights_on_fixed_cases(name):
    c = _case(name)
    logits, ids, mask, adv, old, ref, _ = _inputs(c)
    lp = torch.log_softmax(logits.double(), -1)
    thr = _off_policy_threshold(c, lp, ids, mask, mask, old)
    samp = None if not (c["old"] or c["roll"]) else old.double() + (_rollout(c, mask)[1].double() if c["roll"] else 0)
    d = torch.zeros_like(lp[..., 0]) if samp is None else \
        torch.nan_to_num(samp - lp.gather(-1, ids[..., None])[..., 0], nan=0.0)
    mean = (d * mask).sum(1) / mask.sum(1).clamp(min=1)
    drop = (adv < 0) & (mean > thr)
    assert drop.any(), (adv, mean, thr)  # the mask decides: a completion dropped...
    if samp is not None:
        assert ((adv < 0) & ~drop).any(), (adv, mean, thr)  # ... and one with A < 0 kept
    if c["nan_at"] is not None:  # a NaN counts as 0: neither keeps (as -inf would) nor drops (as NaN would)
        kept, dropped = c["nan_at"]
        assert adv[kept] < 0 and adv[dropped] < 0 and not drop[kept] and drop[dropped], (adv, mean, thr)
    _check(c)  # the 4-launch path against the reference and the twin: loss, outputs, metrics, gradient


def test_reference_gradient_is_not_zero_with_the_mask():
    from test_epilogue import _call
    c = dict(_case("old-token-weights"))
    logits, ids, mask, adv, old, ref, tau = _inputs(c)
    c["cfg"] = c["cfg"].replace(off_policy_mask_threshold=_off_policy_threshold(
        c, torch.log_softmax(logits.double(), -1), ids, mask, mask, old))
    _, ref_grad, _ = _call(c, logits.double(), ids, mask, adv, old.double(), ref.double(), tau.double(), "reference",
                           torch.ones(4, 5))
    assert ref_grad.abs().sum() > 0


def _batch(seed=6):
    g = torch.Generator().manual_seed(seed)
    B, T, V = 4, 5, 16
    logits = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 4] = False
    adv = torch.randn(B, generator=g)
    lam, n_conf = conflict_weights(ids, mask, adv, 2)
    return logits, ids, mask, adv, dict(old_logps=torch.randn(B, T, generator=g) - 2, lam=lam, n_conf=n_conf)


# (per token, or per completion; the bad value; where: a counted token, or the completion)
BAD = [("token", -0.5), ("token", float("nan")), ("token", float("inf")), ("completion", -1.0),
       ("completion", float("nan"))]


@pytest.mark.parametrize("per,value", BAD, ids=[f"{p}-{v}" for p, v in BAD])
def test_validating_an_invalid_rollout_weight_raises_the_eager_error(per, value):
    """validate=True on the 4-launch path: the kernel checks the counted weights (bit 2 of its status word) and
    the host checks then raise the eager path's error, message unchanged; a bad weight at a token that is not
    counted is ignored."""
    logits, ids, mask, adv, kw = _batch()
    w = torch.rand(4, 5 if per == "token" else 1) + 0.5
    w[2, 3 if per == "token" else 0] = value
    ok = torch.rand(4, 5) + 0.5
    ok[1, 4] = -1.0  # not counted
    out = gtpo_loss(logits, ids, adv, mask, group_size=2, rollout_is_weights=ok, backend="triton", validate=True,
                    config=GTPOConfig.preset("gtpo", entropy_threshold=None, off_policy_mask_threshold=0.0), **kw)
    assert torch.isfinite(out.loss)
    errors = {}
    for backend in ("triton", "torch"):
        with pytest.raises(ValueError) as e:
            gtpo_loss(logits, ids, adv, mask, group_size=2, rollout_is_weights=w, backend=backend, validate=True,
                      **kw)
        errors[backend] = str(e.value)
    assert errors["triton"] == errors["torch"], errors
    assert errors["triton"] == ("rollout_is_weights must be >= 0 and finite at counted positions (see "
                                "rollout_is_weights() for TRL's modes)"), errors


@pytest.mark.parametrize("per,value", BAD[:2] + BAD[3:4], ids=[f"{p}-{v}" for p, v in BAD[:2] + BAD[3:4]])
def test_unvalidated_invalid_rollout_weight_gives_nan(per, value):
    """validate=False: an invalid counted weight makes the loss NaN on the 4-launch path, as on the eager path;
    from log-probs and over recorded kept sets too (their epilogue paths)."""
    from gtpo_kernels import gtpo_loss_from_logps
    from test_launches import _sampling_mask
    logits, ids, mask, adv, kw = _batch()
    w = torch.rand(4, 5 if per == "token" else 1) + 0.5
    w[2, 3 if per == "token" else 0] = value
    la = torch.log_softmax(logits, -1)
    lp, H = la.gather(-1, ids[..., None])[..., 0], -(la.exp() * la).sum(-1)
    sets = _sampling_mask(logits, ids, mask)
    for backend in ("triton", "torch"):
        for call in ("logits", "logps", "sets"):
            common = dict(group_size=2, rollout_is_weights=w, backend=backend, validate=False, **kw)
            if call == "logps":
                out = gtpo_loss_from_logps(lp, ids, adv, mask, entropy=H, **common)
            else:
                out = gtpo_loss(logits, ids, adv, mask, sampling_mask=sets if call == "sets" else None, **common)
            assert torch.isnan(out.loss), (backend, call, out.loss)


@pytest.mark.parametrize("schedule,packed", [("fused", False), ("recompute", True)])
def test_head_with_the_off_policy_mask_matches_the_eager_path(schedule, packed):
    """linear_gtpo_loss with the off-policy mask (covers() admits it): the epilogue kernel computes the loss
    (once per call, and on each fused tile for its completions), equal to the torch backend's eager path:
    loss, outputs and the gradients of hidden and weight, and to the float64 reference on the logits; the mask
    drops a completion and keeps one with A < 0. With rollout weights (the kernel reads them: per completion
    (B,) on the fused schedule padded, per token (N,) on the recompute one packed), no launch more."""
    from bench.launches import counting
    from conftest import assert_grad_close, assert_value_close
    from gtpo_kernels import linear_gtpo_loss
    from gtpo_kernels.pipeline.head import row_bytes
    import gtpo_reference as ref
    g = torch.Generator().manual_seed(8)
    B, T, D, V = 4, 5, 8, 24
    h = torch.randn(B, T, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.5
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.tensor([-0.8, -0.6, 0.7, -0.3])
    lp = torch.log_softmax((h @ w.T).double(), -1).gather(-1, ids[..., None])[..., 0]
    shift = torch.tensor([0.3, -0.2, 0.1, 0.05], dtype=torch.float64)[:, None]  # mean (old - logp) per completion
    old = (lp + shift + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    cfg = GTPOConfig.preset("grpo", beta=0.04, off_policy_mask_threshold=0.07)
    mean = (old.double() - lp).mean(1)
    assert (mean - 0.07).abs().min() > 1e-3 and (mean > 0.07)[0] and (mean < 0.07)[1], mean  # drops 0, keeps 1
    rw = torch.rand(B, T, generator=g) + 0.5 if packed else torch.rand(B, generator=g) + 0.5
    kw = dict(old_logps=old, ref_logps=old - 0.1, group_size=2, config=cfg, validate=False, rollout_is_weights=rw,
              memory_budget=2 * T * row_bytes(V, torch.float32, h.device), schedule=schedule)
    args = [h, w, ids, adv]
    if packed:
        kw.update(old_logps=old.reshape(-1), ref_logps=(old - 0.1).reshape(-1), rollout_is_weights=rw.reshape(-1),
                  cu_seqlens=torch.arange(0, B * T + 1, T), max_seqlen=T)
        args = [h.reshape(B * T, D), w, ids.reshape(-1), adv]
    outs = {}
    for backend in ("triton", "torch"):
        hh, ww = args[0].clone().requires_grad_(), w.clone().requires_grad_()
        with counting() as k:
            out = linear_gtpo_loss(hh, ww, *args[2:], backend=backend, **kw)
            out.loss.backward()
        outs[backend] = (out, hh.grad, ww.grad, k)
    (o, gh, gw, k), (t, th, tw, _) = outs["triton"], outs["torch"]
    assert k.triton_names.get("_epilogue_kernel", 0) >= 1, dict(k.triton_names)
    assert float(o.metrics["grad_in_forward"]) == (schedule == "fused")
    assert th.abs().sum() > 0
    assert_value_close("loss", o.loss, t.loss, 1e-5)
    for f in ("logps", "per_token_loss"):
        assert_value_close(f, getattr(o, f), getattr(t, f), 1e-5)
    assert_grad_close("grad hidden", gh, th.double(), 1e-5)
    assert_grad_close("grad weight", gw, tw.double(), 1e-5)
    # the float64 reference on the logits h W^T (the gradients through them)
    hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
    r = ref.gtpo_loss(hr @ wr.T, ids, adv.double(), None, group_size=2, old_logps=old.double(),
                      ref_logps=(old - 0.1).double(), rollout_is_weights=rw.double(), beta=0.04,
                      use_conflict_mask=False, entropy_threshold=None, entropy_penalty=0.0,
                      off_policy_mask_threshold=0.07, loss_agg=cfg.loss_agg)
    r["loss"].backward()
    assert hr.grad.abs().sum() > 0
    assert_value_close("loss vs reference", o.loss.detach(), r["loss"].detach(), 1e-5)
    assert_grad_close("grad hidden vs reference", gh.reshape(B, T, D), hr.grad, 1e-5)
    assert_grad_close("grad weight vs reference", gw, wr.grad, 1e-5)
    n_epi = k.triton_names["_epilogue_kernel"]
    hh, ww = args[0].clone().requires_grad_(), w.clone().requires_grad_()
    with counting() as k0:  # the same launches without the weights
        out = linear_gtpo_loss(hh, ww, *args[2:], backend="triton", **dict(kw, rollout_is_weights=None))
        out.loss.backward()
    assert (k0.launches, k0.host_reads, k0.triton_names["_epilogue_kernel"]) == (k.launches, k.host_reads, n_epi)
    # the mask decided: a dropped completion keeps only its KL term
    eager_off = linear_gtpo_loss(args[0], w, *args[2:], backend="torch", **dict(kw, config=cfg.replace(
        off_policy_mask_threshold=None)))
    assert not torch.allclose(eager_off.loss, t.loss)
