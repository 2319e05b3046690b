"""Spec 13: unvalidated, an invalid recorded set (one that lacks its sampled id, repeats an id or holds one out
of range) makes the affected token's outputs NaN, and what reads that token (its completion's terms, the loss):
the other tokens' log-probs and entropies stay finite, and they, the gradient (NaN where the oracle's is) and
the batch's clip fraction equal the float64 oracle's on every backend (the oracle once spread the token's NaN entropy
through its shaping, 0 * NaN, to its completion's advantage)."""
import pytest
import torch

import gtpo_kernels as gk

B, T, V = 4, 3, 8
BAD = 4  # the flat index of the token whose set is invalid


def _batch():
    g = torch.Generator().manual_seed(0)
    z, ids = torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T), generator=g)
    old = -torch.rand(B, T, generator=g) - 0.5  # off policy: some ratios clipped
    return z, ids, torch.tensor([1.0, -1.0, 0.5, -0.5]), old


def _sets(ids, kind):
    sets = [[int(y), (int(y) + 1) % V, (int(y) + 3) % V] for y in ids.reshape(-1)]
    y = int(ids.reshape(-1)[BAD])
    sets[BAD] = {"missing": [(y + 1) % V], "repeated": sets[BAD] + [sets[BAD][1]], "range": sets[BAD] + [V + 3]}[kind]
    return torch.tensor([v for s in sets for v in s]), torch.tensor([0] + [len(s) for s in sets]).cumsum(0)


@pytest.mark.parametrize("kind", ["missing", "repeated", "range"])
@pytest.mark.parametrize("preset", ["grpo", "gtpo", "gtpo-penalty-0"])
def test_an_invalid_recorded_set_is_nan_at_its_token_alone(kind, preset):
    """gtpo-penalty-0: the shaping's gamma a 0-d tensor 0 (a schedule at 0) spreads the token's NaN entropy no
    more than the number 0 does (torch and Triton once formed A - 0 * NaN)."""
    if preset == "gtpo-penalty-0":
        preset = gk.GTPOConfig.preset("gtpo", entropy_penalty=torch.tensor(0.0))
    z, ids, adv, old = _batch()
    sm = _sets(ids, kind)
    hit = torch.zeros(B * T, dtype=torch.bool)
    hit[BAD] = True
    runs = {}
    for backend in ("reference", "torch", "triton"):
        x = z.clone().requires_grad_()
        out = gk.gtpo_loss(x, ids, adv, config=preset, group_size=2, old_logps=old, backend=backend, validate=False,
                           sampling_mask=sm)
        out.loss.backward()
        assert torch.isnan(out.loss) and torch.isnan(out.metrics["mean_kept_size"]), backend
        for f in ("logps", "entropy"):
            v = getattr(out, f).reshape(-1)
            assert torch.isnan(v[hit]).all() and torch.isfinite(v[~hit]).all(), (backend, f)
        runs[backend] = out, x.grad.reshape(B * T, V)
    (ref, rgrad) = runs["reference"]
    assert rgrad[~hit].nan_to_num().abs().sum() > 0
    for backend in ("torch", "triton"):
        out, grad = runs[backend]
        for f in ("logps", "entropy"):
            torch.testing.assert_close(getattr(out, f).reshape(-1)[~hit].double(),
                                       getattr(ref, f).reshape(-1)[~hit].double(), rtol=0, atol=1e-5)
        assert float(out.metrics["clip_frac"]) == pytest.approx(float(ref.metrics["clip_frac"]), abs=1e-6), backend
        # the other tokens' gradient rows: NaN where the oracle's are (gtpo: the token's completion, whose shaped
        # advantage reads its entropy; grpo: none), else equal
        assert torch.equal(grad[~hit].isnan().any(-1), rgrad[~hit].isnan().any(-1)), backend
        both = torch.isfinite(grad) & torch.isfinite(rgrad)
        assert (both[~hit].all(-1) | rgrad[~hit].isnan().any(-1)).all(), backend
        torch.testing.assert_close(grad[both].double(), rgrad[both].double(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("form", ["recorded", "top_k"])
def test_the_top_entropy_quantile_reads_the_nan_of_an_invalid_token(form):
    """The quantile spans every counted entropy: with one NaN among them (an invalid set or rule, unvalidated)
    every counted token's mask, so its per-token loss, is NaN on every backend, the oracle's included (the
    kernels took the threshold from the finite entropies, the oracle kept no token: two finite answers)."""
    z, ids, adv, old = _batch()
    top_k = torch.full((B, T), 3)
    top_k.view(-1)[BAD] = -7
    kw = dict(sampling_mask=_sets(ids, "missing")) if form == "recorded" else dict(top_k=top_k)
    cfg = gk.GTPOConfig.preset("grpo", top_entropy_quantile=0.5, loss_agg="none")
    for backend in ("reference", "torch", "triton"):
        out = gk.gtpo_loss(z, ids, adv, config=cfg, group_size=2, old_logps=old, backend=backend, validate=False, **kw)
        assert torch.isnan(out.per_token_loss).all(), (backend, out.per_token_loss)
