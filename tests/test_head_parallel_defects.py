"""The vocabulary-parallel fused head where ranks differ in what they may differ in (spec 12), on 2 gloo
processes, each rank's results against the one-process head on the whole vocabulary:

  rows skipped   which rows the fused schedule skips (known-zero coefficients) and their order in the
                 tiles must not depend on which tensors require grad on a rank, nor on an option given
                 as 0.0 on one rank and tensor(0.0) on the other;
  max_seqlen     packed, validate=False, a max_seqlen shorter than the longest completion on one rank
                 only: the ranks must not plan different tiles (a hang in mismatched all-reduces): they
                 either agree to refuse it or compute the one-process result;
  empty slice    one rank's slice of the vocabulary is empty (weight (0, D)): computed, not a crash.
"""
import torch
import torch.distributed as dist

from gloo import progress, run_ranks_ok

TOL = 1e-5


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float(((a - b).abs() / b.abs().clamp(min=1)).max()) if a.numel() else 0.0


def _grad_rel(g, ref):
    g, ref = g.double(), ref.double()
    return float((g - ref).norm() / ref.norm().clamp(min=1e-30))


def _scenarios(rank, world):
    from gtpo_kernels import GTPOConfig, linear_gtpo_loss
    from gtpo_kernels.pipeline.head import row_bytes
    group = dist.group.WORLD
    res = {}
    g = torch.Generator().manual_seed(7)
    B, T, D, V = 4, 6, 8, 20
    h = torch.randn(B, T, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.7
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.tensor([0.0, 1.0, 0.0, -0.5])  # zero advantages: rows the fused schedule puts last and skips
    budget = 12 * row_bytes(V, w.dtype, w.device)  # 12 rows: two completions a tile
    sl = slice(0, 12) if rank == 0 else slice(12, V)

    # rows skipped: nothing requires grad on rank 1; then entropy_coef 0.0 against tensor(0.0)
    kw = dict(group_size=2, memory_budget=budget, schedule="fused", backend="torch")
    one = linear_gtpo_loss(h, w, ids, adv, config=GTPOConfig.preset("grpo"), **kw)
    for case, coef, grad in (("requires_grad", 0.0, rank == 0), ("tensor(0.0)", 0.0 if rank == 0 else
                                                                 torch.tensor(0.0), True)):
        wp, hp = w[sl].clone().requires_grad_(grad), h.clone().requires_grad_(grad)
        progress(f"rows skipped, {case}")
        out = linear_gtpo_loss(hp, wp, ids, adv, config=GTPOConfig.preset("grpo", entropy_coef=coef),
                               process_group=group, **kw)
        res[f"rows skipped, {case}"] = {"loss": _rel(out.loss, one.loss), "logps": _rel(out.logps, one.logps),
                                        "entropy": _rel(out.entropy, one.entropy)}

    # max_seqlen shorter than the longest completion on rank 0 only, validate=False: shaping on (the filter
    # makes `auto` recompute), and the sequence ratio without a filter (`auto` would run fused, whose tiles
    # a lying max_seqlen would plan)
    lengths = torch.tensor([6, 2, 5, 3])
    mask = torch.arange(T)[None] < lengths[:, None]
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    for name, cfg in (("max_seqlen", GTPOConfig.preset("gtpo", entropy_threshold=10.0, use_conflict_mask=False)),
                      ("max_seqlen, gspo", GTPOConfig.preset("gspo"))):
        kw = dict(group_size=2, config=cfg, cu_seqlens=cu, memory_budget=3 * row_bytes(V, w.dtype, w.device),
                  validate=False, backend="torch")
        hp = h[mask].clone().requires_grad_()
        one_h = h[mask].clone().requires_grad_()
        one = linear_gtpo_loss(one_h, w, ids[mask], torch.tensor([1.0, -1.0, 0.5, -0.5]), **kw)
        one.loss.backward()
        progress(name)
        try:
            out = linear_gtpo_loss(hp, w[sl], ids[mask], torch.tensor([1.0, -1.0, 0.5, -0.5]),
                                   max_seqlen=2 if rank == 0 else 6, process_group=group, **kw)
            out.loss.backward()
            dh = hp.grad.clone()
            dist.all_reduce(dh)  # hidden's gradient: the slices' contributions summed
            res[name] = {"loss": _rel(out.loss, one.loss), "logps": _rel(out.logps, one.logps),
                         "grad hidden": _grad_rel(dh, one_h.grad)}
        except ValueError as e:  # refused by the agreement: every rank must say so
            res[name] = {"refused": str(e).split(";")[0]}

    # an empty slice on rank 1 (rank 0 holds the whole vocabulary)
    sl = slice(0, V) if rank == 0 else slice(V, V)
    # (the Triton kernels read and write the tile's tokens in the call's tensors on a slice too, an empty one included)
    for backend, schedule in (("torch", "fused"), ("torch", "recompute"), ("triton", "fused"), ("triton", "recompute")):
        kw = dict(group_size=2, config=GTPOConfig.preset("grpo"), memory_budget=budget, backend=backend)
        w1 = w.clone().requires_grad_()
        one = linear_gtpo_loss(h, w1, ids, adv, schedule=schedule, **kw)
        one.loss.backward()
        wp = w[sl].clone().requires_grad_()
        progress(f"empty slice {backend} {schedule}")
        out = linear_gtpo_loss(h, wp, ids, adv, schedule=schedule, process_group=group, **kw)
        out.loss.backward()
        res[f"empty slice {backend} {schedule}"] = {
            "loss": _rel(out.loss, one.loss), "logps": _rel(out.logps, one.logps),
            "grad weight": _grad_rel(wp.grad, w1.grad) if rank == 0 else float(wp.grad.shape != (0, D))}
    return res


def test_vocabulary_parallel_head_rank_differences():
    ranks = run_ranks_ok(_scenarios, 2, watchdog=90)
    assert ranks[0].keys() == ranks[1].keys()
    for name in ranks[0]:
        got = [res[name] for res in ranks]
        if any("refused" in x for x in got):
            assert got[0] == got[1], f"{name}: the ranks do not raise the same error: {got}"
            continue
        for r, errs in enumerate(got):
            for what, err in errs.items():
                assert err <= TOL, f"{name}, rank {r}: {what} off by {err:.2e} (one-process result)"
