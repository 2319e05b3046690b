"""Per-rank differences in every input and option (spec 12), with 2 and 3 gloo processes: what the ranks
may pass differently and what they may not. The same value in another representation (`1`, `1.0`,
`tensor(1.0)`; int32 or int64 ids; a bool or float mask; (B,) or (B, 1) advantages), different
`requires_grad`, an empty vocabulary slice and a data-parallel rank with no rows are accepted: every
rank returns the same loss and log-probs, equal to the single-process float64 reference, and each
rank's gradient is its slice of the reference's. A real difference (an option, a per-token or
per-completion input, `cu_seqlens` around a masked-out token, `max_seqlen`, a DTensor with a second
group on one rank) is refused by every rank with the same error. Every case runs in one spawned group
per world size (tests/gloo.py); a rank that raised waits, alive, at a barrier outside torch.distributed
so that a peer stuck in a collective shows as a hang, which the watchdog turns into a failure. The
outcome of every case on every rank is printed (pytest -s)."""
import dataclasses

import pytest
import torch
import torch.distributed as dist

import gtpo_reference as ref
from gloo import progress, record, run_ranks, sync
from gtpo_kernels import (GTPOConfig, conflict_weights, gtpo_loss, linear_gtpo_loss, linear_token_logprobs,
                          token_logprobs)

SPLITS = {2: [20, 17], 3: [10, 15, 12]}  # V = 37 in uneven slices
EMPTY = {2: [37, 0], 3: [20, 0, 17]}     # one rank holds no vocabulary
B, T, V, D, G = 4, 5, 37, 6, 2
WATCHDOG_S = 30
TOL = 1e-5


def _data():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(B, T, V, generator=g) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[1, :3] = ids[0, :3]  # shared prefixes: conflict tokens
    ids[3, 2:] = ids[2, 2:]
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3:] = False  # completion 0: 3 tokens, then masked-out ones
    mask[2, 1] = False   # a hole
    h, w, bias = torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g), torch.randn(V, generator=g) * 0.3
    adv = torch.tensor([1.0, -0.5, 0.0, 0.5])  # a zero advantage: rows the fused head may skip
    old = torch.where(mask, -torch.rand(B, T, generator=g) * 3 - 0.5, torch.full((B, T), float("nan")))
    return dict(x=x, ids=ids, mask=mask, h=h, w=w, bias=bias, adv=adv, old=old, refl=old + 0.1,
                roll=old - 0.2, wts=torch.rand(B, T, generator=g) + 0.5)


def _packed(d):
    """The packed view: the masked-out tokens stay (mask (N,)), cu_seqlens of the padded rows."""
    lengths = torch.full((B,), T)
    cu = torch.arange(0, B * T + 1, T)
    flat = {k: d[k].reshape((B * T,) + tuple(d[k].shape[2:])) for k in ("x", "ids", "mask", "h", "old", "wts")}
    return flat, cu, lengths


def _rel(a, b):
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return float(((a - b).abs() / b.abs().clamp(min=1)).max()) if a.numel() else 0.0


def _grad_rel(g, r):
    if g is None:
        return None
    n = float(r.double().norm())
    return float((g.double() - r.double()).norm()) / n if n > 0 else float(g.abs().max())


def _ref_loss(z, d, cfg, mask=None, **kw):
    """The float64 reference on the whole vocabulary -> (result, grad of z)."""
    z = z.detach().double().requires_grad_()
    r = ref.gtpo_loss(z, d["ids"], d["adv"].double(), d["mask"] if mask is None else mask, group_size=G,
                      **dataclasses.asdict(cfg), **kw)
    r["loss"].backward()
    return r, z.grad


