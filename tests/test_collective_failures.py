"""Failure is collective (spec 12): with 2 and 3 gloo processes, bad or disagreeing input on one rank
makes every rank raise the same error naming that rank, and never leaves a rank waiting in a collective.

Each scenario runs on every rank, then the ranks meet at a barrier outside torch.distributed (tests/gloo.py
`sync`): a rank that raised stays alive there, so a peer stuck in a collective shows as a hang, which the
watchdog turns into a failure. The outcome of every scenario on every rank is printed (pytest -s)."""

import re

import pytest
import torch
import torch.distributed as dist

from agree_scenarios import check_agreement, run_agreement
from gloo import progress, run_ranks_ok, sync
from gtpo_kernels import conflict_weights, gtpo_loss, linear_gtpo_loss, token_logprobs

SPLITS = {2: [20, 17], 3: [10, 15, 12]}  # V = 37 in uneven slices
B, T, V, D, G = 4, 5, 37, 6, 2
WATCHDOG_S = 45  # no progress on any rank this long: a hang (a loaded machine is slow to start)


def _data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[:, 1] = torch.tensor([3, 30, 11, 22])  # distinct, so that a swap changes the tokens
    mask = torch.ones(B, T, dtype=torch.long)
    mask[3, 4] = 0
    h, w = torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g)
    return x, ids, mask, torch.tensor([1.0, -1.0, 0.5, -0.5]), h, w


def _vocab_scenarios(rank, world, bad):
    """name -> (call, the rank the error must name or None, text every rank's error holds)."""
    x, ids, mask, adv, h, w = _data()
    sl = slice(sum(SPLITS[world][:rank]), sum(SPLITS[world][:rank + 1]))
    xs, ws, pg, me = x[..., sl], w[sl], dist.group.WORLD, rank == bad

    def loss(i=ids, m=mask, xx=xs, **kw):
        return gtpo_loss(xx, i, adv, m, group_size=G, config="grpo", backend="torch", process_group=pg, **kw)

    def edit(t, idx, v):
        t = t.clone()
        if me:
            t[idx] = v
        return t
    swapped = ids.clone()
    if me:
        swapped[0, 1], swapped[1, 1] = ids[1, 1], ids[0, 1]
    nan_x = xs.clone()
    if me:
        nan_x[2, 3, 0] = float("nan")
    budget = 2 * V * 4 * 3 if me else 2 * V * 4 * 5  # a different number of tiles, so of collectives
    nan_w = ws.clone()
    if me:
        nan_w[0, 0] = float("nan")  # every token's logit of this vocabulary entry: the first tile raises
    return {
        "id_out_of_range": (lambda: loss(edit(ids, (0, 0), V)), bad, "completion_ids must lie in [0, V) = [0, 37)"),
        "id_negative": (lambda: loss(edit(ids, (1, 2), -3)), bad, "refused their arguments"),
        "mask_value_2": (lambda: loss(m=edit(mask, (2, 2), 2)), bad, "refused their arguments"),
        "masks_differ": (lambda: loss(m=edit(mask, (0, 4), 0)), bad, "disagree on the counted tokens"),
        "ids_differ": (lambda: loss(swapped), bad, "disagree on the counted tokens"),
        "shapes_differ": (lambda: loss(ids[:, :4] if me else ids, mask[:, :4] if me else mask,
                                       xs[:, :4] if me else xs), bad, "disagree on the shapes"),
        "reference_backend": (lambda: token_logprobs(xs, ids, 1.0, mask, backend="reference" if me else "torch",
                                                     process_group=pg), bad, "refused their arguments"),
        "validate_differs": (lambda: loss(validate=not me), bad, "disagree on the options"),
        "logprobs_mask_value_2": (lambda: token_logprobs(xs, ids, 1.0, edit(mask, (0, 0), 2), process_group=pg),
                                  bad, "refused their arguments"),
        "nonfinite_logit": (lambda: loss(xx=nan_x), None, "contains NaN or +inf"),
        "linear_id_out_of_range": (lambda: linear_gtpo_loss(h, ws, edit(ids, (3, 1), 40), adv, mask, group_size=G,
                                                            config="grpo", process_group=pg), bad,
                                   "completion_ids must lie in [0, V) = [0, 37)"),
        "linear_nonfinite_weight": (lambda: linear_gtpo_loss(h, nan_w, ids, adv, mask, group_size=G, config="grpo",
                                                             memory_budget=2 * V * 4 * 3, process_group=pg), None,
                                    "contains NaN or +inf"),
        "linear_budget_differs": (lambda: linear_gtpo_loss(h, ws, ids, adv, mask, group_size=G, config="grpo",
                                                           memory_budget=budget, schedule="recompute",
                                                           process_group=pg), bad,
                                  "disagree on the options"),
    }


def _dp_scenarios(rank, world, bad):
    """conflict_weights(process_group=): each rank holds its own completions (a group of 2 per rank)."""
    _, ids, mask, adv, _, _ = _data()
    ids, mask, adv, pg, me = ids[:2], mask[:2].bool(), adv[:2], dist.group.WORLD, rank == bad
    lengths = mask.sum(1)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    pids, pmask = ids[mask], torch.ones(int(lengths.sum()), dtype=torch.bool)
    bad_cu = torch.tensor([0, 7, 3]) if me else cu  # decreasing: an error only the device sees
    keys = [lambda: 0, "a"] if me else ["b", "b"]  # a lambda cannot be pickled for the object gather
    return {
        "dp_bad_cu_seqlens_unvalidated": (lambda: conflict_weights(pids, pmask, adv, G, cu_seqlens=bad_cu,
                                                                   validate=False, process_group=pg), bad,
                                          "refused their arguments"),
        "dp_unpicklable_group_key": (lambda: conflict_weights(ids, mask, adv, group_ids=keys, process_group=pg),
                                     bad, "refused their arguments"),
    }


