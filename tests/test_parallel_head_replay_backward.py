"""The vocabulary-parallel head over the sampler's kept sets (top_k rebuilt, or recorded as sampling_mask)
differentiates without communicating (spec 12: "each rank's gradient is its slice of the single-process
gradient; the backward communicates nothing"), on 2 gloo processes with several union tiles a rank:

  no collective  loss.backward() calls no collective on any rank (it re-ran the merge, two all-reduces per
                 union tile);
  gradients      each rank's weight slice's gradient is its slice of the one-process head's on the whole
                 vocabulary, and the ranks' hidden gradients sum to its (also against the float64 reference
                 backend), with an entropy term in the loss and a temperature;
  frozen slice   rank 1 holds a frozen slice and hidden (nothing requires grad: it runs no backward): rank
                 0's backward completes (it hung in the merge's all-reduce) with the same gradient.
"""
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from gloo import progress, run_ranks_ok, sync

B, T, D, V = 4, 5, 6, 23
SPLIT = 9  # rank 0: ids 0..8, rank 1: 9..22
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "reduce", "barrier", "all_to_all", "all_to_all_single",
               "send", "recv", "isend", "irecv", "gather", "scatter")


def _data():
    g = torch.Generator().manual_seed(5)
    h = torch.randn(B, T, D, generator=g)
    w = torch.randn(V, D, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    z = h.reshape(-1, D) @ w.T
    sets = [sorted(set(z[r].topk(5).indices.tolist()) | {int(ids.reshape(-1)[r])}) for r in range(B * T)]
    kept = (torch.tensor([v for s in sets for v in s]), torch.tensor([0] + [len(s) for s in sets]).cumsum(0))
    return h, w, ids, torch.tensor([1.0, -1.0, 0.5, -0.5]), kept


def _call(h, w, ids, adv, rule, kept, backend="torch", group=None):
    from gtpo_kernels import GTPOConfig, linear_gtpo_loss
    kw = dict(top_k=5) if rule == "top_k" else dict(sampling_mask=kept)
    return linear_gtpo_loss(h, w, ids, adv, group_size=2, config=GTPOConfig.preset("grpo", entropy_coef=0.05),
                            memory_budget=2 * 2 * V * 4, temperature=0.7, backend=backend, process_group=group,
                            **kw)


class _Counted:
    """Counts the calls of every torch.distributed collective while inside."""

    def __enter__(self):
        self.calls, self.saved = [], []
        for mod in (dist, c10d):
            for name in COLLECTIVES:
                f = getattr(mod, name, None)
                if f is not None:
                    self.saved.append((mod, name, f))
                    setattr(mod, name, lambda *a, _f=f, _n=name, **k: (self.calls.append(_n), _f(*a, **k))[1])
        return self

    def __exit__(self, *exc):
        for mod, name, f in self.saved:
            setattr(mod, name, f)


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _ranks(rank, world):
    h, w, ids, adv, kept = _data()
    sl = slice(0, SPLIT) if rank == 0 else slice(SPLIT, V)
    res = {}
    for rule in ("top_k", "sampling_mask"):
        one = {}
        for backend in ("torch", "reference"):  # the one-process head on the whole vocabulary
            oh, ow = h.clone().requires_grad_(), w.clone().requires_grad_()
            _call(oh, ow, ids, adv, rule, kept, backend).loss.backward()
            one[backend] = (oh.grad, ow.grad[sl])
        progress(f"{rule}: one process")
        hp, wp = h.clone().requires_grad_(), w[sl].clone().requires_grad_()
        out = _call(hp, wp, ids, adv, rule, kept, group=dist.group.WORLD)
        with _Counted() as c:
            out.loss.backward()
        progress(f"{rule}: backward")
        dh = hp.grad.clone()
        dist.all_reduce(dh)  # the hidden's gradient: the slices' parts summed
        res[rule] = {"collectives": c.calls, "ref grad norm": float(one["reference"][1].norm()),
                     **{f"{name} vs {b}": _rel(mine, one[b][i]) for b in one
                        for i, (name, mine) in enumerate((("hidden", dh), ("weight", wp.grad)))}}

        # rank 1 frozen: it runs no backward; rank 0's completes with its slice's gradient
        grad = rank == 0
        hp, wp = h.clone().requires_grad_(grad), w[sl].clone().requires_grad_(grad)
        out = _call(hp, wp, ids, adv, rule, kept, group=dist.group.WORLD)
        progress(f"{rule}: frozen, forward")
        if grad:
            out.loss.backward()
            res[rule]["frozen: weight vs torch"] = _rel(wp.grad, one["torch"][1])
        progress(f"{rule}: frozen, backward")
        sync(f"{rule} frozen")  # (outside torch.distributed: a rank stuck in a collective shows as a hang)
    return res


def test_vocabulary_parallel_head_over_kept_sets_backward_communicates_nothing():
    results = run_ranks_ok(_ranks, 2, watchdog=60)
    for rank, res in enumerate(results):
        for rule, r in res.items():
            assert r["collectives"] == [], (rank, rule, r)
            assert r["ref grad norm"] > 0, (rank, rule, r)
            for k in ("hidden", "weight"):
                assert r[f"{k} vs torch"] <= 1e-5, (rank, rule, k, r)
                assert r[f"{k} vs reference"] <= 1e-4, (rank, rule, k, r)
            if rank == 0:
                assert r["frozen: weight vs torch"] <= 1e-5, (rule, r)
