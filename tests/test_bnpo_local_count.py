"""bnpo divides by the call's own count of tokens, always (spec 9: 'dapo', 'cispo' and 'vespo' divide by
num_items_in_batch when it is given; 'bnpo' always by the local count). The preset says so
(GTPOConfig.local_count), so a num_items_in_batch given with it is refused on every entry rather than
silently used (before, gtpo_loss(config='bnpo', num_items_in_batch=110) divided by 110, not by the 11
counted tokens), and without it the loss is the token mean over the counted tokens, as the float64
reference computes it."""
import dataclasses

import pytest
import torch

import gtpo_reference as ref
from gtpo_kernels import GTPOConfig, gtpo_loss, gtpo_loss_from_logps, linear_gtpo_loss

B, T, V, D = 4, 3, 7, 5


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 2] = False  # 11 counted tokens
    old = -torch.rand(B, T, generator=g) - 1.0
    return x, ids, adv, mask, old


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bnpo_is_the_local_token_mean_and_refuses_num_items(backend):
    x, ids, adv, mask, old = _inputs()
    out = gtpo_loss(x, ids, adv, mask, group_size=2, old_logps=old, config="bnpo", backend=backend)
    d = dataclasses.asdict(GTPOConfig.preset("bnpo"))
    d.pop("generator")
    r = ref.gtpo_loss(x.double(), ids, adv, mask, group_size=2, old_logps=old, **d)
    assert abs(float(out.loss) - float(r["loss"])) <= 1e-5 * abs(float(r["loss"])) and float(r["loss"]) != 0
    # dapo's normalizer given the local count is the same number (the eps differ: compare with eps alike)
    dapo = gtpo_loss(x, ids, adv, mask, group_size=2, old_logps=old, backend=backend, num_items_in_batch=11,
                     config=GTPOConfig.preset("dapo", eps_high=0.2))
    torch.testing.assert_close(out.loss, dapo.loss)
    h, w = torch.randn(B, T, D), torch.randn(V, D)
    calls = [lambda **k: gtpo_loss(x, ids, adv, mask, group_size=2, old_logps=old, backend=backend, **k),
             lambda **k: gtpo_loss_from_logps(out.logps, ids, adv, mask, group_size=2, old_logps=old,
                                              backend=backend, **k),
             lambda **k: linear_gtpo_loss(h, w, ids, adv, mask, group_size=2, old_logps=old, backend=backend, **k)]
    for call in calls:
        for n in (110, torch.tensor(110.0)):
            with pytest.raises(ValueError, match="num_items_in_batch with config local_count=True"):
                call(config="bnpo", num_items_in_batch=n)
        call(config="bnpo")  # and without it, accepted


def test_local_count_is_bnpo_s_and_a_bool():
    with pytest.raises(ValueError, match="local_count must be a bool"):
        GTPOConfig(loss_agg="token-mean", local_count=1)
    assert GTPOConfig.preset("bnpo").local_count and not GTPOConfig.preset("dapo").local_count
    # another aggregation over bnpo's parts: num_items_in_batch refused as with any aggregation but token-mean
    x, ids, adv, mask, old = _inputs()
    with pytest.raises(ValueError, match="num_items_in_batch is the denominator of loss_agg='token-mean' only"):
        gtpo_loss(x, ids, adv, mask, group_size=2, config=GTPOConfig.preset("bnpo", loss_agg="seq-mean-token-mean"),
                  num_items_in_batch=5)


def test_areal_s_loss_with_the_bnpo_preset():
    """AReaL's make_loss_fn passes its micro-batch's own count as num_items_in_batch with token-mean; with the
    bnpo preset (local_count) it passes none: the same loss as dapo's (AReaL's clip range replaces both)."""
    from gtpo_kernels.integrations import areal
    g = torch.Generator().manual_seed(0)
    mb = dict(input_ids=torch.randint(0, 9, (2, 5), generator=g),
              loss_mask=torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 0, 0]]),
              advantages=torch.tensor([[0., 1., 1., 1., 0.], [0., -1., -1., 0., 0.]]),
              logprobs=-torch.rand(2, 5, generator=g) - 0.5)
    logp, ent = mb["logprobs"] + 0.05, torch.rand(2, 5, generator=g)
    losses = [float(areal.make_loss_fn(config=c)[0](logp, ent, mb)) for c in ("dapo", "bnpo")]
    assert losses[0] == losses[1] and losses[0] != 0, losses
