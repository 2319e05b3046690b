"""Spec 13's replay metrics (mean_kept_size, replay_restored_frac, kept_mass) with an invalid input at one
counted token, unvalidated: that token's set means nothing, so the metrics are NaN (spec 13: NaN may spread
to the batch statistics, a finite wrong number never appears), on the logits and on the LM head, on every
backend. Before, they averaged in a made-up set (the rule taken as off, the sampled token alone counted as
restored) or read malformed offsets as they were: 5.0 / 3.5 / 0.0 or 3.33 where every valid set held 4."""
import math

import pytest
import torch

from gtpo_kernels import gtpo_loss, linear_gtpo_loss

B, T, V, D = 2, 3, 10, 6
NAMES = ("mean_kept_size", "replay_restored_frac", "kept_mass")


def _inputs():
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g)
    z = (h @ w.t()).detach()
    return z, h, w, z.argmax(-1), torch.tensor([1.0, -1.0]), torch.full((B, T), -1.0)


def _case(name, z):
    """The call's replay keywords with one invalid value at counted token (1, 1)."""
    if name == "top_k":
        k = torch.full((B, T), 4)
        k[1, 1] = -2
        return dict(top_k=k)
    if name == "top_p":
        p = torch.full((B, T), 0.9)
        p[1, 1] = float("nan")
        return dict(top_p=p)
    if name == "temperature":
        tau = torch.ones(B, T)
        tau[1, 1] = float("nan")
        return dict(top_k=4, temperature=tau)
    sets = torch.sort(z.reshape(B * T, V).topk(4, -1).indices, -1).values.reshape(-1)
    off = torch.arange(B * T + 1) * 4
    if name == "offsets one short":
        return dict(sampling_mask=(sets, off[:-1]))
    sets[5] = sets[4]  # set 1 repeats an id
    return dict(sampling_mask=(sets, off))


@pytest.mark.parametrize("entry", ["logits", "head"])
@pytest.mark.parametrize("backend", ["torch", "triton", "reference"])
@pytest.mark.parametrize("name", ["top_k", "top_p", "temperature", "offsets one short", "duplicate id"])
def test_replay_metrics_are_nan_with_an_invalid_token(entry, backend, name):
    z, h, w, ids, adv, old = _inputs()
    kw = dict(group_size=2, old_logps=old, config="grpo", backend=backend, validate=False, **_case(name, z))
    if entry == "head":
        out = linear_gtpo_loss(h, w, ids, adv, **kw)
    else:
        out = gtpo_loss(z, ids, adv, **kw)
    assert torch.isnan(out.loss)
    got = {k: float(out.metrics[k]) for k in NAMES if k in out.metrics}
    assert got and all(math.isnan(v) for v in got.values()), got
    for key in ("top_k", "top_p", "temperature", "sampling_mask"):  # the same call, valid: finite metrics
        kw.pop(key, None)
    if name in ("top_k", "top_p", "temperature"):
        kw["top_k"] = 4
    else:
        kw["sampling_mask"] = (torch.sort(z.reshape(B * T, V).topk(4, -1).indices, -1).values.reshape(-1),
                               torch.arange(B * T + 1) * 4)
    ok = linear_gtpo_loss(h, w, ids, adv, **kw) if entry == "head" else gtpo_loss(z, ids, adv, **kw)
    assert float(ok.metrics["mean_kept_size"]) == 4.0