class Ctx:
    def __init__(self, rank, world):
        self.rank, self.world, self.d, self.pg = rank, world, _data(), dist.group.WORLD
        self.last = rank == world - 1

    def sl(self, splits=SPLITS):
        s = splits[self.world]
        return slice(sum(s[:self.rank]), sum(s[:self.rank + 1]))

    def rep(self, v):
        """One value in this rank's representation: v, tensor(v), float(v) by rank."""
        return (v, torch.tensor(float(v)), float(v))[self.rank % 3]

    def logits(self, cfg, ref_cfg=None, rg=True, splits=SPLITS, ref_kw=None, ids=None, **kw):
        """gtpo_loss on this rank's slice (padded); the summary and, when ref_cfg, errors against it."""
        d, sl = self.d, self.sl(splits)
        ids = d["ids"] if ids is None else ids
        xs = d["x"][..., sl].clone().requires_grad_(rg)
        kw.setdefault("advantages", d["adv"])
        kw.setdefault("completion_mask", d["mask"])
        out = gtpo_loss(xs, ids, group_size=G, config=cfg, process_group=self.pg, **kw)
        if rg:
            out.loss.backward()
        res = _summary(out)
        if ref_cfg is not None:
            r, gz = _ref_loss(d["x"], d, ref_cfg, **(ref_kw or {}))
            res.update(err_loss=_rel(out.loss.detach(), r["loss"]), err_logps=_rel(out.logps, r["logps"]),
                       err_entropy=_rel(out.entropy, r["entropy"]),
                       err_grad=_grad_rel(xs.grad, gz[..., sl]) if rg else None)
        return res

    def linear(self, cfg, ref_cfg=None, rg=(True, True, True), sum_hidden=True, splits=SPLITS, scale=1.0,
               cap=None, **kw):
        """linear_gtpo_loss with this rank's rows of the LM head; errors against the reference on the
        materialized float64 logits. sum_hidden (the same on every rank): hidden's gradient summed over
        the ranks (as Megatron does) is checked too."""
        d, sl = self.d, self.sl(splits)
        h = d["h"].clone().requires_grad_(rg[0])
        w, b = d["w"][sl].clone().requires_grad_(rg[1]), d["bias"][sl].clone().requires_grad_(rg[2])
        out = linear_gtpo_loss(h, w, d["ids"], d["adv"], d["mask"], bias=b, group_size=G, config=cfg,
                               logit_scale=scale, logit_softcap=cap, process_group=self.pg, **kw)
        if any(rg):
            out.loss.backward()
        res = _summary(out)
        if ref_cfg is not None:
            leaves = [t.double().requires_grad_() for t in (d["h"], d["w"], d["bias"])]
            z = (leaves[0] @ leaves[1].t() + leaves[2]) * float(scale)
            z = z if cap is None else float(cap) * torch.tanh(z / float(cap))
            r = ref.gtpo_loss(z, d["ids"], d["adv"].double(), d["mask"], group_size=G, **dataclasses.asdict(ref_cfg))
            r["loss"].backward()
            errs = [_grad_rel(w.grad, leaves[1].grad[sl]) if rg[1] else None,
                    _grad_rel(b.grad, leaves[2].grad[sl]) if rg[2] else None]
            if sum_hidden:
                dh = h.grad.clone()
                dist.all_reduce(dh)
                errs.append(_grad_rel(dh, leaves[0].grad))
            errs = [e for e in errs if e is not None]
            res.update(err_loss=_rel(out.loss.detach(), r["loss"]), err_logps=_rel(out.logps, r["logps"]),
                       err_entropy=_rel(out.entropy, r["entropy"]), err_grad=max(errs) if errs else None)
        return res

    def packed(self, cfg, cu=None, max_seqlen=None, head=False, **kw):
        """The packed form (masked-out tokens kept, mask (N,)); logits or the head."""
        d, sl = self.d, self.sl()
        f, cu0, _ = _packed(d)
        cu = cu0 if cu is None else cu
        extra = {} if max_seqlen is None else {"max_seqlen": max_seqlen}
        if head:
            out = linear_gtpo_loss(f["h"], d["w"][sl], f["ids"], d["adv"], f["mask"], group_size=G, config=cfg,
                                   cu_seqlens=cu, process_group=self.pg, **extra, **kw)
        else:
            out = gtpo_loss(f["x"][:, sl], f["ids"], d["adv"], f["mask"], group_size=G, config=cfg,
                            cu_seqlens=cu, process_group=self.pg, **extra, **kw)
        return _summary(out)


