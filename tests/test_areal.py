"""GTPO with AReaL's own code (skipped without AReaL; CI installs it `--no-deps` with what the tested
modules import, in an environment of its own: AReaL pins torch<2.11). On a packed micro-batch in AReaL's
layout (log-probs of input_ids rolled by one, rolled loss_mask, cu_seqlens), `make_loss_fn`'s loss equals
AReaL's stock `grpo_loss_fn` (float32: AReaL's stats tracker refuses float64; value and gradient) with GTPO's options off; with them on, the
conflict weights computed at advantage time travel in the data (`gtpo_lam`) and the entropies AReaL
passes reach the filter: equal to gtpo_loss_from_logps on the same completions. (The loss functions are
called as AReaL's engine calls them, `loss_fn(logprobs, entropy, mb_input)`; the engine itself needs a
GPU model and is not driven here.)"""
from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("areal.trainer.ppo.actor")

from areal.trainer.ppo.actor import grpo_loss_fn  # noqa: E402
from gtpo_kernels import GTPOConfig, gtpo_loss_from_logps  # noqa: E402
from gtpo_kernels.integrations import areal as ga  # noqa: E402


def _batch(g, n_groups=2, group_size=3, V=4):
    """Padded rows prompt + completion (AReaL's rollout layout), advantages one value per row at the
    rolled loss_mask, then the packed micro-batch (1-D, cu_seqlens) of the same rows."""
    B = n_groups * group_size
    P = [int(torch.randint(2, 4, (1,), generator=g)) for _ in range(B)]
    C = [int(torch.randint(2, 6, (1,), generator=g)) for _ in range(B)]
    T = max(p + c for p, c in zip(P, C))
    ids = torch.zeros(B, T, dtype=torch.long)
    lm = torch.zeros(B, T)
    for i in range(B):
        ids[i, :P[i] + C[i]] = torch.randint(0, V, (P[i] + C[i],), generator=g)
        lm[i, P[i]:P[i] + C[i]] = 1
    lm = torch.roll(lm, -1, dims=-1)  # as AReaL's advantage step rolls it
    adv = torch.randn(B, generator=g, dtype=torch.float64)[:, None] * lm.double()
    data = {"input_ids": ids, "loss_mask": lm, "advantages": adv}
    return data, P, C


def _pack(data, P, C, g, dt=torch.float64):
    lens = [p + c for p, c in zip(P, C)]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    mb = {k: torch.cat([v[i, :n] for i, n in enumerate(lens)]) for k, v in data.items()}
    mb["cu_seqlens"] = cu
    N = int(cu[-1])
    mb["advantages"] = mb["advantages"].to(dt)
    mb["logprobs"] = -torch.rand(N, generator=g, dtype=dt) * 2
    mb["prox_logp"] = mb["logprobs"].clone()
    logp = (mb["logprobs"] + 0.4 * torch.randn(N, generator=g, dtype=dt)).requires_grad_(True)
    ent = torch.rand(N, generator=g, dtype=dt) * 2
    return mb, logp, ent


def test_loss_fn_equals_arealss_grpo_loss_fn():
    g = torch.Generator().manual_seed(6)
    data, P, C = _batch(g)
    mb, logp, ent = _pack(data, P, C, g, torch.float32)  # AReaL's stats tracker takes float32 only
    loss_fn, weight_fn = ga.make_loss_fn(eps_clip=0.2, eps_clip_higher=0.28, config="grpo")
    ours = loss_fn(logp, ent, mb)
    (g1,) = torch.autograd.grad(ours, logp)
    stock_fn = functools.partial(grpo_loss_fn, eps_clip=0.2, eps_clip_higher=0.28, c_clip=None)
    stock = stock_fn(logp, ent, dict(mb, loss_mask=mb["loss_mask"].bool()))
    (g2,) = torch.autograd.grad(stock, logp)
    assert g2.abs().sum() > 0
    assert abs(float(ours) - float(stock)) <= 1e-6 * max(1.0, abs(float(stock)))
    torch.testing.assert_close(g1, g2, atol=1e-6, rtol=1e-5)
    assert int(weight_fn(mb)) == int(mb["loss_mask"].count_nonzero())  # AReaL's own weight for token-mean


