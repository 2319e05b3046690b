"""Spec 13 across a vocabulary split: ties at the top_k-th value are judged after min-p. With z = [5, 0 x 11]
split 7 / 5, top_k = 3 and min_p = 0.5 keep {0} on one process (min-p removes every 0); the split refused it
on every rank ("exact ties at a token's top_k-th value are split across ranks"). A tie min-p keeps is still
refused (the candidates cannot show it)."""
import torch
import torch.distributed as dist

from gloo import run_ranks_ok
from gtpo_kernels import token_logprobs

SPLIT = [7, 5]


def _logits():
    z = torch.zeros(1, 2, 12)
    z[..., 0] = 5.0
    return z


def _scenarios(rank, world):
    z = _logits()
    sl = slice(sum(SPLIT[:rank]), sum(SPLIT[:rank + 1]))
    ids = torch.zeros(1, 2, dtype=torch.long)
    out = {}
    for name, kw in (("min_p removes the tie", dict(top_k=3, min_p=0.5)), ("min_p keeps the tie", dict(top_k=3))):
        try:
            lp, ent = token_logprobs(z[..., sl].contiguous(), ids, 1.0, backend="torch", process_group=dist.group.WORLD,
                                     **kw)
            out[name] = lp.tolist()
        except ValueError as e:
            out[name] = f"refused: {e}"
    return out


def test_ties_are_judged_after_min_p():
    ranks = run_ranks_ok(_scenarios, 2, watchdog=120)
    one, _ = token_logprobs(_logits(), torch.zeros(1, 2, dtype=torch.long), 1.0, backend="torch", top_k=3, min_p=0.5)
    assert one.abs().max() == 0  # K = {0}: log 1
    for r in ranks:
        assert r["min_p removes the tie"] == one.tolist(), r
        assert r["min_p keeps the tie"].startswith("refused") and "ties" in r["min_p keeps the tie"], r
