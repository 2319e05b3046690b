"""Errors that name the caller's argument (spec 6): gtpo_token_advantages' `responses`, `entropy` and verl's
(B, T) `advantages`, and conflict_weights' `dtype`. Before: a NaN entropy at a counted token was filtered
out, a finite 0 (entropy_penalty=0) or NaN by the config; a bad id named `completion_ids`, which the
function does not take; a NaN in (B, T) advantages was called token-varying (GAE); an integer or bool dtype
raised torch's overflow error or returned True / False weights."""
import pytest
import torch

from gtpo_kernels import GTPOConfig, conflict_weights, gtpo_token_advantages

IDS = torch.tensor([[5, 7, 9, 4], [5, 7, 3, 4]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
H = torch.tensor([[0.2, 0.3, 0.1, 0.4], [0.25, 0.15, 0.05, 0.3]])
ADV = torch.tensor([1.0, -1.0])


@pytest.mark.parametrize("cfg", [GTPOConfig.preset("gtpo", entropy_penalty=0.0), "gtpo"])
def test_a_non_finite_entropy_at_a_counted_token_is_refused(cfg):
    good = gtpo_token_advantages(ADV, IDS, MASK, H, ["p", "p"], config=cfg)
    assert (good[0, :3] != 0).all() and good[0, 3] == 0  # (the row is kept and shaped when its entropy is finite)
    for bad in (float("nan"), float("inf")):
        h = H.clone()
        h[0, 1] = bad
        with pytest.raises(ValueError, match="entropy must be finite at counted positions; flat position 1"):
            gtpo_token_advantages(ADV, IDS, MASK, h, ["p", "p"], config=cfg)
    h = H.clone()
    h[0, 3] = float("nan")  # masked out: not read
    assert torch.equal(gtpo_token_advantages(ADV, IDS, MASK, h, ["p", "p"], config=cfg), good)


def test_the_errors_name_responses_and_advantages():
    with pytest.raises(ValueError, match=r"responses must lie in \[0, V\).*flat position 1 holds -7"):
        gtpo_token_advantages(ADV, torch.tensor([[5, -7, 9, 4], [5, 7, 3, 4]]), MASK, H, ["a", "a"])
    ids = IDS.clone()
    ids[0, 3] = -7  # masked out: any value
    assert torch.isfinite(gtpo_token_advantages(ADV, ids, MASK, H, ["a", "a"])).all()
    with pytest.raises(ValueError, match=r"responses must be a \(B, T\) tensor of token ids with B >= 1"):
        gtpo_token_advantages(torch.zeros(0), torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, 3),
                              torch.zeros(0, 3), [])
    adv = ADV[:, None].expand(2, 4).clone()
    adv[1, 2] = float("nan")
    with pytest.raises(ValueError, match="advantages must be finite at counted positions; flat position 6"):
        gtpo_token_advantages(adv, IDS, MASK, H, ["a", "a"])
    adv[1, 2] = -1.0
    adv[0, 3] = float("nan")  # masked out
    assert torch.equal(gtpo_token_advantages(adv, IDS, MASK, H, ["a", "a"]),
                       gtpo_token_advantages(ADV, IDS, MASK, H, ["a", "a"]))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64, "float32"])
def test_conflict_weights_takes_a_floating_dtype(dtype):
    lam, n_conf = conflict_weights(IDS, MASK, ADV, 2, dtype=torch.float64)
    assert lam.dtype == torch.float64 and (lam[MASK.bool()] != 1).any()
    with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype"):
        conflict_weights(IDS, MASK, ADV, 2, dtype=dtype)
