"""The packed form of the public contract (spec section 6): cu_seqlens rows equal the padded form (loss,
outputs, gradients, conflict weights), and max_seqlen is checked but is not the denominator."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batches import cases
from conftest import assert_grad_close, assert_value_close, examples
from gtpo_kernels import GTPOConfig, conflict_weights, gtpo_loss
from test_api import BACKENDS


def _pack(case):
    """The padded case with trailing padding removed: (logits (N, V), ids (N,), mask (N,), cu, lengths)."""
    m = case.counted
    T = m.shape[1]
    last = torch.where(m, torch.arange(T), -1).amax(1)
    lengths = last + 1
    rows = [(i, t) for i in range(m.shape[0]) for t in range(int(lengths[i]))]
    ii = torch.tensor([r[0] for r in rows], dtype=torch.long)
    tt = torch.tensor([r[1] for r in rows], dtype=torch.long)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    return case.logits[ii, tt + case.logits_start], case.ids[ii, tt], case.mask[ii, tt], cu, ii, tt


@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
@settings(max_examples=examples(8))  # CI time: nightly runs 80
@given(case=cases(), agg=st.sampled_from(["seq-mean-token-mean", "token-mean", "gtpo-official",
                                          "seq-mean-token-sum-norm", "none"]))
def test_packed_equals_padded(backend, case, agg):
    T = case.ids.shape[1]
    cfg = GTPOConfig(entropy_threshold=1.5, loss_agg=agg, temperature=case.temperature,
                     max_completion_length=T)
    x = case.logits.clone().requires_grad_()
    pad = gtpo_loss(x, case.ids, case.adv, case.mask, group_size=case.G, config=cfg,
                    logits_start=case.logits_start, backend=backend)
    lg, ids, mask, cu, ii, tt = _pack(case)
    xp = lg.clone().requires_grad_()
    packed = gtpo_loss(xp, ids, case.adv, mask, group_size=case.G, config=cfg, cu_seqlens=cu,
                       backend=backend)
    if agg == "none":
        w = torch.rand(case.ids.shape, generator=torch.Generator().manual_seed(0))
        (pad.loss * w).sum().backward()
        (packed.loss * w[ii, tt]).sum().backward()
    else:
        assert_value_close("loss", packed.loss.detach(), pad.loss.detach(), 1e-6)
        pad.loss.backward()
        packed.loss.backward()
    for name in ("logps", "entropy", "per_token_loss", "lam"):
        assert_value_close(name, getattr(packed, name), getattr(pad, name)[ii, tt], 1e-6)
    for name in ("n_conf", "seq_entropy"):
        assert_value_close(name, getattr(packed, name), getattr(pad, name), 1e-6)
    assert xp.grad is not None and x.grad is not None, (xp.grad is None, x.grad is None)
    assert_grad_close("packed grad", xp.grad, x.grad[ii, tt + case.logits_start], 1e-6)
    lam, n_conf = conflict_weights(ids, mask, case.adv, case.G, config=cfg, cu_seqlens=cu)
    assert torch.equal(lam.double(), pad.lam[ii, tt].double())
    assert torch.equal(n_conf.double(), pad.n_conf.double())


def test_packed_max_seqlen_is_checked_and_not_the_denominator():
    g = torch.Generator().manual_seed(0)
    x, ids = torch.randn(8, 10, generator=g), torch.randint(0, 10, (8,), generator=g)
    cu, adv = torch.tensor([0, 3, 8]), torch.tensor([1.0, -1.0])
    with pytest.raises(ValueError, match="max_seqlen = 4 is shorter than the longest"):
        gtpo_loss(x, ids, adv, group_size=2, cu_seqlens=cu, max_seqlen=4)
    losses = [gtpo_loss(x, ids, adv, cu_seqlens=cu, max_seqlen=m, config="dr_grpo").loss for m in (None, 5, 8)]
    assert losses[0] == losses[1] == losses[2]  # the longest completion (5), whatever max_seqlen says
    five = gtpo_loss(x, ids, adv, cu_seqlens=cu, config=GTPOConfig.preset("dr_grpo", max_completion_length=5)).loss
    eight = gtpo_loss(x, ids, adv, cu_seqlens=cu, config=GTPOConfig.preset("dr_grpo", max_completion_length=8)).loss
    assert losses[0] == five and eight != five
