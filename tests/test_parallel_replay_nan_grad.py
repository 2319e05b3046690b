"""Unvalidated invalid input over the sampler's kept sets on a vocabulary split (spec 6, 12, 13): a malformed
cu_seqlens, or a sampled id outside the vocabulary, made the loss NaN but each rank's logits gradient exactly
0 (the merged log-probs were set NaN by a select, which passes no gradient): a finite wrong number. The NaN
coefficient now reaches the token's kept entries of each slice, as on one process, and a valid batch's
gradient is unchanged."""
import torch
import torch.distributed as dist

from gloo import run_ranks_ok

V, B, T = 23, 4, 5
CU = [0, 5, 10, 15, 20]


def _checks(rank, world):
    from gtpo_kernels import gtpo_loss
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B * T, V, generator=g) * 2
    ids = torch.randint(0, V, (B * T,), generator=g)
    old = -torch.rand(B * T, generator=g) - 1
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    sl = slice(0, 9) if rank == 0 else slice(9, V)
    bad_ids = ids.clone()
    bad_ids[3] = V + 4
    top = torch.topk(x, 6).indices
    sets = [sorted(set(top[i].tolist()) | {int(ids[i])}) for i in range(B * T)]
    recorded = (torch.tensor([a for q in sets for a in q]), torch.tensor([0] + [len(q) for q in sets]).cumsum(0))
    res = {}
    cases = (("malformed", [0, 12, 10, 15, 20], ids, dict(sampling_mask=recorded)),
             ("bad id", CU, bad_ids, dict(top_k=5)), ("valid", CU, ids, dict(sampling_mask=recorded)),
             ("valid top_k", CU, ids, dict(top_k=5)))
    for case, cu, y, kw in cases:
        for backend in ("torch", "triton"):
            grads, losses = [], []
            for grp in (None, dist.group.WORLD):
                z = (x if grp is None else x[:, sl]).clone().requires_grad_()
                out = gtpo_loss(z, completion_ids=y, advantages=adv, old_logps=old, cu_seqlens=torch.tensor(cu),
                                group_size=2, config="grpo", backend=backend, validate=False, process_group=grp, **kw)
                out.loss.backward()
                grads.append(z.grad if grp is not None else z.grad[:, sl])
                losses.append(float(out.loss))
            one, split = grads
            res[f"{case} {backend}"] = dict(
                same_nan=torch.equal(torch.isnan(one), torch.isnan(split)), nan=int(torch.isnan(split).sum()),
                diff=float((one.nan_to_num(0) - split.nan_to_num(0)).abs().max()),
                nonzero=int(((split != 0) & ~torch.isnan(split)).sum()), losses=losses)
    return res


def test_a_nan_coefficient_reaches_the_split_gradient():
    for rank, res in enumerate(run_ranks_ok(_checks, 2)):
        for key, r in res.items():
            assert r["same_nan"] and r["diff"] <= 1e-6, (rank, key, r)
            if key.startswith("valid"):
                assert r["nan"] == 0 and r["nonzero"] > 0 and r["losses"][0] == r["losses"][0], (rank, key, r)
            else:  # the loss NaN and the gradient NaN where one process's is: never 0 in its place
                assert r["nan"] > 0 and all(x != x for x in r["losses"]), (rank, key, r)
        assert res["malformed torch"]["nonzero"] == 0, res["malformed torch"]