def _outcome(call):
    try:
        call()
        return {"raised": False}
    except Exception as e:  # noqa: BLE001 - recorded, as a trainer would log it
        cause = e.__cause__
        return {"raised": True, "text": f"{type(e).__name__}: {e}",
                "cause": None if cause is None else f"{type(cause).__name__}: {cause}"}


def _run(rank, world):
    out = {}
    for bad in sorted({world - 1, 0}):
        for name, (call, named, text) in {**_vocab_scenarios(rank, world, bad),
                                          **_dp_scenarios(rank, world, bad)}.items():
            key = f"{name}/bad={bad}"
            out[key] = dict(_outcome(call), named=named, expect=text)
            progress(key)
            sync(key)  # a rank that raised waits here, alive, for the others
    out["agreement"] = run_agreement(rank, world)  # what the ranks must agree on (tests/agree_scenarios.py)
    # still in step: a valid call returns the same loss on every rank
    x, ids, mask, adv, _, _ = _data()
    sl = slice(sum(SPLITS[world][:rank]), sum(SPLITS[world][:rank + 1]))
    out["after"] = float(gtpo_loss(x[..., sl], ids, adv, mask, group_size=G, config="grpo", backend="torch",
                                   process_group=dist.group.WORLD).loss)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_raises_the_same_error(world):
    results = run_ranks_ok(_run, world, watchdog=WATCHDOG_S)
    print(f"\n{world} ranks:")
    for key, first in results[0].items():
        if key in ("after", "agreement"):
            continue
        outs = [res[key] for res in results]
        texts = {o.get("text", "returned") for o in outs}
        print(f"  {key}: " + (f"all {world} ranks raised: {first['text']}" if len(texts) == 1 and first["raised"]
                               else " | ".join(f"rank {r}: {o.get('text', 'returned')}" for r, o in enumerate(outs))))
        assert all(o["raised"] for o in outs), (key, outs)
        assert len({o["text"] for o in outs}) == 1, (key, [o["text"] for o in outs])
        assert first["expect"] in first["text"], (key, first["text"])
        if first["named"] is not None:
            named = re.search(r"rank\(s\) \[([0-9, ]*)\]", first["text"])
            assert named and str(first["named"]) in named.group(1).split(", "), (key, first["text"])
            if "refused their arguments" in first["expect"]:  # the failing rank chains its own error
                assert outs[first["named"]]["cause"] is not None, (key, outs)
    # a value check (validating) rides on the agreement's read: the failing rank still chains the check's own
    # error, which names the argument
    for name, word in (("id_negative", "completion_ids"), ("mask_value_2", "completion_mask"),
                       ("logprobs_mask_value_2", "completion_mask")):
        for key in (k for k in results[0] if k.startswith(name + "/")):
            bad = int(key.split("=")[1])
            assert word in (results[bad][key]["cause"] or ""), (key, results[bad][key])
    assert len({res["after"] for res in results}) == 1
    check_agreement([res["agreement"] for res in results], world)


def test_token_digest_tells_tokens_apart():
    """The checksum the ranks compare: equal for equal tokens (whatever the integer dtype), different
    when ids swap places or the mask moves (same count, same id multiset); packed, moved completion
    boundaries leave the tokens' checksum alone and change cu_seqlens' own field (the agreement names it)."""
    from gtpo_kernels.core import batch
    from gtpo_kernels.distributed.agree import odd_ranks
    from gtpo_kernels.distributed.digest import input_digests, token_digest
    _, ids, mask, _, _, _ = _data()

    def digest(i, m, **kw):
        return tuple(int(x) for x in token_digest(batch.prepare_tokens(i, m, **kw)))
    base = digest(ids, mask)
    assert digest(ids.to(torch.int32), mask.bool()) == base
    swapped = ids.clone()
    swapped[0, 1], swapped[1, 1] = ids[1, 1], ids[0, 1]
    moved = mask.clone()
    moved[3, 4], moved[3, 3] = 1, 0
    assert digest(swapped, mask)[1] != base[1] and digest(ids, moved)[1] != base[1]
    assert digest(ids, moved)[0] == base[0]  # the same count: only the checksum tells them apart
    flat = ids.reshape(-1)
    cus = (torch.tensor([0, 5, 10, 15, 20]), torch.tensor([0, 4, 10, 15, 20]), torch.tensor([0, 5, 10, 15, 20]))
    packed = [batch.prepare_tokens(flat, None, cu_seqlens=cu, max_seqlen=ms) for cu, ms in zip(cus, (5, 6, 6))]
    assert len({tuple(int(x) for x in token_digest(p)) for p in packed}) == 1  # the same tokens
    cu_fields = [int(input_digests(p)[0].value()) for p in packed]
    assert len(set(cu_fields)) == 3, cu_fields  # boundaries, max_seqlen: told apart in cu_seqlens' field
    assert odd_ranks([1, 1, 2]) == [2] and odd_ranks([1, 2]) == [0, 1] and odd_ranks([3, 3]) == []
