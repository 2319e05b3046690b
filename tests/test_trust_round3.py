"""Defects of the third trust round (issue: the sampler's rules and the head's replay), each pinned by a test
that failed before its fix: float64 rule tensors compared in float64 (spec 13), kept_mass without a
gradient."""
import math

import pytest
import torch

from gtpo_kernels import gtpo_loss, token_logprobs


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_float64_top_p_tensor_is_compared_in_float64(backend):
    """top_p given as a float64 tensor on float64 logits keeps the set the same number given as a Python
    float keeps, also with a cut 1e-8 from the boundary (it was rounded to float32 first: another set)."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    logits = torch.log(p).reshape(1, 1, 3).repeat(2, 2, 1)
    ids = torch.zeros(2, 2, dtype=torch.long)
    top_p = 0.8 - 1e-8  # 1 - top_p just above 0.2: the 0.2 token removed (float32 rounds top_p up to 0.8000000119)
    as_number, _ = token_logprobs(logits, ids, 1.0, top_p=top_p, backend=backend)
    as_tensor, _ = token_logprobs(logits, ids, 1.0, top_p=torch.full((2,), top_p, dtype=torch.float64),
                                  backend=backend)
    assert torch.allclose(as_number, torch.full((2, 2), math.log(0.5 / 0.8), dtype=torch.float64), atol=1e-12), as_number
    assert torch.equal(as_tensor, as_number), (as_tensor, as_number)


def test_kept_mass_has_no_gradient():
    """metrics['kept_mass'] is detached like every other metric (it required grad with rebuilt sets)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 3, 12, generator=g, requires_grad=True)
    ids = torch.randint(0, 12, (4, 3), generator=g)
    out = gtpo_loss(logits, ids, torch.randn(4, generator=g), group_size=2, config="grpo", top_k=4, top_p=0.9,
                    backend="torch")
    assert not out.metrics["kept_mass"].requires_grad
    assert 0 < float(out.metrics["kept_mass"]) <= 1
