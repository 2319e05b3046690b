"""Vocabulary-parallel logits over torch.distributed (spec 12), with 2 and 3 gloo processes on the CPU:
each rank holds a contiguous slice of the vocabulary (uneven sizes); the loss, log-probs, entropies and
metrics equal one process on the whole vocabulary, on every rank, and each rank's gradient is its slice
of the single-process gradient; both backends (Triton under the interpreter), padded and packed,
several presets, confident rows, ties and banned slices; the bytes communicated per token; the
errors every rank raises instead of hanging."""

import pytest
import torch
import torch.distributed as dist

from gloo import run_ranks_ok
from gtpo_kernels import GTPOConfig, gtpo_loss, token_logprobs
from gtpo_kernels.distributed import agree

SPLITS = {2: [20, 17], 3: [10, 15, 12]}  # V = 37 in uneven slices
GATHER = agree.GATHER  # the agreement's all-gather into one tensor


def _case(seed, packed):
    g = torch.Generator().manual_seed(seed)
    B, T, V = 4, 5, 37
    x = torch.randn(B, T + 1, V, generator=g) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[1, :3] = ids[0, :3]
    ids[3, 2:] = ids[2, 2:]
    x[0, 1, ids[0, 1]] += 14.0  # a confident row whose target holds the maximum
    x[2, 2, :] = 0.25  # every entry tied: the maximum in every slice
    x[1, 3, :25] = float("-inf")  # banned: the first slices are all -inf on this row
    ids[1, 3] = 30
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[3, 4] = False
    ids[3, 4] = -100
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    old = -torch.rand(B, T, generator=g) * 3 - 1.5
    if not packed:
        return x[:, :T], ids, mask, adv, old, {}  # one row per token (logits_start=None)
    keep = mask.reshape(-1)
    lengths = mask.sum(1)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    xp = x[:, :T].reshape(B * T, V)[keep]
    return xp, ids.reshape(-1)[keep], None, adv, old.reshape(-1)[keep], dict(cu_seqlens=cu, max_seqlen=T)


CONFIGS = {
    "gtpo": GTPOConfig(entropy_threshold=3.2, entropy_coef=0.01),
    "grpo": GTPOConfig.preset("grpo", beta=0.04),
    "dapo": GTPOConfig.preset("dapo", entropy_coef=0.02, temperature=0.7),
    "gspo": GTPOConfig.preset("gspo", top_entropy_quantile=0.5),
}


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().clamp(min=1).max()) if a.numel() else 0.0


def _grad_rel(g, ref):
    n = float(ref.double().norm())
    return float((g.double() - ref.double()).norm()) / n if n > 0 else float(g.abs().max())