def _scenarios(c):
    """name -> (call, expected): "same" (every rank returns the same, right numbers), "refuse" (every rank
    raises the same error), "uniform" (either, the same on every rank). The last rank is the odd one."""
    d, odd, rep = c.d, c.last, c.rep
    grpo = GTPOConfig.preset("grpo")
    gtpo = GTPOConfig(entropy_threshold=3.3, entropy_coef=0.01, entropy_penalty=0.1)
    one = lambda a, b: b if odd else a  # noqa: E731 - the odd rank's value, the others'

    def bumped(t, idx, v):  # t with one counted token changed on the odd rank
        t = t.clone()
        if odd:
            t[idx] = v
        return t
    S = {
        # the same value, another representation: accepted
        "temperature 1 | tensor(1.) | 1.0": (lambda: c.logits(GTPOConfig(temperature=rep(1)), GTPOConfig()), "same"),
        "temperature 0.5 | tensor(0.5)": (lambda: c.logits(grpo.replace(temperature=rep(0.5)),
                                                            grpo.replace(temperature=0.5)), "same"),
        "entropy_coef 0 | tensor(0.) | 0.0": (lambda: c.logits(gtpo.replace(entropy_coef=rep(0)),
                                                                gtpo.replace(entropy_coef=0.0)), "same"),
        "eps_high 0.25 | tensor(0.25)": (lambda: c.logits(grpo.replace(eps_high=rep(0.25)), grpo.replace(eps_high=0.25),
                                                          old_logps=d["old"], ref_kw=dict(old_logps=d["old"])), "same"),
        "num_items_in_batch 9 | tensor(9.) | 9.0": (lambda: c.logits(
            grpo.replace(loss_agg="token-mean"), grpo.replace(loss_agg="token-mean"), num_items_in_batch=rep(9),
            ref_kw=dict(num_items_in_batch=9.0)), "same"),
        "ids int64 | int32, mask bool | long | float": (lambda: c.logits(
            gtpo, gtpo, ids=d["ids"].to(one(torch.int64, torch.int32)),
            completion_mask=(d["mask"], d["mask"].long(), d["mask"].float())[c.rank % 3]), "same"),
        "advantages (B,) | (B, 1)": (lambda: c.logits(gtpo, gtpo, advantages=one(d["adv"], d["adv"][:, None])), "same"),
        "requires_grad on some ranks (logits)": (lambda: c.logits(gtpo, gtpo, rg=not odd), "same"),
        "requires_grad differs (head, rows skipped)": (lambda: c.linear(
            grpo, grpo, rg=(True, not odd, odd), sum_hidden=True), "same"),
        "entropy_coef 0.0 | tensor(0.) (head, rows skipped)": (lambda: c.linear(
            grpo.replace(entropy_coef=rep(0.0)), grpo, memory_budget=2 * 20 * 4 * 4), "same"),
        "logit_scale 1 | 1.0, logit_softcap 4 | 4.0 (head)": (lambda: c.linear(  # (numbers only: documented)
            gtpo, gtpo, scale=one(1, 1.0), cap=one(4, 4.0), schedule="recompute"), "same"),
        "empty slice: gtpo_loss": (lambda: c.logits(gtpo, gtpo, splits=EMPTY), "same"),
        "empty slice: token_logprobs, linear_token_logprobs": (lambda: _logprobs(c, EMPTY), "same"),
        "token_logprobs temperature 1 | tensor(1.) | 1.0": (lambda: _logprobs(c, SPLITS, rep(1)), "same"),
        "cu_seqlens int64 | int32": (lambda: c.packed(gtpo, cu=_packed(d)[1].to(one(torch.int64, torch.int32)),
                                                      max_seqlen=T), "same"),
        "data-parallel conflict_weights, a rank with no rows": (lambda: _dp_empty(c), "same"),
        # real differences: refused by every rank
        "eps_high 0.2 | 0.28": (lambda: c.logits(grpo.replace(eps_high=one(0.2, 0.28)), old_logps=d["old"]), "refuse"),
        "clip True | False": (lambda: c.logits(grpo.replace(clip=not odd)), "refuse"),
        "temperature 1.0 | 0.5": (lambda: c.logits(GTPOConfig(temperature=one(1.0, 0.5))), "refuse"),
        "entropy_coef 0.0 | 0.01 (head)": (lambda: c.linear(grpo.replace(entropy_coef=one(0.0, 0.01))), "refuse"),
        "loss_agg": (lambda: c.logits(grpo.replace(loss_agg=one("token-mean", "seq-mean-token-mean"))), "refuse"),
        "top_entropy_quantile": (lambda: c.logits(grpo.replace(top_entropy_quantile=one(1.0, 0.5))), "refuse"),
        "advantages differ": (lambda: c.logits(grpo, advantages=d["adv"] + (0.25 if odd else 0.0)), "refuse"),
        "old_logps differ at one token": (lambda: c.logits(grpo, old_logps=bumped(d["old"], (1, 2), -1.0)), "refuse"),
        "ref_logps differ (beta)": (lambda: c.logits(grpo.replace(beta=0.04), old_logps=d["old"],
                                                     ref_logps=bumped(d["refl"], (3, 0), -2.0)), "refuse"),
        "rollout_logps differ (off-policy mask)": (lambda: c.logits(
            grpo.replace(off_policy_mask_threshold=0.5), rollout_logps=bumped(d["roll"], (2, 4), -1.0)), "refuse"),
        "rollout_is_weights differ": (lambda: c.logits(grpo, rollout_is_weights=bumped(d["wts"], (1, 1), 2.0)),
                                      "refuse"),
        "lam differ": (lambda: c.logits(grpo, lam=bumped(torch.ones(B, T), (0, 0), 2.0), n_conf=torch.ones(B)),
                       "refuse"),
        "n_conf differ": (lambda: c.logits(grpo.replace(loss_agg="gtpo-official"), lam=torch.ones(B, T),
                                           n_conf=torch.ones(B) + (1.0 if odd else 0.0)), "refuse"),
        "num_items_in_batch 9 | 10": (lambda: c.logits(grpo.replace(loss_agg="token-mean"),
                                                       num_items_in_batch=one(9.0, 10.0)), "refuse"),
        "group_size 2 | 4": (lambda: _summary(gtpo_loss(d["x"][..., c.sl()], d["ids"], d["adv"], d["mask"],
                                                       group_size=one(2, 4), process_group=c.pg)), "refuse"),
        "logit_scale 1.0 | 0.5 (head)": (lambda: c.linear(grpo, scale=one(1.0, 0.5)), "refuse"),
        "logit_softcap None | 4 (head)": (lambda: c.linear(grpo, cap=one(None, 4.0)), "refuse"),
        "cu_seqlens around a masked-out token": (lambda: c.packed(gtpo, cu=torch.tensor(one([0, 5, 10, 15, 20],
                                                                                         [0, 4, 10, 15, 20]))),
                                                 "refuse"),
        "max_seqlen 5 | 6": (lambda: c.packed(gtpo, max_seqlen=one(5, 6)), "refuse"),
        "token_logprobs temperature 1.0 | 0.5": (lambda: _logprobs(c, SPLITS, one(1.0, 0.5)), "refuse"),
        # last: on a defect these hang, and the watchdog then ends the whole group
        "empty slice: head, tiles, fused": (lambda: c.linear(grpo, grpo, splits=EMPTY, memory_budget=2 * 37 * 4 * 3,
                                                             schedule="fused"), "same"),
        "empty slice: head, tiles, recompute": (lambda: c.linear(gtpo, gtpo, splits=EMPTY, memory_budget=2 * 37 * 4 * 3,
                                                                 schedule="recompute"), "same"),
        "max_seqlen lying on one rank (head, validate=False)": (lambda: c.packed(
            gtpo, max_seqlen=one(5, 2), head=True, validate=False, memory_budget=2 * 20 * 4 * 6), "refuse"),
        "DTensor Shard(-1), one rank also passing process_group": (lambda: _dtensor(c, one(None, c.other)), "refuse"),
    }
    return S


