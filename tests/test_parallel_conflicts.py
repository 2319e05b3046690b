"""The conflict weights computed in a vocabulary-parallel loss (spec 3, 8, 12): on a split vocabulary their
groups run as programs of the merge's sums launch (kernels/conflict_triton.Deferred, vp_merge_triton
CONFLICT), so that a gtpo forward + backward takes 8 launches, not 9. On 2 gloo ranks, Triton under the
interpreter, gtpo, padded and packed, validating and not, each path a rank may take:

- lam and n_conf as returned are bitwise conflict_weights' (one process), which are not all 1 here;
- the first launch and the agreement-first path launch no conflict kernel of their own; the paths that merge
  the slices otherwise (the top-entropy key read first) launch it, and give the same bits;
- an unvalidated malformed cu_seqlens: lam and n_conf NaN everywhere, as conflict_weights gives them;
- lam given on one rank and computed on the other is refused on every rank (the agreement cannot read values
  not yet made, so it compares whether they are given)."""
import torch

from gloo import run_ranks_ok

V, SPLIT = 37, 20
CONFIGS = {"gtpo": dict(entropy_threshold=None),  # (its filter would drop every completion of these logits)
           "gtpo-top": dict(entropy_threshold=None, top_entropy_quantile=0.5)}  # (the key read before the epilogue)


def _inputs(packed, seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 6
    x = torch.randn(B, T, V, generator=g) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[1, :3] = ids[0, :3]  # a leading run shared by a positive and a negative completion
    ids[3, -2:] = ids[2, -2:]  # and a trailing one (the backward alignment)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 4], mask[2, 1] = False, False
    kw = dict(advantages=torch.tensor([1.0, -0.5, 0.7, -1.2]), group_size=2,
              old_logps=-torch.rand(B, T, generator=g) * 3 - 1.5)
    if packed:
        kw.update(cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(1).cumsum(0)]),
                  max_seqlen=int(mask.sum(1).max()), old_logps=kw["old_logps"][mask])
        return x[mask], ids[mask], None, kw
    return x, ids, mask, kw


def _ranks(rank, world):
    import torch.distributed as dist

    from bench.launches import counting
    from gtpo_kernels import GTPOConfig, conflict_weights, gtpo_loss
    from gtpo_kernels.pipeline import epilogue_attached
    lo, hi = (0, SPLIT) if rank == 0 else (SPLIT, V)
    pg, real_first, out = dist.group.WORLD, epilogue_attached.first, {"cases": []}
    for packed in (False, True):
        x, ids, mask, kw = _inputs(packed, 5)
        form = {k: kw[k] for k in ("cu_seqlens", "max_seqlen") if k in kw}
        lam, n_conf = conflict_weights(ids, mask, kw["advantages"], 2, config="gtpo", backend="triton", **form)
        for name, over in CONFIGS.items():
            cfg = GTPOConfig.preset("gtpo", **over)
            for validate in (False, True):
                for way in ("first", "agreement first"):
                    epilogue_attached.first = real_first if way == "first" else (lambda b, c: False)
                    part = x[..., lo:hi].clone().requires_grad_()
                    with counting() as c:
                        o = gtpo_loss(part, ids, completion_mask=mask, config=cfg, backend="triton",
                                      validate=validate, process_group=pg, **kw)
                        o.loss.backward()
                    out["cases"].append(dict(
                        packed=packed, cfg=name, validate=validate, way=way, launches=c.launches,
                        own=c.triton_names.get("_conflict_weights_kernel", 0),
                        lam=torch.equal(o.lam, lam.reshape(o.lam.shape)), n_conf=torch.equal(o.n_conf, n_conf),
                        ones=bool((lam.reshape(-1)[~torch.isnan(lam.reshape(-1))] == 1).all())))
    epilogue_attached.first = real_first
    # an unvalidated malformed cu_seqlens (decreasing): NaN everywhere, as conflict_weights'
    x, ids, _, kw = _inputs(True, 6)
    cu = kw["cu_seqlens"].clone()
    cu[2] = cu[3] + 1
    kw["cu_seqlens"] = cu
    lam, n_conf = conflict_weights(ids, None, kw["advantages"], 2, config="gtpo", backend="triton", validate=False,
                                   cu_seqlens=cu, max_seqlen=kw["max_seqlen"])
    o = gtpo_loss(x[..., lo:hi].clone().requires_grad_(), ids, config=GTPOConfig.preset("gtpo", entropy_threshold=None),
                  backend="triton", validate=False, process_group=pg, **kw)
    out["malformed"] = [bool(torch.isnan(t).all()) for t in (lam, n_conf, o.lam, o.n_conf)]
    # lam given on rank 0 only (the very values rank 1 computes): refused on every rank
    x, ids, mask, kw = _inputs(False, 5)
    lam, n_conf = conflict_weights(ids, mask, kw["advantages"], 2, config="gtpo", backend="triton")
    try:
        gtpo_loss(x[..., lo:hi].clone().requires_grad_(), ids, completion_mask=mask, config="gtpo", backend="triton",
                  process_group=pg, **kw, **(dict(lam=lam, n_conf=n_conf) if rank == 0 else {}))
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    return out


def test_split_conflict_weights_ride_on_the_sums_launch():
    for r, res in enumerate(run_ranks_ok(_ranks, 2, watchdog=300)):
        assert len(res["cases"]) == 16, r
        for c in res["cases"]:
            assert c["lam"] and c["n_conf"] and not c["ones"], (r, c)
            # the merged sums: no conflict launch of their own (8 with the first launch, spec 8; 9 agreement
            # first); the top-entropy key's path: their own launch
            top = c["cfg"] == "gtpo-top"
            assert c["own"] == int(top), (r, c)
            if not top:
                assert c["launches"] == (8 if c["way"] == "first" else 9), (r, c)
        assert res["malformed"] == [True] * 4, (r, res["malformed"])
        assert res["refused"] and "lam" in res["refused"] and "every rank" in res["refused"], (r, res["refused"])
