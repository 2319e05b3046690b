"""A NaN advantage in the conflict weights (spec 3, 6): its sign decides whether its completion is positive
or negative, and so every member's conflicts in its group. Unvalidated, that group's lam and n_conf are
NaN, the other groups' as the float64 reference gives them (before: the NaN member counted as inactive and
its group got finite weights, lam 1 where the reference gives 2); validating, the call refuses it. The Triton
kernel, the torch path, the public conflict_weights and gtpo_loss's own, padded and packed."""
import pytest
import torch

import gtpo_reference as ref
from gtpo_kernels import GTPOConfig, conflict_weights, gtpo_loss

IDS = torch.tensor([[1, 2, 3, 4], [1, 2, 5, 4], [1, 7, 3, 4], [9, 2, 3, 4], [5, 5, 6, 2], [5, 5, 1, 2]])
GOOD = torch.tensor([1.0, -1.0, 1.0, -1.0, 0.7, -0.4], dtype=torch.float64)


def _form(packed):
    mask = torch.ones(IDS.shape, dtype=torch.bool)
    mask[2, 3] = False
    if packed:
        return IDS[mask], dict(cu_seqlens=torch.tensor([0, 4, 8, 11, 15, 19, 23]), max_seqlen=4), mask
    return IDS, dict(completion_mask=mask), mask


def _expected(mask, nan_row, G):
    lam, n_conf = ref.conflict_weights(IDS, mask, GOOD, G, 2.0, 0.0)
    rows = slice(nan_row // G * G, nan_row // G * G + G)
    assert not bool((lam[rows] == 1).all()), "the NaN's group has conflicts when its advantage is finite"
    lam[rows], n_conf[rows] = float("nan"), float("nan")
    return lam, n_conf


def _same(a, b):
    return torch.equal(a.double().nan_to_num(7.0), b.double().nan_to_num(7.0))


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("nan_row", [1, 4])
def test_a_nan_advantage_makes_its_group_nan(backend, packed, nan_row):
    G = 2 if nan_row == 4 else 3
    ids, form, mask = _form(packed)
    adv = GOOD.float().clone()
    adv[nan_row] = float("nan")
    lam_r, n_r = _expected(mask, nan_row, G)
    lam, n_conf = conflict_weights(ids, form.get("completion_mask"), adv, G, backend=backend, validate=False,
                                   **{k: v for k, v in form.items() if k != "completion_mask"})
    want = lam_r[mask] if packed else lam_r
    assert _same(lam, want) and _same(n_conf, n_r), (lam, want, n_conf, n_r)
    # in the loss: the group's lam as returned NaN, its tokens' loss NaN, the other groups' weights as given
    x = torch.randn(*ids.shape, 11, generator=torch.Generator().manual_seed(nan_row)).requires_grad_()
    out = gtpo_loss(x, ids, adv, group_size=G, config="gtpo", backend=backend, validate=False, **form)
    in_loss = torch.where(mask[mask] if packed else mask, want, 1.0)  # (the loss's lam: 1 off the mask)
    assert _same(out.lam.reshape(-1), in_loss.reshape(-1)) and _same(out.n_conf, n_r), (out.lam, in_loss)
    assert torch.isnan(out.per_token_loss.reshape(-1)[torch.isnan(in_loss.reshape(-1))]).all()
    with pytest.raises(ValueError, match="advantages must be finite"):
        conflict_weights(ids, form.get("completion_mask"), adv, G, backend=backend,
                         **{k: v for k, v in form.items() if k != "completion_mask"})


def test_the_kernel_alone():
    """kernels/conflict_triton's launch (the loss's own, and a split vocabulary's sums launch's programs)."""
    from gtpo_kernels.kernels import ops
    adv = GOOD.float().clone()
    adv[3] = float("nan")
    lam, n_conf = ops.conflict_weights(IDS.reshape(-1).contiguous(), None, adv, None, 4, 2, 2.0, 0.0)
    lam_r, n_r = _expected(torch.ones(IDS.shape, dtype=torch.bool), 3, 2)
    assert _same(lam, lam_r.reshape(-1)) and _same(n_conf, n_r)


@pytest.mark.parametrize("given", [None, "lam", "n_conf"])
@pytest.mark.parametrize("kind", ["nan advantage", "negative id"])
def test_the_reference_backend_keeps_the_same_contract(kind, given):
    """backend='reference' handed the oracle its inputs as they were: a NaN advantage counted as inactive (its
    group's lam 1, conflict_frac 1.0 where the others give NaN), a negative counted id's completion finite weights
    (conflict_frac 0.83). It now makes the same weights NaN, and the oracle's conflict_frac reads a NaN lam as
    unknown."""
    ids, adv = IDS.clone(), GOOD.float().clone()
    if kind == "nan advantage":
        adv[1] = float("nan")
    else:
        ids[4, 2] = -3
    logits = torch.randn(*IDS.shape, 10, generator=torch.Generator().manual_seed(0))
    kw = {} if given is None else {"lam": dict(lam=torch.ones(IDS.shape)), "n_conf": dict(n_conf=torch.ones(6))}[given]
    cfg = "gtpo" if given != "lam" else GTPOConfig.preset("gtpo", loss_agg="gtpo-official")  # (n_conf read)
    outs = {be: gtpo_loss(logits, ids.clamp(max=9), adv, group_size=2, config=cfg, backend=be, validate=False, **kw)
            for be in ("torch", "reference")}
    got, want = outs["reference"], outs["torch"]
    assert _same(got.lam, want.lam) and _same(got.n_conf, want.n_conf), (got.lam, want.lam, got.n_conf, want.n_conf)
    assert _same(got.per_token_loss, want.per_token_loss)
    assert torch.isnan(got.n_conf if given == "lam" else got.lam).any()  # the weights made in the call: NaN
    if given != "lam":
        assert torch.isnan(got.metrics["conflict_frac"]) and torch.isnan(want.metrics["conflict_frac"])
        assert torch.isfinite(got.lam[4 if kind == "nan advantage" else 0]).all()
