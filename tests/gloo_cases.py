"""For tests/test_gloo_scenarios.py: the batch every rank holds, each rank's call on its slice of the
vocabulary (logits, the LM head's rows, the packed form, the log-probs entry points, a DTensor, the
data-parallel conflict weights) and the float64 reference on the whole vocabulary to hold it against."""
import dataclasses

import torch
import torch.distributed as dist

import gtpo_reference as ref
from gtpo_kernels import conflict_weights, gtpo_loss, linear_gtpo_loss, linear_token_logprobs, token_logprobs

SPLITS = {2: [20, 17], 3: [10, 15, 12]}  # V = 37 in uneven slices
EMPTY = {2: [37, 0], 3: [20, 0, 17]}     # one rank holds no vocabulary
B, T, V, D, G = 4, 5, 37, 6, 2
TOL = 1e-5


def data():
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


def packed_view(d):
    """The packed view: the masked-out tokens stay (mask (N,)), cu_seqlens of the padded rows."""
    lengths = torch.full((B,), T)
    cu = torch.arange(0, B * T + 1, T)
    flat = {k: d[k].reshape((B * T,) + tuple(d[k].shape[2:])) for k in ("x", "ids", "mask", "h", "old", "wts")}
    return flat, cu, lengths


def rel(a, b):
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return float(((a - b).abs() / b.abs().clamp(min=1)).max()) if a.numel() else 0.0


def _gradrel(g, r):
    if g is None:
        return None
    if g.numel() == 0:  # an empty vocabulary slice: nothing to compare
        return 0.0
    n = float(r.double().norm())
    return float((g.double() - r.double()).norm()) / n if n > 0 else float(g.abs().max())


def ref_loss(z, d, cfg, mask=None, **kw):
    """The float64 reference on the whole vocabulary -> (result, grad of z)."""
    z = z.detach().double().requires_grad_()
    r = ref.gtpo_loss(z, d["ids"], d["adv"].double(), d["mask"] if mask is None else mask, group_size=G,
                      **dataclasses.asdict(cfg), **kw)
    r["loss"].backward()
    return r, z.grad


class Ctx:
    def __init__(self, rank, world):
        self.rank, self.world, self.d, self.pg = rank, world, data(), dist.group.WORLD
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
        res = summary(out)
        if ref_cfg is not None:
            r, gz = ref_loss(d["x"], d, ref_cfg, **(ref_kw or {}))
            res.update(err_loss=rel(out.loss.detach(), r["loss"]), err_logps=rel(out.logps, r["logps"]),
                       err_entropy=rel(out.entropy, r["entropy"]),
                       err_grad=_gradrel(xs.grad, gz[..., sl]) if rg else None)
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
        res = summary(out)
        if ref_cfg is not None:
            leaves = [t.double().requires_grad_() for t in (d["h"], d["w"], d["bias"])]
            z = (leaves[0] @ leaves[1].t() + leaves[2]) * float(scale)
            z = z if cap is None else float(cap) * torch.tanh(z / float(cap))
            r = ref.gtpo_loss(z, d["ids"], d["adv"].double(), d["mask"], group_size=G, **dataclasses.asdict(ref_cfg))
            r["loss"].backward()
            errs = [_gradrel(w.grad, leaves[1].grad[sl]) if rg[1] else None,
                    _gradrel(b.grad, leaves[2].grad[sl]) if rg[2] else None]
            if sum_hidden:
                dh = h.grad.clone()
                dist.all_reduce(dh)
                errs.append(_gradrel(dh, leaves[0].grad))
            errs = [e for e in errs if e is not None]
            res.update(err_loss=rel(out.loss.detach(), r["loss"]), err_logps=rel(out.logps, r["logps"]),
                       err_entropy=rel(out.entropy, r["entropy"]), err_grad=max(errs) if errs else None)
        return res

    def packed(self, cfg, cu=None, max_seqlen=None, head=False, **kw):
        """The packed form (masked-out tokens kept, mask (N,)); logits or the head."""
        d, sl = self.d, self.sl()
        f, cu0, _ = packed_view(d)
        cu = cu0 if cu is None else cu
        extra = {} if max_seqlen is None else {"max_seqlen": max_seqlen}
        if head:
            out = linear_gtpo_loss(f["h"], d["w"][sl], f["ids"], d["adv"], f["mask"], group_size=G, config=cfg,
                                   cu_seqlens=cu, process_group=self.pg, **extra, **kw)
        else:
            out = gtpo_loss(f["x"][:, sl], f["ids"], d["adv"], f["mask"], group_size=G, config=cfg,
                            cu_seqlens=cu, process_group=self.pg, **extra, **kw)
        return summary(out)


def logprobs(c, splits, temperature=1.0):
    """token_logprobs and linear_token_logprobs on this rank's slice, against the float64 reference."""
    d, sl = c.d, c.sl(splits)
    lp, H = token_logprobs(d["x"][..., sl], d["ids"], temperature, d["mask"], process_group=c.pg)
    lp2, H2 = linear_token_logprobs(d["h"], d["w"][sl], d["ids"], temperature, d["mask"], bias=d["bias"][sl],
                                    process_group=c.pg)
    rl, rH = ref.token_logprobs(d["x"].double(), d["ids"], float(temperature), d["mask"])
    z = d["h"].double() @ d["w"].double().t() + d["bias"].double()
    rl2, rH2 = ref.token_logprobs(z, d["ids"], float(temperature), d["mask"])
    return {"loss": 0.0, "logps": lp.tolist() + lp2.tolist(),
            "err_logps": max(rel(lp, rl), rel(lp2, rl2)), "err_entropy": max(rel(H, rH), rel(H2, rH2))}


def dp_empty(c):
    """conflict_weights over a data-parallel group where the last rank holds no completion: the others hold
    the groups in rank order; equal to the reference on the union."""
    d = c.d
    per = [B - G * (c.world - 2)] + [G] * (c.world - 2) + [0]  # world 2: [4, 0]; world 3: [2, 2, 0]
    lo = sum(per[:c.rank])
    rows = slice(lo, lo + per[c.rank])
    lam, n_conf = conflict_weights(d["ids"][rows], d["mask"][rows], d["adv"][rows], G, process_group=c.pg)
    rl, rn = ref.conflict_weights(d["ids"], d["mask"], d["adv"].double(), G, 2.0, 0.0)
    return {"loss": 0.0, "logps": [], "err_logps": max(rel(lam, rl[rows]), rel(n_conf, rn[rows]))}


def dtensor(c, pg, mesh=None):
    """gtpo_loss on a Shard(-1) DTensor of c.mesh (or `mesh`: this rank holds the shard at its coordinate)."""
    from torch.distributed.tensor import DTensor, Shard
    d, mesh = c.d, c.mesh if mesh is None else mesh
    chunk, at = -(-V // c.world), mesh.get_coordinate()[0]
    lo, hi = at * chunk, min(V, (at + 1) * chunk)
    xd = DTensor.from_local(d["x"][..., lo:hi].clone(), mesh, [Shard(-1)], run_check=False, shape=d["x"].shape,
                            stride=d["x"].stride())
    return summary(gtpo_loss(xd, d["ids"], d["adv"], d["mask"], group_size=G, config="grpo", process_group=pg))


def summary(out):
    return {"loss": float(out.loss.detach()), "logps": out.logps.tolist()}