def _checks(rank, world, counter):
    sizes = SPLITS[world]
    start = sum(sizes[:rank])
    sl = slice(start, start + sizes[rank])
    errs = {}
    for backend in ("torch", "triton"):
        for packed in (False, True):
            for i, (name, cfg) in enumerate(CONFIGS.items()):
                if world == 3 and (i + packed + (backend == "triton")) % 2:
                    continue  # CI time: 3 ranks run half of the 16 (backend, form, preset) cases, each preset
                    # once per backend and once per form; 2 ranks run all 16
                x, ids, mask, adv, old, kw = _case(7, packed)
                refl = old + 0.1 if cfg.beta > 0 else None
                roll = dict(rollout_logps=old + 0.3 * torch.sin(old * 7)) if name in ("grpo", "gspo") else {}
                full = x.clone().requires_grad_()
                one = gtpo_loss(full, ids, adv, mask, group_size=2, old_logps=old, ref_logps=refl, config=cfg,
                                backend=backend, **roll, **kw)
                one.loss.backward()
                part = x[..., sl].clone().requires_grad_()
                before, layout_before = counter["bytes"], counter["layout_bytes"]
                out = gtpo_loss(part, ids, adv, mask, group_size=2, old_logps=old, ref_logps=refl, config=cfg,
                                backend=backend, process_group=dist.group.WORLD, **roll, **kw)
                sent = counter["bytes"] - before
                layout = counter["layout_bytes"] - layout_before
                out.loss.backward()
                key = f"{backend}/{'packed' if packed else 'padded'}/{name}"
                e = {"loss": _rel(out.loss.detach(), one.loss.detach()),
                     "grad": _grad_rel(part.grad, full.grad[..., sl]),
                     "zero_rows": bool(((full.grad[..., sl] == 0).all(-1) <= (part.grad == 0).all(-1)).all()),
                     "bytes_per_token": sent / ids.numel(), "layout_bytes": layout}
                for f in ("logps", "entropy", "per_token_loss", "lam", "seq_entropy"):
                    e[f] = _rel(getattr(out, f), getattr(one, f))
                e["kept"] = bool(torch.equal(out.kept, one.kept))
                e["metrics"] = max(_rel(out.metrics[k], v) for k, v in one.metrics.items())
                e["loss_value"] = float(out.loss)
                e["metric_values"] = {k: float(v) for k, v in out.metrics.items()}  # identical on every rank
                if roll:  # spec 14's mismatch metrics, with the others
                    assert "rollout_k3" in out.metrics and "rollout_k3" in one.metrics
                e["grad_norm"] = float(full.grad.norm())
                errs[key] = e
        x, ids, mask, adv, old, kw = _case(3, False)
        lp1, h1 = token_logprobs(x, ids, 0.8, mask, backend=backend)
        lp, h = token_logprobs(x[..., sl], ids, 0.8, mask, backend=backend, process_group=dist.group.WORLD)
        errs[f"{backend}/token_logprobs"] = {"logps": _rel(lp, lp1), "entropy": _rel(h, h1)}
    errs.update(_linear_and_dtensor_checks(rank, world, sl))
    # errors on every rank, never a hang
    x, ids, mask, adv, old, _ = _case(7, False)
    raised = {}
    bad_T, bad_mask = (ids, mask) if rank == 0 else (ids[:, :4], mask[:, :4])  # (each valid on its own)
    try:
        gtpo_loss(x[..., sl], bad_T, adv, bad_mask, group_size=2, config="grpo", logits_start=0,
                  process_group=dist.group.WORLD)
    except ValueError as err:
        raised["shapes"] = str(err)
    bad_id = ids.clone()
    bad_id[0, 0] = 37  # outside the global vocabulary (inside no slice)
    try:
        gtpo_loss(x[..., sl], bad_id, adv, mask, group_size=2, config="grpo", process_group=dist.group.WORLD)
    except ValueError as err:
        raised["ids"] = str(err)
    out = gtpo_loss(x[..., sl], bad_id, adv, group_size=2, config="grpo", validate=False,
                    process_group=dist.group.WORLD)
    raised["nan_unvalidated"] = bool(torch.isnan(out.loss)) and bool(torch.isnan(out.logps[0, 0]))
    nan_x = x.clone()
    nan_x[2, 1, 0] = float("nan")  # in the first rank's slice only: every rank raises the same error
    for backend in ("torch", "triton"):
        try:
            gtpo_loss(nan_x[..., sl], ids, adv, mask, group_size=2, config="grpo", backend=backend,
                      process_group=dist.group.WORLD)
        except ValueError as err:
            raised[f"nan_row/{backend}"] = str(err)
    import warnings
    with warnings.catch_warnings(record=True) as caught:  # the filter drops every completion here: it warns,
        warnings.simplefilter("always")  # pointing at the caller's line, on every rank
        gtpo_loss(x[..., sl], ids, adv, mask, group_size=2, config="gtpo", backend="triton",
                  process_group=dist.group.WORLD)
    raised["warned_at"] = [w.filename for w in caught if "dropped every completion" in str(w.message)]
    return {"errs": errs, "raised": raised}