@pytest.mark.parametrize("c_clip", [3.0, 1.5])
def test_dual_clip_equals_areals(c_clip):
    """make_loss_fn(c_clip=) = AReaL's grpo_loss_fn with the same c_clip, with ratios where it binds."""
    g = torch.Generator().manual_seed(int(c_clip * 10))
    data, P, C = _batch(g)
    mb, logp, ent = _pack(data, P, C, g, torch.float32)
    with torch.no_grad():  # negative advantages and ratios far above c_clip on the first tokens
        mb["advantages"] = -mb["advantages"].abs() - 0.5  # per completion still: one value each
        logp[:40] = mb["prox_logp"][:40] + 2.0
    loss_fn, _ = ga.make_loss_fn(eps_clip=0.2, eps_clip_higher=0.28, config="grpo", c_clip=c_clip)
    ours = loss_fn(logp, ent, mb)
    (g1,) = torch.autograd.grad(ours, logp)
    stock = functools.partial(grpo_loss_fn, eps_clip=0.2, eps_clip_higher=0.28, c_clip=c_clip)(
        logp, ent, dict(mb, loss_mask=mb["loss_mask"].bool()))
    (g2,) = torch.autograd.grad(stock, logp)
    plain = functools.partial(grpo_loss_fn, eps_clip=0.2, eps_clip_higher=0.28, c_clip=None)(
        logp, ent, dict(mb, loss_mask=mb["loss_mask"].bool()))
    assert abs(float(plain) - float(stock)) > 1e-3  # the dual clip binds
    assert abs(float(ours) - float(stock)) <= 1e-6 * max(1.0, abs(float(stock)))
    torch.testing.assert_close(g1, g2, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="c_clip must be a number > 1"):
        ga.make_loss_fn(c_clip=0.5)


def test_conflict_weights_and_entropies_reach_the_loss():
    g = torch.Generator().manual_seed(9)
    data, P, C = _batch(g)
    ga.add_conflict_weights(data, group_size=3, config="gtpo")
    mb, logp, ent = _pack(data, P, C, g)
    cfg = GTPOConfig.preset("gtpo", entropy_threshold=1.0, eps_high=0.28)
    loss_fn, _ = ga.make_loss_fn(eps_clip=0.2, eps_clip_higher=0.28, config=cfg)
    ours = loss_fn(logp, ent, mb)
    (g1,) = torch.autograd.grad(ours, logp)
    # the same completions, left-aligned (B, Cmax), conflict weights computed by the package from the groups
    B, Cm = len(C), max(C)
    ids = torch.zeros(B, Cm, dtype=torch.long)
    m = torch.zeros(B, Cm, dtype=torch.bool)
    lp = torch.zeros(B, Cm, dtype=torch.float64)
    old = torch.zeros(B, Cm, dtype=torch.float64)
    H = torch.zeros(B, Cm, dtype=torch.float64)
    starts = mb["cu_seqlens"][:-1].tolist()
    rows = []
    for i in range(B):
        s = starts[i] + P[i] - 1  # position predicting the first completion token
        sl = slice(s, s + C[i])
        ids[i, :C[i]] = data["input_ids"][i, P[i]:P[i] + C[i]]
        m[i, :C[i]] = True
        old[i, :C[i]], H[i, :C[i]] = mb["prox_logp"][sl], ent[sl]
        rows.append(sl)
    lp = torch.stack([torch.cat([logp[sl], logp.new_zeros(Cm - C[i])]) for i, sl in enumerate(rows)])
    adv = data["advantages"].sum(1) / data["loss_mask"].sum(1).double()
    want = gtpo_loss_from_logps(lp, ids, adv, m, entropy=H, old_logps=old, group_size=3,
                                config=cfg.replace(eps_low=0.2, loss_agg="token-mean"))
    (g2,) = torch.autograd.grad(want.loss, logp)
    lam = data["gtpo_lam"]
    assert ((lam != 1) & data["loss_mask"].bool()).any(), "no conflict token: the test would not see the weights"
    hbar = torch.stack([H[i, :C[i]].mean() for i in range(B)])
    assert (hbar > 1.0).any() and (hbar < 1.0).any(), "the entropy filter must keep some completions, drop others"
    assert g2.abs().sum() > 0
    assert abs(float(ours) - float(want.loss)) <= 1e-6 * max(1.0, abs(float(want.loss)))
    torch.testing.assert_close(g1, g2, atol=1e-6, rtol=1e-6)
