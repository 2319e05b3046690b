"""clip_cov on a vocabulary split (spec 12: nothing decided per rank after the agreement may differ): its
random choice of tokens draws from each rank's generator, so the agreement compares the generators' state.
On 2 gloo ranks (the torch and Triton backends, the LM head too): generators seeded per rank (the default
one, or GTPOConfig.generator) make every rank raise the same error, and draw nothing; seeded alike, every
rank returns the single-process loss and its slice of the single-process gradient. (Before, each rank chose
its own tokens silently: two losses, and a gradient that matched no single-process one.)"""
import pytest
import torch
import torch.distributed as dist

from gloo import run_ranks_ok
from gtpo_kernels import GTPOConfig, gtpo_loss, linear_gtpo_loss

SIZES = [7, 6]
B, T, V, D = 4, 6, 13, 5
TEXT = "clip_cov's random generator's state"


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, V, generator=g) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.tensor([1.5, -1.0, 0.5, -2.0])
    old = torch.full((B, T), -2.0) + 0.05 * torch.randn(B, T, generator=g)
    h, w = torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g)
    return x, ids, adv, old, h, w


def _config(gen=None):
    return GTPOConfig.preset("clip_cov", clip_cov_ratio=0.25, clip_cov_lb=-10.0, clip_cov_ub=10.0, generator=gen)


def _call(x, ids, adv, old, cfg, backend, pg=None):
    x = x.clone().requires_grad_()
    out = gtpo_loss(x, ids, adv, group_size=2, old_logps=old, config=cfg, backend=backend, process_group=pg)
    out.loss.backward()
    return float(out.loss), x.grad


def _run(rank, world):
    x, ids, adv, old, h, w = _data()
    sl = slice(sum(SIZES[:rank]), sum(SIZES[:rank + 1]))
    pg, res = dist.group.WORLD, {}
    for backend in ("torch", "triton"):
        for how in ("default", "explicit"):
            gen = torch.Generator().manual_seed(100 + rank) if how == "explicit" else None
            if gen is None:
                torch.manual_seed(100 + rank)
            state = (gen or torch.default_generator).get_state()
            try:
                _call(x[..., sl], ids, adv, old, _config(gen), backend, pg)
                res[f"{backend}/{how}"] = "no error"
            except ValueError as e:
                res[f"{backend}/{how}"] = str(e)
            res[f"{backend}/{how}/untouched"] = torch.equal(state, (gen or torch.default_generator).get_state())
        loss, grad = _call(x[..., sl], ids, adv, old, _config(torch.Generator().manual_seed(7)), backend, pg)
        one, grad1 = _call(x, ids, adv, old, _config(torch.Generator().manual_seed(7)), backend)
        res[f"{backend}/alike"] = (loss, one, float((grad - grad1[..., sl]).abs().max()), float(grad.abs().sum()))
    try:  # the LM head (the recompute schedule: the term spans the batch)
        linear_gtpo_loss(h, w[sl], ids, adv, group_size=2, old_logps=old, backend="triton", process_group=pg,
                         config=_config(torch.Generator().manual_seed(100 + rank)))
        res["head"] = "no error"
    except ValueError as e:
        res["head"] = str(e)
    return res


@pytest.fixture(scope="module")
def results():
    return run_ranks_ok(_run, 2, watchdog=180)


def test_generators_in_different_states_are_refused_on_every_rank(results):
    for key in ("torch/default", "torch/explicit", "triton/default", "triton/explicit", "head"):
        texts = [r[key] for r in results]
        assert texts[0] == texts[1] and TEXT in texts[0] and "rank(s) [0, 1]" in texts[0], (key, texts)
    for key in ("torch/default", "torch/explicit", "triton/default", "triton/explicit"):
        assert all(r[f"{key}/untouched"] for r in results), key  # refused before any draw


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_generators_seeded_alike_give_the_single_process_loss_on_every_rank(results, backend):
    (l0, one0, d0, s0), (l1, one1, d1, s1) = (r[f"{backend}/alike"] for r in results)
    assert l0 == l1 and one0 == one1 and abs(l0 - one0) <= 1e-5 * abs(one0), (l0, l1, one0)
    assert max(d0, d1) <= 1e-5 and s0 > 0 and s1 > 0, (d0, d1, s0, s1)
