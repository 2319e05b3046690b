"""The sampler's kept sets across a vocabulary split (spec 12 and 13), on 2 and 3 gloo ranks: gtpo_loss
and token_logprobs with each rank's slice of the logits and a recorded `sampling_mask`, or rules with
`top_k` (each rank's candidates gathered), (both backends on 2 ranks, torch on 3) equal the float64 reference's replay on the whole vocabulary
(values, loss, each slice's gradient, metrics), with a per-token temperature, padded and packed; the merge
moves O(M) bytes whatever the sets' sizes; linear_gtpo_loss and linear_token_logprobs with each rank's
slice of the LM head's rows likewise (hidden's gradient summed over the ranks, head gradients 1e-4); top_p without top_k is refused naming sampling_mask; ranks
passing different sets all raise the same error. Tolerances: spec 7 (values 1e-5, gradient 1e-5 in float32)."""
import math

import pytest
import torch
import torch.distributed as dist

import gtpo_reference as ref
from gloo import progress, run_ranks_ok
from gtpo_kernels import GTPOConfig, gtpo_loss, linear_gtpo_loss, linear_token_logprobs, token_logprobs
from gtpo_reference import gtpo_sampling as rs

V = 41
SPLITS = {2: (0, 17, V), 3: (0, 12, 30, V)}


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().clamp(min=1).max())


def _keep(sm, mask):
    token_ids, offsets = sm
    keep = torch.zeros(*mask.shape, V, dtype=torch.bool)
    for j, (i, t) in enumerate(mask.nonzero().tolist()):
        keep[i, t, token_ids[offsets[j]:offsets[j + 1]]] = True
    keep[~mask] = True
    return keep


