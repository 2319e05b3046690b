"""Data parallelism over torch.distributed (spec 12, issue 11 item 2), with 2 and 3 gloo processes on the
CPU (one spawn per world size, every check inside it):

- conflict_weights(..., process_group=) with groups straddling ranks (uneven row counts, a different
  padded length T on every rank; packed; group_ids as strings and as an integer tensor, rows of a group
  shuffled over the ranks; both backends, Triton under the interpreter) equals one process's
  conflict_weights on the concatenated batch and the float64 reference, exactly (lambda is a product of
  w_pos, w_neg and 1);
- the errors (a group split unevenly, ranks disagreeing on the grouping or the form, one rank's bad
  arguments) are raised on every rank, never a hang;
- num_items_in_batch: each rank's gtpo_loss with loss_agg='token-mean' and num_items_in_batch = (counted
  tokens over all ranks and micro-batches) / world, gradients of a shared LM head summed over
  micro-batches and AVERAGED over ranks (what DDP/FSDP do), equals one process's token-mean on the whole
  step; seq-mean-token-mean equals it with equal completions per rank (and with unequal ones only once
  each micro-batch's loss is scaled by world * B_micro / B_total); GTPO with lambda from the
  data-parallel conflict_weights equals one process with group_size, and gtpo-official (a sum over
  completions) with each rank's loss times world;
- a smoke run of bench/parallel.py (bytes per token, 2 ranks against 1)."""

import pytest
import torch
import torch.distributed as dist

import gtpo_reference
from gloo import run_ranks_ok
from gtpo_kernels import GTPOConfig, conflict_weights, gtpo_loss

B_TOT, G, T_MAX, V_IDS = 12, 4, 9, 4  # 3 groups of 4; few ids: many conflicts
ROWS = {2: [5, 7], 3: [3, 5, 4]}      # uneven: every group boundary falls inside a rank somewhere
T_RANK = {2: [9, 7], 3: [8, 9, 6]}    # each rank's padded length (its rows are no longer)


