"""The sampler's rules given as numbers (spec 13): decided in the logits' precision on every backend, as a
tensor of the same values is (a float32 cut for float32 logits, whichever backend); a top_k past any
vocabulary keeps every entry; a bool is refused naming the rule."""
import numpy as np
import pytest
import torch

import gtpo_kernels as gk

BACKENDS = ("torch", "triton", "reference")


def _tied_row(dtype):
    """Ten tied logits and two at -inf: each kept entry holds exactly 1/10 of the mass, so top_p = 0.9's cut
    1 - 0.9 lies on the first cumulative mass in float64 (kept) and just below it in float32 (dropped)."""
    return torch.tensor([0.0] * 10 + [float("-inf")] * 2, dtype=dtype).reshape(1, 1, 12)


@pytest.mark.parametrize("dtype, size", [(torch.float32, 9), (torch.float64, 10)])
def test_a_number_rule_is_a_tensor_rule_on_every_backend(dtype, size):
    x, ids = _tied_row(dtype), torch.tensor([[5]])
    for backend in BACKENDS:
        if backend == "triton" and dtype == torch.float64:
            continue  # (refused: float64 logits take the torch or reference backend)
        got = {}
        for how, top_p in (("number", 0.9), ("tensor", torch.tensor([0.9], dtype=torch.float64))):
            out = gk.gtpo_loss(x, ids, torch.tensor([1.0]), config="grpo", backend=backend, top_p=top_p)
            lp, _ = gk.token_logprobs(x, ids, 1.0, backend=backend, top_p=top_p)
            got[how] = (float(out.metrics["mean_kept_size"]), float(out.logps), float(lp))
        assert got["number"] == got["tensor"], (backend, got)
        assert got["number"][0] == size, (backend, got)  # the cut in the logits' precision
        assert abs(got["number"][2] + torch.log(torch.tensor(float(size), dtype=torch.float64)).item()) < 1e-6


@pytest.mark.parametrize("top_k", [2 ** 63, 2 ** 70])
def test_a_top_k_past_every_vocabulary_keeps_every_entry(top_k):
    g = torch.Generator().manual_seed(3)
    x, ids = torch.randn(2, 3, 7, generator=g), torch.randint(0, 7, (2, 3), generator=g)
    for backend in BACKENDS:
        lp, ent = gk.token_logprobs(x, ids, 0.8, backend=backend, top_k=top_k)
        full, ent_full = gk.token_logprobs(x, ids, 0.8, backend=backend)
        torch.testing.assert_close(lp, full, rtol=0, atol=1e-6)
        torch.testing.assert_close(ent, ent_full, rtol=0, atol=1e-6)


@pytest.mark.parametrize("rule", ["top_k", "top_p", "min_p"])
@pytest.mark.parametrize("true", [True, np.bool_(True)])
def test_a_bool_rule_is_refused_by_name(rule, true):
    x, ids = torch.randn(1, 2, 5), torch.tensor([[1, 2]])
    with pytest.raises(TypeError, match=rf"^{rule} must be an? (int|float) or a tensor of them, got (np\.)?True_?$"):
        gk.token_logprobs(x, ids, 1.0, backend="torch", **{rule: true})


def test_the_ambiguous_packed_shape_says_what_to_pass():
    from gtpo_kernels.core.sampling import per_token
    with pytest.raises(ValueError, match=r"one per completion as a \(2, 1\) tensor"):
        per_token("top_p", torch.tensor([0.9, 0.8]), 2, None, 2, torch.device("cpu"), cu_seqlens=torch.tensor([0, 1, 2]))