def _logprobs(c, splits, temperature=1.0):
    """token_logprobs and linear_token_logprobs on this rank's slice, against the float64 reference."""
    d, sl = c.d, c.sl(splits)
    lp, H = token_logprobs(d["x"][..., sl], d["ids"], temperature, d["mask"], process_group=c.pg)
    lp2, H2 = linear_token_logprobs(d["h"], d["w"][sl], d["ids"], temperature, d["mask"], bias=d["bias"][sl],
                                    process_group=c.pg)
    rl, rH = ref.token_logprobs(d["x"].double(), d["ids"], float(temperature), d["mask"])
    z = d["h"].double() @ d["w"].double().t() + d["bias"].double()
    rl2, rH2 = ref.token_logprobs(z, d["ids"], float(temperature), d["mask"])
    return {"loss": 0.0, "logps": lp.tolist() + lp2.tolist(),
            "err_logps": max(_rel(lp, rl), _rel(lp2, rl2)), "err_entropy": max(_rel(H, rH), _rel(H2, rH2))}


def _dp_empty(c):
    """conflict_weights over a data-parallel group where the last rank holds no completion: the others hold
    the groups in rank order; equal to the reference on the union."""
    d = c.d
    per = [B // (c.world - 1) if r < c.world - 1 else 0 for r in range(c.world)]
    per[0] += B - sum(per)
    per = [p - p % G for p in per[:-1]] + [0]
    per[0] += B - sum(per)
    lo = sum(per[:c.rank])
    rows = slice(lo, lo + per[c.rank])
    lam, n_conf = conflict_weights(d["ids"][rows], d["mask"][rows], d["adv"][rows], G, process_group=c.pg)
    rl, rn = ref.conflict_weights(d["ids"], d["mask"], d["adv"].double(), G, 2.0, 0.0)
    return {"loss": 0.0, "logps": [], "err_logps": max(_rel(lam, rl[rows]), _rel(n_conf, rn[rows]))}


def _dtensor(c, pg):
    from torch.distributed.tensor import DTensor, Shard
    d = c.d
    chunk = -(-V // c.world)
    lo, hi = c.rank * chunk, min(V, (c.rank + 1) * chunk)
    xd = DTensor.from_local(d["x"][..., lo:hi].clone(), c.mesh, [Shard(-1)], run_check=False, shape=d["x"].shape,
                            stride=d["x"].stride())
    return _summary(gtpo_loss(xd, d["ids"], d["adv"], d["mask"], group_size=G, config="grpo", process_group=pg))


def _summary(out):
    return {"loss": float(out.loss.detach()), "logps": out.logps.tolist()}


def _outcome(call):
    try:
        return {"raised": False, **call()}
    except Exception as e:  # noqa: BLE001 - recorded, as a trainer would log it
        cause = e.__cause__
        return {"raised": True, "text": f"{type(e).__name__}: {e}",
                "cause": None if cause is None else f"{type(cause).__name__}: {cause}"}


def _run(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    c = Ctx(rank, world)
    c.mesh = init_device_mesh("cpu", (world,))
    c.other = dist.new_group(list(range(world)))  # the same ranks, another group object
    out = {}
    for name, (call, expected) in _scenarios(c).items():
        out[name] = dict(_outcome(call), expected=expected)
        record(name, out[name])
        progress(name)
        sync(name)  # a rank that raised waits here, alive, for the others
    return out


def _verdict(world, name, outs):
    """-> None when the outcome is what spec 12 asks for on every rank, else why not."""
    expected = outs[0]["expected"]
    raised = [o["raised"] for o in outs]
    if all(raised) and len({o["text"] for o in outs}) == 1:
        causes = "; ".join(f"rank {r}: {o['cause']}" for r, o in enumerate(outs) if o["cause"])
        return None if expected in ("refuse", "uniform") else f"refused on every rank ({causes or 'no cause'})"
    if any(raised):
        return "ranks differ: " + " | ".join(f"rank {r}: {o.get('text', 'returned')}" for r, o in enumerate(outs))
    if expected == "refuse":
        return "accepted on every rank: " + ", ".join(f"rank {r} loss {o['loss']:.6g}" for r, o in enumerate(outs))
    if len({o["loss"] for o in outs}) != 1 or len({tuple(map(str, o["logps"])) for o in outs}) != 1:
        return "ranks return different values: " + ", ".join(f"rank {r} loss {o['loss']!r}" for r, o in enumerate(outs))
    for r, o in enumerate(outs):
        for k in ("err_loss", "err_logps", "err_entropy", "err_grad"):
            if o.get(k) is not None and not o[k] <= TOL * (10 if k == "err_grad" else 1):
                return f"rank {r}: {k} {o[k]:.3g} against the float64 reference"
    return None


@pytest.mark.parametrize("world", [2, 3])
def test_per_rank_differences(world):
    results = run_ranks(_run, world, watchdog=WATCHDOG_S, partial=True)
    for r, res in enumerate(results):
        assert "exception" not in res, f"rank {r}:\n{res.get('exception')}"
    names, hung, bad = list(_scenarios(Ctx(0, world))), False, {}
    print(f"\n{world} ranks:")
    for name in names:
        if not all(name in res for res in results):
            bad[name] = "not reached" if hung else results[0]["hang"]
            hung = True
            print(f"  {name}: FAILS -- {bad[name]}")
            continue
        outs = [res[name] for res in results]
        why = _verdict(world, name, outs)
        first = outs[0]
        print(f"  {name} [{first['expected']}]: " + ("ok, " if why is None else "FAILS, ") +
              (first["text"] if first["raised"] else f"loss {first['loss']:.6g}") + ("" if why is None else f" -- {why}"))
        if why is not None:
            bad[name] = why
    assert not bad, f"{len(bad)} of {len(names)} scenarios wrong on {world} ranks: {bad}"