def _scenarios(rank, world):
    g = torch.Generator().manual_seed(11)
    B, T = 4, 5
    x = torch.randn(B, T, V, generator=g) * 2
    x[..., 20:23] += 3.0  # a peaked head, across the slices' boundaries
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    tau = (torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5).float()
    cut = SPLITS[world]
    sl = slice(cut[rank], cut[rank + 1])
    cfg = GTPOConfig(entropy_threshold=None, entropy_coef=0.01)
    rules = dict(top_k=8, top_p=0.9, min_p=0.02)
    rlp, rent, rmet, sm = rs.replay_token_logprobs(x.double(), ids, mask, temperature=tau.double(), **rules)
    old = torch.where(mask, rlp + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64), 0.0).float()
    xr = x.double().requires_grad_()
    zk = torch.where(_keep(sm, mask), xr, float("-inf")) / tau.double()[..., None]
    r = ref.gtpo_loss(zk, ids, adv, mask, group_size=2, old_logps=old.double(), **(cfg.__dict__ | {"temperature": 1.0}))
    r["loss"].backward()
    res = {}
    backends = ("torch", "triton") if world == 2 else ("torch",)  # (3 ranks: the merge's logic, at less cost)
    for backend in backends:
        for how, kw in (("mask", dict(sampling_mask=sm)), ("rules", rules)):
            for packed in (False, True):
                key = f"{backend}/{how}/{'packed' if packed else 'padded'}"
                progress(key)
                xs, i, t, o, m, kk = x[..., sl], ids, tau, old, mask, kw
                form = dict()
                if packed:  # every token counted, completions of T
                    if how == "mask":
                        continue  # (the padded mask's sets are for the counted tokens only)
                    xs, i, t, o = x[..., sl].reshape(B * T, -1), ids.reshape(-1), tau.reshape(-1), old.reshape(-1)
                    m, form = None, dict(cu_seqlens=torch.arange(0, B * T + 1, T), max_seqlen=T)
                part = xs.clone().requires_grad_()
                out = gtpo_loss(part, i, adv, m, group_size=2, old_logps=o, temperature=t, config=cfg,
                                backend=backend, process_group=dist.group.WORLD, **form, **kk)
                out.loss.backward()
                if packed:
                    one = x.reshape(B * T, V).clone().requires_grad_()
                    base = gtpo_loss(one, i, adv, group_size=2, old_logps=o, temperature=t, config=cfg,
                                     backend="torch", **form, **kk)
                    base.loss.backward()
                    res[key] = {"loss": _rel(out.loss.detach(), base.loss.detach()),
                                "logps": _rel(out.logps, base.logps),
                                "grad": float((part.grad - one.grad[..., sl]).norm() / one.grad.norm())}
                    continue
                res[key] = {"loss": _rel(out.loss.detach(), r["loss"].detach()), "logps": _rel(out.logps, r["logps"]),
                            "entropy": _rel(out.entropy, r["entropy"]),
                            "grad": float((part.grad - xr.grad[..., sl]).norm() / xr.grad.norm()),
                            "outside": float(part.grad[~_keep(sm, mask)[..., sl] & mask[..., None]].abs().sum()),
                            "mean_kept_size": abs(float(out.metrics["mean_kept_size"]) - float(rmet["mean_kept_size"]))}
                if how == "rules":
                    res[key]["kept_mass"] = abs(float(out.metrics["kept_mass"]) - float(rmet["kept_mass"]))
        for how, kw in (("mask", dict(sampling_mask=sm)), ("rules", rules)):
            lp, h = token_logprobs(x[..., sl], ids, tau, mask, backend=backend, process_group=dist.group.WORLD, **kw)
            res[f"{backend}/{how}/token_logprobs"] = {"logps": _rel(lp, rlp), "entropy": _rel(h, rent)}
    D = 6  # the LM head: each rank holds its slice of the head's rows; only the union's ids in it projected
    h = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64)
    w[20:23] += 1.5 * h.mean((0, 1)) / h.mean((0, 1)).norm()
    zh = h @ w.t()
    hlp, hent, hmet, hsm = rs.replay_token_logprobs(zh, ids, mask, temperature=tau.double(), **rules)
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    zk = torch.where(_keep(hsm, mask), hr @ wr.t(), float("-inf")) / tau.double()[..., None]
    hold = torch.where(mask, hlp + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64), 0.0).float()
    rh = ref.gtpo_loss(zk, ids, adv, mask, group_size=2, old_logps=hold.double(),
                       **(cfg.__dict__ | {"temperature": 1.0}))
    rh["loss"].backward()
    for backend in backends:
        for how, kw in (("mask", dict(sampling_mask=hsm)), ("rules", rules)):
            key = f"head/{backend}/{how}"
            progress(key)
            hp, wp = h.float().requires_grad_(), w[sl].float().requires_grad_()
            out = linear_gtpo_loss(hp, wp, ids, adv, mask, group_size=2, old_logps=hold, temperature=tau, config=cfg,
                                   memory_budget=3 * 2 * V * 4, backend=backend, process_group=dist.group.WORLD, **kw)
            out.loss.backward()
            dh = hp.grad.clone()
            dist.all_reduce(dh)  # hidden's gradient: each rank's slice contributes (Megatron sums it)
            res[key] = {"loss": _rel(out.loss.detach(), rh["loss"].detach()), "logps": _rel(out.logps, rh["logps"]),
                        "entropy": _rel(out.entropy, rh["entropy"]),
                        "grad hidden": float((dh - hr.grad).norm() / hr.grad.norm()),
                        "grad weight": float((wp.grad - wr.grad[sl]).norm() / wr.grad.norm()),
                        "mean_kept_size": abs(float(out.metrics["mean_kept_size"]) - float(hmet["mean_kept_size"]))}
            if how == "rules":  # the full normalizer merged over the split
                res[key]["kept_mass"] = abs(float(out.metrics["kept_mass"]) - float(hmet["kept_mass"]))
            lp, ent = linear_token_logprobs(h.float(), w[sl].float(), ids, tau, mask, memory_budget=2 * 2 * V * 4,
                                            backend=backend, process_group=dist.group.WORLD, **kw)
            res[f"{key}/linear_token_logprobs"] = {"logps": _rel(lp, hlp), "entropy": _rel(ent, hent)}
    for backend in ("torch", "triton"):  # one counted token's top_k invalid, unvalidated: the metrics NaN
        k = torch.full((B, T), 5)
        k[tuple(mask.nonzero()[0].tolist())] = -2
        out = gtpo_loss(x[..., sl], ids, adv, mask, group_size=2, config=cfg, backend=backend, validate=False,
                        process_group=dist.group.WORLD, top_k=k)
        finite = [n for n in ("mean_kept_size", "kept_mass") if not torch.isnan(out.metrics[n])]
        res[f"{backend}/invalid top_k, unvalidated"] = {"finite metrics": float(len(finite))}
        # min_p 1 (vLLM's upper end) keeps the entries tied at the maximum, one of them in each of two slices
        xt = x.clone()
        xt[0, :, [3, V - 2]] = x.abs().max() + 1.0
        it = ids.clone()
        it[0] = torch.tensor([3, V - 2] * T)[:T]
        lp, h = token_logprobs(xt[..., sl], it, 1.0, mask, backend=backend, process_group=dist.group.WORLD, top_k=5,
                               min_p=1.0)
        res[f"{backend}/min_p 1"] = {"logp": abs(float(lp[0, 0]) + math.log(2.0)), "entropy": abs(float(h[0, 0]) -
                                                                                                  math.log(2.0))}
        # the config's 0-d temperature set in place to -1 since: refused by that name on every rank
        sched = torch.tensor(0.9)
        changed = GTPOConfig(temperature=sched, entropy_threshold=None)
        sched.fill_(-1.0)
        try:
            gtpo_loss(x[..., sl], ids, adv, mask, group_size=2, config=changed, backend=backend,
                      process_group=dist.group.WORLD, top_k=4)
            res[f"{backend}/schedule -1"] = "accepted"
        except ValueError as e:
            res[f"{backend}/schedule -1"] = str(e)
    progress("refusals")
    for name, kw in (("no top_k", dict(top_p=0.9)), ("disagree", None)):
        if kw is None:  # one rank drops an id from one set: the ranks' sets differ
            tid, off = sm
            kw = dict(sampling_mask=(tid, off) if rank == 0 else (tid.flip(0), off))
        try:
            gtpo_loss(x[..., sl], ids, adv, mask, group_size=2, config=cfg, backend="torch",
                      process_group=dist.group.WORLD, **kw)
            res[name] = "accepted"
        except ValueError as e:  # the collective error, with the failing rank's own chained
            res[name] = f"{e} | {e.__cause__}"

    return res


@pytest.mark.parametrize("world", [2, 3])
def test_replay_across_a_vocabulary_split(world):
    ranks = run_ranks_ok(_scenarios, world, watchdog=180)
    for r, res in enumerate(ranks):
        for key, errs in res.items():
            if key in ("no top_k", "disagree") or key.endswith("schedule -1"):
                continue
            for what, err in errs.items():
                tol = 0.0 if what == "outside" else (1e-6 if what in ("mean_kept_size", "kept_mass") else
                                                     1e-4 if what.startswith("grad ") else 1e-5)
                assert err <= tol, f"rank {r}, {key}: {what} off by {err:.2e}"
    for name, want in (("no top_k", "need top_k as well"), ("disagree", "disagree on sampling_mask"),
                       ("torch/schedule -1", "GTPOConfig.temperature must be > 0"),
                       ("triton/schedule -1", "GTPOConfig.temperature must be > 0")):
        said = [res[name] for res in ranks]
        assert all(s == said[0] for s in said) and want in said[0], (name, said)
