"""inplace=True on the Triton backend: the fused loss's path (pipeline/epilogue.py), its backward kernel
writing the gradient over the logits. Against the float64 reference with drawn configs (tests/test_joint.py
draws inplace among every option too); a flagged row raises when validating and gives NaN when not, as the
eager path; spec 8's launches (4 for the TRL-family presets, at most 8 else), flat in tokens. The
vocabulary-parallel path's epilogue (pipeline/epilogue_attached.py): tests/test_parallel.py."""
import pytest
import torch
from hypothesis import given, settings

import gtpo_reference as ref
from batches import cases_and_configs
from conftest import TOL, assert_grad_close, assert_value_close, examples
from gtpo_kernels import gtpo_loss


@settings(max_examples=examples(5))
@given(cc=cases_and_configs(nonempty=True))
def test_inplace_on_triton_matches_reference(cc):
    case, cfg = cc
    fields = dict(cfg.__dict__)
    xr = case.logits.double().requires_grad_()
    r = ref.gtpo_loss(xr, case.ids, case.adv, case.mask, group_size=case.G, logits_start=case.logits_start, **fields)
    (r["loss"].sum() if cfg.loss_agg == "none" else r["loss"]).backward()
    x = case.logits.clone().requires_grad_()
    out = gtpo_loss(x, case.ids, case.adv, case.mask, group_size=case.G, logits_start=case.logits_start, config=cfg,
                    backend="triton", inplace=True)
    (out.loss.sum() if cfg.loss_agg == "none" else out.loss).backward()
    tol = TOL[torch.float32]
    assert_value_close("loss", out.loss.detach(), r["loss"].detach(), tol["loss"])
    assert_value_close("per_token_loss", out.per_token_loss, r["per_token_loss"], tol["value"])
    assert_grad_close("grad logits", x.grad, xr.grad, tol["grad"])


def _batch(B=4, T=5, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, V, generator=g) * 3
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, generator=g)
    old = torch.log_softmax(x, -1).gather(-1, ids[..., None])[..., 0] + 0.1 * torch.randn(B, T, generator=g)
    return x, ids, adv, old


def test_inplace_flagged_row_raises_validating_and_is_nan_unvalidated():
    x, ids, adv, old = _batch()
    x[2, 1, 4] = float("nan")
    with pytest.raises(ValueError, match=r"completion token \(2, 1\) contains NaN or \+inf"):
        gtpo_loss(x.clone().requires_grad_(), ids, adv, group_size=2, old_logps=old, config="grpo", backend="triton",
                  inplace=True)
    out = gtpo_loss(x.clone().requires_grad_(), ids, adv, group_size=2, old_logps=old, config="grpo",
                    backend="triton", inplace=True, validate=False)
    assert torch.isnan(out.loss) and torch.isnan(out.logps[2, 1]) and torch.isfinite(out.logps[0]).all()


@pytest.mark.parametrize("config,bound", [("grpo", 4), ("clip-cov", 8)])
def test_inplace_takes_spec_8s_launches_flat_in_tokens(config, bound):
    """Spec 8: the forward kernel, the epilogue (clip_cov: its key launch, draws and sort too), the backward
    kernel over the logits in place, autograd's seed; the same count at 4 x 3 and 8 x 5 tokens (the second
    without a first call), no host read."""
    from bench.launches import counting

    def count(B, T, warm):
        x, ids, adv, old = _batch(B, T)
        leaf = x.requires_grad_()
        call = lambda: gtpo_loss(leaf, ids, adv, group_size=2, old_logps=old, config=config,  # noqa: E731
                                 backend="triton", inplace=True, validate=False).loss.backward()
        if warm:
            call()
            leaf.grad = None  # (no accumulation into a .grad from the call before)
        with counting() as c:
            call()
        return c.launches, c.host_reads
    small, large = count(4, 3, True), count(8, 5, False)
    assert small == large and small[1] == 0, (small, large)
    assert small[0] <= bound, small


def test_inplace_never_writes_over_frozen_logits():
    """Logits that need no gradient are left as they are when another input does (old_logps here): the
    backward writes nothing (it would have written the gradient over the caller's logits)."""
    x, ids, adv, old = _batch()
    old = old.clone().requires_grad_()
    before = x.clone()
    out = gtpo_loss(x, ids, adv, group_size=2, old_logps=old, config="grpo", backend="triton", inplace=True)
    assert out.loss.requires_grad
    out.loss.backward()
    assert torch.equal(x, before)


def test_three_rule_tensors_backward():
    """top_k, top_p and min_p all given as tensors (a list of tensors, one input of the custom op) take
    the backward: the gradient equals the one with the same rules given as numbers."""
    x, ids, adv, old = _batch()
    grads = []
    for rules in (dict(top_k=4, top_p=0.9, min_p=0.01),
                  dict(top_k=torch.full(ids.shape, 4), top_p=torch.full(ids.shape, 0.9),
                       min_p=torch.full(ids.shape, 0.01))):
        y = x.clone().requires_grad_()
        gtpo_loss(y, ids, adv, group_size=2, old_logps=old, config="grpo", backend="triton", **rules).loss.backward()
        grads.append(y.grad)
    assert grads[0].abs().max() > 0 and torch.equal(grads[0], grads[1])