def _linear_and_dtensor_checks(rank, world, sl):
    """The fused head with this rank's rows of the LM head (both schedules), and DTensor logits."""
    from gtpo_kernels import linear_gtpo_loss, linear_token_logprobs
    errs = {}
    g = torch.Generator().manual_seed(11)
    B, T, D, V = 4, 5, 8, 37
    h = torch.randn(B, T, D, generator=g)
    w = torch.randn(V, D, generator=g)
    bias = torch.randn(V, generator=g) * 0.1
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[1, :3] = ids[0, :3]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    for backend in ("torch", "triton"):
        for schedule, budget in (("auto", None), ("recompute", 2 * 20 * 4 * 3)):
            kw = dict(group_size=2, config=GTPOConfig(entropy_threshold=3.0), logit_softcap=5.0,
                      schedule=schedule, memory_budget=budget, backend=backend)
            h1, w1, b1 = (t.clone().requires_grad_() for t in (h, w, bias))
            one = linear_gtpo_loss(h1, w1, ids, adv, bias=b1, **kw)
            one.loss.backward()
            hp, wp, bp = h.clone().requires_grad_(), w[sl].clone().requires_grad_(), bias[sl].clone().requires_grad_()
            out = linear_gtpo_loss(hp, wp, ids, adv, bias=bp, process_group=dist.group.WORLD, **kw)
            out.loss.backward()
            dh = hp.grad.clone()
            dist.all_reduce(dh)  # hidden's gradient: each rank's slice contributes (Megatron sums it)
            errs[f"{backend}/linear/{schedule}"] = {
                "loss": _rel(out.loss.detach(), one.loss.detach()), "logps": _rel(out.logps, one.logps),
                "entropy": _rel(out.entropy, one.entropy), "grad": max(_grad_rel(wp.grad, w1.grad[sl]),
                                                                       _grad_rel(bp.grad, b1.grad[sl]),
                                                                       _grad_rel(dh, h1.grad)),
                "schedule_same": float(out.metrics["grad_in_forward"]) == float(one.metrics["grad_in_forward"])}
        lp1, e1 = linear_token_logprobs(h, w, ids, 0.9, backend=backend)
        lp, e = linear_token_logprobs(h, w[sl], ids, 0.9, backend=backend, process_group=dist.group.WORLD)
        errs[f"{backend}/linear_token_logprobs"] = {"logps": _rel(lp, lp1), "entropy": _rel(e, e1)}
    # a DTensor sharded on the vocabulary (torch's chunk sizes), its mesh giving the group
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    x, ids, mask, adv, old, _ = _case(5, False)
    mesh = init_device_mesh("cpu", (world,))
    chunk = -(-x.shape[-1] // world)
    lo, hi = rank * chunk, min(x.shape[-1], (rank + 1) * chunk)
    local = x[..., lo:hi].clone().requires_grad_()
    xd = DTensor.from_local(local, mesh, [Shard(2)], run_check=False, shape=x.shape, stride=x.stride())
    full = x.clone().requires_grad_()
    one = gtpo_loss(full, ids, adv, mask, group_size=2, old_logps=old, config="grpo")
    one.loss.backward()
    out = gtpo_loss(xd, ids, adv, mask, group_size=2, old_logps=old, config="grpo")
    out.loss.backward()
    errs["dtensor"] = {"loss": _rel(out.loss.detach(), one.loss.detach()), "logps": _rel(out.logps, one.logps),
                       "grad": _grad_rel(local.grad, full.grad[..., lo:hi])}
    return errs


def _rank_checks(rank, world):
    counter = {"bytes": 0, "layout_bytes": 0}  # per-token all-reduces; the one small shape check
    for name in ("all_reduce", GATHER):
        real = getattr(dist, name)

        def counted(*a, _real=real, _name=name, **k):
            t = a[0] if _name == "all_reduce" else a[1]  # the agreement: this rank's row
            counter["bytes" if _name == "all_reduce" else "layout_bytes"] += t.numel() * t.element_size()
            return _real(*a, **k)
        setattr(dist, name, counted)
    return _checks(rank, world, counter)


@pytest.mark.parametrize("world", [2, 3])
def test_vocabulary_parallel_equals_one_process(world):
    results = run_ranks_ok(_rank_checks, world)
    worst = {}
    for res in results:
        for e in res["errs"].values():
            for f, v in e.items():
                if isinstance(v, float) and f not in ("loss_value", "grad_norm"):
                    worst[f] = max(worst.get(f, 0.0), v)
    print(f"\n{world} ranks, largest over ranks, backends, padded/packed, presets: "
          + ", ".join(f"{k} {v:.2g}" for k, v in sorted(worst.items())))
    for r, res in enumerate(results):
        for key, e in res["errs"].items():
            for f in ("loss", "logps", "entropy", "per_token_loss", "lam", "seq_entropy", "metrics"):
                if f in e:
                    assert e[f] <= 1e-5, (r, key, f, e[f])
            if "schedule_same" in e:
                assert e["schedule_same"], (r, key)
            if "grad" in e:
                assert e["grad"] <= (1e-4 if "linear" in key else 1e-5), (r, key, e["grad"])
            if "grad" in e and "zero_rows" in e:
                assert e["zero_rows"] and e["kept"], (r, key)
                assert e["grad_norm"] > 0, (r, key, "the reference gradient is all zero")
                assert e["bytes_per_token"] <= 32, (r, key, e["bytes_per_token"])
                # the one small agreement: 28 int64 per rank (flag, slice size, shapes, options, the
                # inputs' checksums, the per-token temperature's among them, the sampler's four arguments,
                # the tokens', and the host values' checksum), whatever the batch
                assert e["layout_bytes"] <= 224, (r, key, e["layout_bytes"])
        # identical on every rank
        for key, e in res["errs"].items():
            if "loss_value" in e:
                assert e["loss_value"] == results[0]["errs"][key]["loss_value"], (r, key)
                assert e["metric_values"] == results[0]["errs"][key]["metric_values"], (r, key)
        assert "disagree on the shapes" in res["raised"].get("shapes", ""), res["raised"]
        assert "completion_ids must lie in [0, V) = [0, 37)" in res["raised"].get("ids", ""), res["raised"]
        assert res["raised"]["nan_unvalidated"]
        for backend in ("torch", "triton"):
            assert "completion token (2, 1) contains NaN or +inf" in res["raised"].get(f"nan_row/{backend}", ""), \
                (r, res["raised"])
        assert res["raised"]["warned_at"] == [__file__], (r, res["raised"]["warned_at"])


def _strided_mask_ranks(rank, world):
    """token_logprobs and gtpo_loss (Triton) with the mask a strided view and with its contiguous copy."""
    x, ids, mask, adv, old, _ = _case(5, False)
    sizes = SPLITS[world]
    start = sum(sizes[:rank])
    part = x[..., start:start + sizes[rank]].contiguous()
    wide = torch.zeros(mask.shape[0], 2 * mask.shape[1], dtype=torch.bool)
    wide[:, ::2] = mask
    wide[0, 2] = wide[2, 6] = False  # (two more tokens not counted)
    out = {}
    for name, m in (("strided", wide[:, ::2]), ("contiguous", wide[:, ::2].contiguous())):
        lp, ent = token_logprobs(part, ids, 0.8, m, process_group=dist.group.WORLD, backend="triton")
        xg = part.clone().requires_grad_()
        o = gtpo_loss(xg, ids, adv, m, group_size=2, old_logps=old, config="grpo", process_group=dist.group.WORLD,
                      backend="triton")
        o.loss.backward()
        out[name] = [lp, ent, o.loss.detach(), o.logps.detach(), xg.grad]
    assert wide[:, ::2].reshape(-1).stride() == (2,) and out["contiguous"][4].abs().sum() > 0
    return {"same": [torch.equal(a, b) for a, b in zip(out["strided"], out["contiguous"])]}


def test_a_strided_mask_counts_the_same_tokens():
    """A completion_mask that is a strided view (a column slice of a wider mask) is read at its own strides by
    every kernel of a vocabulary-parallel call: the outputs and the gradient equal those of its contiguous copy."""
    results = run_ranks_ok(_strided_mask_ranks, 2)
    for r, res in enumerate(results):
        assert all(res["same"]), (r, res["same"])
