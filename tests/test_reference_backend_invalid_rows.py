"""backend='reference', validate=False (spec 1, 6): a counted row holding NaN or +inf, or giving its own target a
logit of -inf, is invalid input, which the other backends flag (that token's outputs and gradient row NaN, and
what reads it). The reference backend handed such rows to the oracle as they were: its log-prob -inf, its ratio
e^(-inf) = 0, a finite per-token loss (-0.0) and a finite batch loss (-0.4079 in the report's case). It now makes
the row NaN as the others do, with the same NaN pattern in every output and in the gradient."""
import pytest
import torch

import gtpo_kernels as gk

B, T, V = 2, 3, 8


@pytest.mark.parametrize("kind", ["-inf target", "+inf entry", "nan entry"])
@pytest.mark.parametrize("preset", ["grpo", "gtpo", "luspo"])
def test_an_invalid_row_is_nan_on_the_reference_backend_too(kind, preset):
    g = torch.Generator().manual_seed(2)
    z, ids = torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T), generator=g)
    old = -torch.rand(B, T, generator=g) - 1.0
    col = int(ids[0, 1]) if kind == "-inf target" else (int(ids[0, 1]) + 3) % V
    z[0, 1, col] = {"-inf target": float("-inf"), "+inf entry": float("inf"), "nan entry": float("nan")}[kind]
    runs = {}
    for backend in ("torch", "reference"):
        x = z.clone().requires_grad_()
        out = gk.gtpo_loss(x, ids, torch.tensor([1.0, -1.0]), config=preset, group_size=2, old_logps=old,
                           backend=backend, validate=False)
        out.loss.backward()
        runs[backend] = out, x.grad
    (got, ggot), (want, gwant) = runs["reference"], runs["torch"]
    assert torch.isnan(got.loss) and torch.isnan(got.logps[0, 1]) and torch.isfinite(got.logps[1]).all()
    for f in ("logps", "entropy", "per_token_loss"):
        assert torch.equal(torch.isnan(getattr(got, f)), torch.isnan(getattr(want, f))), f
        torch.testing.assert_close(getattr(got, f).nan_to_num(), getattr(want, f).nan_to_num(), rtol=0, atol=1e-5)
    assert torch.isnan(ggot[0, 1]).all() and torch.equal(torch.isnan(ggot), torch.isnan(gwant))