def _batch(seed, world):
    """The whole batch (B_TOT, T_MAX): per group a shared prefix and suffix, random middles, lengths that
    fit every row's rank's T; advantages of every sign (0 = inactive)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V_IDS, (B_TOT, T_MAX), generator=g)
    owner = torch.repeat_interleave(torch.arange(world), torch.tensor(ROWS[world]))
    cap = torch.tensor(T_RANK[world])[owner]
    lengths = torch.minimum(torch.randint(3, T_MAX + 1, (B_TOT,), generator=g), cap)
    mask = torch.arange(T_MAX)[None, :] < lengths[:, None]
    for k in range(B_TOT // G):
        rows = slice(k * G, (k + 1) * G)
        ids[rows, :2] = ids[k * G, :2]
        for i in range(k * G, (k + 1) * G):  # the same last two tokens
            ids[i, lengths[i] - 2:lengths[i]] = torch.tensor([3, 1])
    mask[5, 1] = False  # a hole inside a completion
    ids[~mask] = -100
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0, -2.0, 1.0, 1.0, -1.0, 0.3, -0.3, 0.0, 2.0])
    return ids, mask, adv


def _my_rows(world, rank):
    start = sum(ROWS[world][:rank])
    return slice(start, start + ROWS[world][rank]), T_RANK[world][rank]


def _packed(ids, mask):
    """Padded rows -> the packed form: each row up to its last counted row (holes stay, masked out)."""
    t = torch.arange(ids.shape[1])
    keep = t[None, :] <= torch.where(mask, t, -1).amax(1)[:, None]
    cu = torch.cat([torch.zeros(1, dtype=torch.long), keep.sum(1).cumsum(0)])
    return ids[keep], mask[keep], cu, keep


def _exact(a, b):
    return bool(a.shape == b.shape and torch.equal(a.double(), b.double()))


def _conflict_checks(rank, world, counter):
    grp = dist.group.WORLD
    res = {}
    rows, T = _my_rows(world, rank)
    for seed in (0, 1):
        ids, mask, adv = _batch(seed, world)
        ref_lam, ref_n = gtpo_reference.conflict_weights(ids, mask, adv, G)
        for backend in ("torch", "triton"):
            one_lam, one_n = conflict_weights(ids, mask, adv, G, backend=backend)
            before = counter["all_gather"]
            lam, n = conflict_weights(ids[rows, :T], mask[rows, :T], adv[rows], G, backend=backend,
                                      process_group=grp)
            res[f"{seed}/{backend}/padded"] = {
                "one": _exact(lam, one_lam[rows, :T]) and _exact(n, one_n[rows]),
                "ref": _exact(lam, ref_lam[rows, :T]) and _exact(n, ref_n[rows]),
                "lam_not_all_one": bool((ref_lam != 1).any()), "shape": list(lam.shape) == [rows.stop - rows.start, T],
                # received per padded token of the gathered batch, less the one shape check (8 int64 per rank)
                "gathered_bytes_per_token": (counter["all_gather"] - before - 8 * 8 * world) / (
                    world * max(ROWS[world]) * max(T_RANK[world]))}
            # packed: each rank's rows without padding (holes kept, masked out)
            pids, pm, pcu, keep = _packed(ids[rows, :T], mask[rows, :T])
            plam, pn = conflict_weights(pids, pm, adv[rows], G, cu_seqlens=pcu, backend=backend, process_group=grp)
            res[f"{seed}/{backend}/packed"] = {"ref": _exact(plam, ref_lam[rows, :T][keep]) and _exact(pn, ref_n[rows])}
        # group_ids: 3 groups of 4 rows, shuffled over the ranks; keys as strings and as a tensor
        perm = torch.randperm(B_TOT, generator=torch.Generator().manual_seed(10 + seed))
        keys = (torch.arange(B_TOT) // G)[perm]  # row j of the shuffled batch belongs to group keys[j]
        sids, smask, sadv = ids[perm], mask[perm], adv[perm]
        want_lam, want_n = ref_lam[perm], ref_n[perm]  # the reference on contiguous groups, rows moved
        for kind, k in (("strings", [f"uid-{int(x)}" for x in keys[rows]]), ("tensor", keys[rows] * 7 + 3)):
            # (the whole length T_MAX here: a shuffled row may be longer than this rank's T above)
            lam, n = conflict_weights(sids[rows], smask[rows], sadv[rows], group_ids=k, process_group=grp)
            res[f"{seed}/group_ids/{kind}"] = {"ref": _exact(lam, want_lam[rows]) and _exact(n, want_n[rows])}
        # a mix: tensor keys on rank 0, lists elsewhere (all gathered as objects)
        k = keys[rows] if rank == 0 else [int(x) for x in keys[rows]]
        lam, n = conflict_weights(sids[rows], smask[rows], sadv[rows], group_ids=k, process_group=grp)
        res[f"{seed}/group_ids/mixed"] = {"ref": _exact(lam, want_lam[rows]) and _exact(n, want_n[rows])}
    # an unvalidated NaN advantage (row 6, group 1): its group's weights NaN, as in one process (they were
    # finite: its sign travelled as 0, inactive), the other groups' as before; padded and packed
    ids, mask, adv = _batch(0, world)
    adv = adv.clone()
    adv[6] = float("nan")
    pids, pm, pcu, keep = _packed(ids[rows, :T], mask[rows, :T])
    for backend in ("torch", "triton"):
        one_lam, one_n = conflict_weights(ids, mask, adv, G, backend=backend, validate=False)
        lam, n = conflict_weights(ids[rows, :T], mask[rows, :T], adv[rows], G, backend=backend, validate=False,
                                  process_group=grp)
        plam, pn = conflict_weights(pids, pm, adv[rows], G, cu_seqlens=pcu, backend=backend, validate=False,
                                    process_group=grp)
        res[f"nan/{backend}"] = {"one": _exact(lam.nan_to_num(7.0), one_lam[rows, :T].nan_to_num(7.0))
                                 and _exact(n.nan_to_num(7.0), one_n[rows].nan_to_num(7.0))
                                 and _exact(plam.nan_to_num(7.0), one_lam[rows, :T][keep].nan_to_num(7.0))
                                 and _exact(pn.nan_to_num(7.0), n.nan_to_num(7.0)),
                                 "group_nan": bool(torch.isnan(one_n[4:8]).all() and torch.isfinite(one_n[:4]).all())}
    # a config holding a 0-d tensor (a schedule) fingerprints as a Digest in the agreement's row: taken as its
    # number is (from aa0e0c2 to 99ea72f every rank refused it with a TypeError)
    ids, mask, adv = _batch(0, world)
    one_lam, one_n = conflict_weights(ids, mask, adv, G, config=GTPOConfig(conflict_pos_weight=2.0))
    lam, n = conflict_weights(ids[rows, :T], mask[rows, :T], adv[rows], G, process_group=grp,
                              config=GTPOConfig(conflict_pos_weight=torch.tensor(2.0)))
    res["tensor_config"] = {"one": _exact(lam, one_lam[rows, :T]) and _exact(n, one_n[rows])}
    # errors on every rank, never a hang (after each, the ranks are still in step: the next call works)
    ids, mask, adv = _batch(0, world)
    a, m, d = ids[rows, :T], mask[rows, :T], adv[rows]
    raised = {}
    cases = {
        "uneven": lambda: conflict_weights(a[1:] if rank == 0 else a, m[1:] if rank == 0 else m,
                                           d[1:] if rank == 0 else d, G, process_group=grp),
        "grouping": lambda: conflict_weights(a, m, d, 2 if rank == 0 else G, process_group=grp),
        "keys_vs_size": lambda: conflict_weights(a, m, d, None if rank == 0 else G,
                                                 group_ids=list(range(len(d))) if rank == 0 else None,
                                                 process_group=grp),
        "form": lambda: (conflict_weights(*_packed(a, m)[:2], d, G, cu_seqlens=_packed(a, m)[2], process_group=grp)
                         if rank == world - 1 else conflict_weights(a, m, d, G, process_group=grp)),
        "local": lambda: conflict_weights(a, m[:, :-1] if rank == 1 else m, d, G, process_group=grp),
        "no_grouping": lambda: conflict_weights(a, m, d, process_group=grp),
        "tensor_option": lambda: conflict_weights(a, m, d, G, process_group=grp, config=GTPOConfig(
            conflict_pos_weight=torch.tensor(2.0 + (rank == 0)))),
    }
    for name, call in cases.items():
        try:
            call()
            raised[name] = "no error"
        except (ValueError, TypeError) as e:  # with the failing rank's own error, chained
            raised[name] = f"{type(e).__name__}: {e}" + ("" if e.__cause__ is None else f" <- {e.__cause__}")
    lam, _ = conflict_weights(a, m, d, G, process_group=grp)
    raised["after"] = _exact(lam, gtpo_reference.conflict_weights(ids, mask, adv, G)[0][rows, :T])
    return res, raised


def _head(seed, D=6, V=11):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, D, generator=g) * 0.7, torch.randn(B_TOT, T_MAX + 1, D, generator=g)


def _step_grad(W0, hidden, ids, mask, adv, old, cfg, micro, scale, num_items=None, lam=None, n_conf=None,
               group_size=None):
    """Gradient of the LM head W over the micro-batches `micro` (row slices of this rank's batch):
    each micro-batch's loss times scale(micro-batch) backward, gradients summed (gradient accumulation)."""
    W = W0.clone().requires_grad_()
    for mb in micro:
        logits = hidden[mb] @ W.T
        kw = dict(lam=lam[mb], n_conf=n_conf[mb]) if lam is not None else dict(group_size=group_size)
        out = gtpo_loss(logits, ids[mb].clamp(min=0), adv[mb], mask[mb], old_logps=old[mb], config=cfg,
                        num_items_in_batch=num_items, logits_start=0, backend="torch", **kw)
        (out.loss * scale(mb)).backward()
    return W.grad


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def _dp_loss_checks(rank, world):
    """num_items_in_batch and the seq-level means under gradient averaging (DDP's rule)."""
    grp = dist.group.WORLD
    W0, hidden = _head(3)
    ids, mask, adv = _batch(2, world)
    ids = ids.clamp(min=0) % W0.shape[0]
    old = -torch.rand(B_TOT, T_MAX, generator=torch.Generator().manual_seed(4)) * 2 - 1.0  # clip engages

    def averaged(g):  # DDP / FSDP: all-reduce SUM, divide by the world size
        g = g.clone()
        dist.all_reduce(g, group=grp)
        return g / world

    res = {}
    equal = B_TOT // world
    eq_rows = slice(rank * equal, (rank + 1) * equal)
    un_rows, _ = _my_rows(world, rank)

    def two_micro(rows):  # gradient accumulation: two micro-batches per rank (sizes may differ)
        n = rows.stop - rows.start
        return [slice(rows.start, rows.start + (n + 1) // 2), slice(rows.start + (n + 1) // 2, rows.stop)]

    # token-mean (dapo): num_items_in_batch = all counted tokens of the step / world; uneven ranks too
    dapo = GTPOConfig.preset("dapo")
    whole = _step_grad(W0, hidden, ids, mask, adv, old, dapo, [slice(0, B_TOT)], lambda mb: 1.0, group_size=G)
    n_items = float(mask.sum()) / world
    for name, rows in (("equal", eq_rows), ("uneven", un_rows)):
        g = averaged(_step_grad(W0, hidden, ids, mask, adv, old, dapo, two_micro(rows), lambda mb: 1.0,
                                num_items=n_items, group_size=G))
        res[f"token-mean/{name}"] = _rel(g, whole)
    # without num_items_in_batch each micro-batch divides by its own count: not the whole step's mean
    g = averaged(_step_grad(W0, hidden, ids, mask, adv, old, dapo, two_micro(un_rows), lambda mb: 1.0,
                            group_size=G))
    res["token-mean/local_counts"] = _rel(g, whole)
    # seq-mean-token-mean (grpo): mean over each micro-batch's completions; scale B_micro / B_rank
    # (the trainer's 1 / accumulation steps for equal micro-batches), averaged over ranks
    grpo = GTPOConfig.preset("grpo")
    whole = _step_grad(W0, hidden, ids, mask, adv, old, grpo, [slice(0, B_TOT)], lambda mb: 1.0, group_size=G)
    for name, rows in (("equal", eq_rows), ("uneven", un_rows)):
        n_rank = rows.stop - rows.start
        g = averaged(_step_grad(W0, hidden, ids, mask, adv, old, grpo, two_micro(rows),
                                lambda mb, n_rank=n_rank: (mb.stop - mb.start) / n_rank, group_size=G))
        res[f"seq-mean/{name}/naive"] = _rel(g, whole)
    g = averaged(_step_grad(W0, hidden, ids, mask, adv, old, grpo, two_micro(un_rows),
                            lambda mb: world * (mb.stop - mb.start) / B_TOT, group_size=G))
    res["seq-mean/uneven/scaled"] = _rel(g, whole)
    # GTPO (conflict weights, entropy filter): lambda from the data-parallel conflict_weights
    gtpo = GTPOConfig(entropy_threshold=2.0)
    whole = _step_grad(W0, hidden, ids, mask, adv, old, gtpo, [slice(0, B_TOT)], lambda mb: 1.0, group_size=G)
    lam, n_conf = conflict_weights(ids[eq_rows], mask[eq_rows], adv[eq_rows], G, config=gtpo, process_group=grp)
    lam_full = torch.ones(B_TOT, T_MAX)
    n_full = torch.ones(B_TOT)
    lam_full[eq_rows], n_full[eq_rows] = lam, n_conf
    g = averaged(_step_grad(W0, hidden, ids, mask, adv, old, gtpo, two_micro(eq_rows),
                            lambda mb: (mb.stop - mb.start) / equal, lam=lam_full, n_conf=n_full))
    res["gtpo/equal"] = _rel(g, whole)
    # gtpo-official: a sum over completions, additive over micro-batches and ranks: times W (any split)
    off = GTPOConfig.preset("gtpo-official", entropy_threshold=2.0)
    whole = _step_grad(W0, hidden, ids, mask, adv, old, off, [slice(0, B_TOT)], lambda mb: 1.0, group_size=G)
    lam, n_conf = conflict_weights(ids[un_rows], mask[un_rows], adv[un_rows], G, config=off, process_group=grp)
    lam_full[un_rows], n_full[un_rows] = lam, n_conf
    g = averaged(_step_grad(W0, hidden, ids, mask, adv, old, off, two_micro(un_rows), lambda mb: float(world),
                            lam=lam_full, n_conf=n_full))
    res["gtpo-official/uneven"] = _rel(g, whole)
    res["gtpo/lam_not_all_one"] = float((lam != 1).any())
    return res


def _rank_checks(rank, world):
    counter = {"all_gather": 0}  # bytes received by the all-gathers, the agreement's (into one tensor) too
    real = dist.all_gather
    from gtpo_kernels.distributed.agree import GATHER as gather
    real_single = getattr(dist, gather)

    def counted(tensors, tensor, *a, **k):
        counter["all_gather"] += tensor.numel() * tensor.element_size() * len(tensors)
        return real(tensors, tensor, *a, **k)

    def counted_single(out, tensor, *a, **k):
        counter["all_gather"] += out.numel() * out.element_size()
        return real_single(out, tensor, *a, **k)
    dist.all_gather = counted
    setattr(dist, gather, counted_single)
    conflicts, raised = _conflict_checks(rank, world, counter)
    return {"conflicts": conflicts, "raised": raised, "loss": _dp_loss_checks(rank, world)}


@pytest.mark.parametrize("world", [2, 3])
def test_data_parallel(world):
    results = run_ranks_ok(_rank_checks, world)
    print(f"\n{world} ranks, rank 0: " + ", ".join(f"{k} {v:.2g}" for k, v in results[0]["loss"].items()))
    for r, res in enumerate(results):
        for key, e in res["conflicts"].items():
            for f in ("one", "ref", "lam_not_all_one", "shape", "group_nan"):
                if f in e:
                    assert e[f] is True, (r, key, f)
            if "gathered_bytes_per_token" in e:
                # ids and mask as int64 (16 bytes) + the advantage's sign per row (8 / T bytes per token)
                assert e["gathered_bytes_per_token"] <= 16 + 8 / 6, (r, key, e)
        raised = res["raised"]
        assert "a group split unevenly" in raised["uneven"] and f"not a multiple of group_size = {G}" in \
            raised["uneven"], raised
        assert "disagree on the grouping" in raised["grouping"], raised
        assert "disagree on the grouping" in raised["keys_vs_size"], raised
        assert "disagree on the form" in raised["form"], raised
        assert "rank(s) [1] refused their arguments" in raised["local"], raised  # the same error everywhere
        assert ("completion_mask" in raised["local"]) == (r == 1), raised  # its own, chained, on rank 1
        assert "group_size is required" in raised["no_grouping"], raised
        assert "disagree on the options" in raised["tensor_option"], raised
        assert raised["after"] is True
        loss = res["loss"]
        for k in ("token-mean/equal", "token-mean/uneven", "seq-mean/equal/naive", "seq-mean/uneven/scaled",
                  "gtpo/equal", "gtpo-official/uneven"):
            assert loss[k] <= 1e-5, (r, k, loss[k])
        # the rules matter: local token counts, or unscaled seq-means over unequal ranks, are not equal
        assert loss["token-mean/local_counts"] > 1e-3, loss
        assert loss["seq-mean/uneven/naive"] > 1e-3, loss
        assert loss["gtpo/lam_not_all_one"] == 1.0


_BENCH = dict(tokens=64, vocab=512, repeats=1, warmup=0)


def _bench_rank(rank, world):
    from bench.timing import parallel
    return parallel.measure(**_BENCH)


def test_bench_parallel_smoke():
    """bench/parallel.py on 2 gloo ranks of its own: each rank's vocabulary slice gives the one-process
    loss (checked here, on the bench's inputs, not only by the bench's own error figures), the bytes
    the all-reduces move per token are few and counted, both ranks report the slower rank's step times,
    and the summary and table come out of them."""
    from bench.timing import parallel
    ranks = run_ranks_ok(_bench_rank, 2)
    logits, ids, mask, adv, old = parallel._inputs(_BENCH["tokens"], _BENCH["vocab"])
    one = float(parallel._call(logits.double(), ids, mask, adv, old).loss)
    assert one != 0.0
    for r, x in enumerate(ranks):
        assert abs(x["loss"] - one) <= 1e-5 * max(1.0, abs(one)), (r, x["loss"], one)
        assert x["loss_rel_err"] <= 1e-5 and x["grad_rel_err"] <= 1e-5 and x["grad_norm"] > 0, (r, x)
        assert x["all_reduce_bytes"] > 0 and x["all_gather_bytes"] > 0, (r, x)
    steps = [x["rounds_ms"]["2 ranks"] for x in ranks]
    assert steps[0] == steps[1] and len(steps[0]) == _BENCH["repeats"] and min(steps[0]) > 0, steps
    res = parallel.summarize(ranks, **_BENCH, load=None)
    print("\n" + parallel.table(res))
    ours = res["bytes"]["ours_per_token"]
    assert ours == max(x["all_reduce_bytes"] for x in ranks) / _BENCH["tokens"] and 0 < ours <= 32, res["bytes"]
    for row in res["bytes"]["rows"]:
        assert row["allgather_per_token"] == row["V"] * row["element_bytes"] and row["ratio"] > 1000, row
    assert res["max_rel_err"] <= 1e-5 and res["min_grad_norm"] > 0, res
