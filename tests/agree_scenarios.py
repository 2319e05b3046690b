"""What the ranks must agree on (spec 12), with 2 and 3 gloo processes: in a vocabulary-parallel group
every per-token and per-completion input (the whole cu_seqlens and max_seqlen, advantages, old/ref/rollout
log-probs and weights, lam, n_conf) and every option compared by value; a rank that differs makes every
rank raise the same error naming it, and never leaves one waiting. The same value written differently
(1 and 1.0, 0.5 and tensor(0.5)) is one value. A DTensor with a process_group on one rank is refused on
every rank. A data-parallel conflict_weights rank may hold zero rows; its options must agree too.

Each scenario runs on every rank with rank `bad` the odd one, then the ranks meet at a barrier outside
torch.distributed (tests/gloo.py): a rank that raised stays alive there, so a peer stuck in a collective
shows as a hang, which the watchdog turns into a failure. tests/test_collective_failures.py runs them in
its processes (`run_agreement` on every rank, `check_agreement` on the results); pytest -s prints each
outcome on every rank."""

import re

import torch
import torch.distributed as dist

from gloo import progress, sync
from gtpo_kernels import (GTPOConfig, conflict_weights, gtpo_loss, linear_gtpo_loss, linear_token_logprobs,
                          token_logprobs)

SPLITS = {2: [20, 17], 3: [10, 15, 12]}  # V = 37 in uneven slices
B, V, D, G = 4, 37, 6, 2
LENGTHS = [3, 2, 4, 3]


def _data():
    """A packed batch: token 2 (the last of completion 0) masked out, so that cu_seqlens [0, 3, ...] and
    [0, 2, ...] hold the same counted tokens in the same completions."""
    g = torch.Generator().manual_seed(8)
    N = sum(LENGTHS)
    x = torch.randn(N, V, generator=g)
    ids = torch.randint(0, V, (N,), generator=g)
    mask = torch.ones(N, dtype=torch.bool)
    mask[2] = False
    cu = torch.tensor([0, 3, 5, 9, 12])
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    old = -torch.rand(N, generator=g) * 2 - 0.5
    h, w = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g)
    return x, ids, mask, cu, adv, old, h, w


def _vocab_scenarios(rank, world, bad):
    """name -> (call, expected: 'same' (every rank returns, equal values) or the text every error holds)."""
    x, ids, mask, cu, adv, old, h, w = _data()
    sl = slice(sum(SPLITS[world][:rank]), sum(SPLITS[world][:rank + 1]))
    xs, ws, pg, me = x[:, sl], w[sl], dist.group.WORLD, rank == bad
    N = ids.numel()

    def odd(mine, others):
        return mine if me else others

    def loss(config="grpo", **kw):
        kw = {"cu_seqlens": cu, "max_seqlen": 4, "old_logps": old, "group_size": G, **kw}
        out = gtpo_loss(xs, ids, kw.pop("adv", adv), mask, config=config, backend="torch", process_group=pg, **kw)
        return [float(out.loss)] + out.logps.tolist()

    def head(config="grpo", **kw):
        out = linear_gtpo_loss(h, ws, ids, adv, mask, config=config, cu_seqlens=cu, group_size=G, backend="torch",
                               process_group=pg, **kw)
        return [float(out.loss)]

    def bumped(t, k, by=0.25):
        t = t.clone()
        if me:
            t[k] += by
        return t
    lam, n_conf = torch.ones(N), torch.tensor([1.0, 2.0, 1.0, 3.0])
    official = GTPOConfig(loss_agg="gtpo-official")
    return {
        # the whole cu_seqlens: the boundary moves across the masked-out token 2 only
        "cu_seqlens_around_a_masked_token": (lambda: loss(cu_seqlens=odd(torch.tensor([0, 2, 5, 9, 12]), cu)),
                                             "disagree on cu_seqlens and max_seqlen"),
        "max_seqlen_differs": (lambda: loss(max_seqlen=odd(5, 4)), "disagree on cu_seqlens and max_seqlen"),
        "max_seqlen_given_on_one_rank": (lambda: loss(max_seqlen=odd(None, 4)), "disagree on cu_seqlens"),
        "advantages_differ": (lambda: loss(adv=bumped(adv, 1)), "disagree on advantages"),
        "old_logps_differ": (lambda: loss(old_logps=bumped(old, 4)), "disagree on old_logps"),
        "old_logps_on_one_rank": (lambda: loss(old_logps=odd(None, old)), "disagree on old_logps"),
        "ref_logps_differ": (lambda: loss(config=GTPOConfig.preset("grpo", beta=0.1), ref_logps=bumped(old, 6)),
                             "disagree on ref_logps"),
        "lam_differs": (lambda: loss(config=official, lam=bumped(lam, 5), n_conf=n_conf), "disagree on lam"),
        "n_conf_differs": (lambda: loss(config=official, lam=lam, n_conf=bumped(n_conf, 0, 1.0)),
                           "disagree on n_conf"),
        "rollout_weights_differ": (lambda: loss(rollout_is_weights=bumped(torch.ones(N), 7)),
                                   "disagree on rollout_is_weights"),
        "rollout_logps_differ": (lambda: loss(rollout_logps=bumped(old, 3)), "disagree on rollout_logps"),
        "rollout_weights_per_completion_differ": (lambda: loss(rollout_is_weights=bumped(torch.ones(4, 1), 2)),
                                                  "disagree on rollout_is_weights"),
        "eps_high_differs": (lambda: loss(GTPOConfig.preset("grpo", eps_high=odd(0.28, 0.2))), "disagree on the options"),
        "clip_differs": (lambda: loss(GTPOConfig.preset("grpo", clip=not me)), "disagree on the options"),
        "head_eps_high_differs": (lambda: head(GTPOConfig.preset("grpo", eps_high=odd(0.28, 0.2))),
                                  "disagree on the options"),
        # the sampler's rules (spec 13): the error names the argument that differs
        "top_k_differs": (lambda: loss(top_k=odd(3, 4)), "disagree on top_k"),
        "top_p_differs": (lambda: loss(top_k=5, top_p=odd(0.8, 0.9)), "disagree on top_p"),
        "min_p_differs": (lambda: loss(top_k=5, min_p=odd(0.2, 0.1)), "disagree on min_p"),
        "head_top_k_differs": (lambda: head(top_k=odd(3, 4)), "disagree on top_k"),
        # a check that fails on one rank before its head is made (the head once read it, UnboundLocalError there
        # and the other ranks left waiting in the agreement)
        "head_temperature_refused_on_one_rank": (lambda: head(temperature=odd(-1.0, 1.0)), "refused their arguments"),
        "head_config_refused_on_one_rank": (lambda: head(config=odd("nope", "grpo")), "refused their arguments"),
        "linear_logprobs_temperature_refused": (lambda: linear_token_logprobs(h, ws, ids, odd(-1.0, 1.0), mask,
                                                                             cu_seqlens=cu, process_group=pg),
                                                "refused their arguments"),
        "head_batch_invariant_differs": (lambda: head(batch_invariant=odd(True, False)), "disagree on the options"),
        "logprobs_max_seqlen_differs": (lambda: token_logprobs(xs, ids, 1.0, mask, cu_seqlens=cu,
                                                               max_seqlen=odd(5, 4), process_group=pg),
                                        "disagree on cu_seqlens and max_seqlen"),
        "linear_logprobs_cu_seqlens_differ": (lambda: linear_token_logprobs(
            h, ws, ids, 1.0, mask, cu_seqlens=odd(torch.tensor([0, 2, 5, 9, 12]), cu), process_group=pg),
            "disagree on cu_seqlens and max_seqlen"),
        # one value written differently: no refusal, the same numbers on every rank
        "temperature_1_and_1.0": (lambda: loss(GTPOConfig.preset("grpo", temperature=odd(1, 1.0))), "same"),
        "temperature_0.5_and_tensor": (lambda: loss(GTPOConfig.preset("grpo", temperature=odd(torch.tensor(0.5),
                                                                                                 0.5))), "same"),
        "entropy_coef_0.0_and_tensor": (lambda: loss(GTPOConfig.preset("grpo", entropy_coef=odd(torch.tensor(0.0),
                                                                                                   0.0))), "same"),
        "logprobs_temperature_1_and_1.0": (lambda: token_logprobs(xs, ids, odd(1, 1.0), mask, cu_seqlens=cu,
                                                                  process_group=pg)[0].tolist(), "same"),
        "linear_logprobs_temperature": (lambda: linear_token_logprobs(h, ws, ids, odd(torch.tensor(0.5), 0.5), mask,
                                                                      cu_seqlens=cu, process_group=pg)[0].tolist(),
                                        "same"),
        "dtensor_and_process_group_on_one_rank": (lambda: _dtensor_call(rank, world, me), "refused their arguments"),
        "dtensor_logprobs_and_process_group": (lambda: _dtensor_call(rank, world, me, token_logprobs),
                                               "refused their arguments"),
    }


def _dtensor_call(rank, world, me, fn=None):
    """A Shard(-1) DTensor on every rank; rank `bad` passes a process_group as well (refused)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    x, ids, mask, cu, adv, old, _, _ = _data()
    mesh = init_device_mesh("cpu", (world,))
    chunk = -(-V // world)
    local = x[:, rank * chunk:min(V, (rank + 1) * chunk)].clone()
    xd = DTensor.from_local(local, mesh, [Shard(1)], run_check=False, shape=x.shape, stride=x.stride())
    kw = {"process_group": _OTHER_GROUP} if me else {}
    if fn is not None:
        return fn(xd, ids, 1.0, mask, cu_seqlens=cu, **kw)[0].tolist()
    return [float(gtpo_loss(xd, ids, adv, mask, cu_seqlens=cu, group_size=G, config="grpo", **kw).loss)]


_OTHER_GROUP = None


def _dp_scenarios(rank, world, bad):
    """conflict_weights(process_group=) with groups of 2 straddling ranks."""
    x, ids, mask, cu, adv, old, _, _ = _data()
    pg, me = dist.group.WORLD, rank == bad
    T = 4
    pad_ids = torch.randint(0, 5, (world * 2, T), generator=torch.Generator().manual_seed(1))
    pad_adv = torch.tensor([1.0, -1.0] * world)
    mine = slice(2 * rank, 2 * rank + 2)
    cfg = GTPOConfig(conflict_pos_weight=odd_value(me, 3.0, 2.0))

    def empty_padded():  # rank `bad` holds no rows, the next rank its two besides its own
        counts = [2] * world
        counts[bad], counts[(bad + 1) % world] = 0, 4
        start = sum(counts[:rank])
        s = slice(start, start + counts[rank])
        lam, n_conf = conflict_weights(pad_ids[s], None, pad_adv[s], G, process_group=pg)
        one = conflict_weights(pad_ids, None, pad_adv, G)
        assert torch.equal(lam, one[0][s]) and torch.equal(n_conf, one[1][s])
        return list(lam.shape)

    def empty_keyed():  # rank `bad` holds no rows; groups by key, the keys gathered as objects
        counts = [2] * world
        counts[bad], counts[(bad + 1) % world] = 0, 4
        start = sum(counts[:rank])
        s = slice(start, start + counts[rank])
        keys = [f"g{i // 2}" for i in range(2 * world)]
        lam, _ = conflict_weights(pad_ids[s], None, pad_adv[s], group_ids=keys[s], process_group=pg)
        assert torch.equal(lam, conflict_weights(pad_ids, None, pad_adv, G)[0][s])
        return list(lam.shape)

    def empty_packed():
        n = 0 if me else 2
        own = ids[:3 * n] if n else ids[:0]
        own_cu = torch.tensor([0, 3, 6][:n + 1])
        return conflict_weights(own, None, adv[:n], G, cu_seqlens=own_cu, process_group=pg)[1].tolist()

    def short_max_seqlen():  # unvalidated: each rank's own max_seqlen is not what the whole batch is padded to
        own = pad_ids[mine].reshape(-1)
        lam, _ = conflict_weights(own, None, pad_adv[mine], G, cu_seqlens=torch.tensor([0, T, 2 * T]),
                                  max_seqlen=odd_value(me, 1, T), validate=False, process_group=pg)
        assert torch.equal(lam, conflict_weights(pad_ids, None, pad_adv, G)[0][mine].reshape(-1))
        return lam.tolist()
    return {
        "dp_zero_rows_padded": (empty_padded, "returns"),
        "dp_zero_rows_packed": (empty_packed, "returns"),
        "dp_zero_rows_group_ids": (empty_keyed, "returns"),
        "dp_short_max_seqlen_unvalidated": (short_max_seqlen, "returns"),
        "dp_config_differs": (lambda: conflict_weights(pad_ids[mine], None, pad_adv[mine], G, config=cfg,
                                                       process_group=pg), "disagree on the options"),
        # validating, a counted negative id on one rank is refused on every rank (it was lam = NaN on that rank)
        "dp_negative_id_validated": (lambda: conflict_weights(
            torch.where(torch.tensor(me) & (torch.arange(T) == 1), -3, pad_ids[mine]), None, pad_adv[mine], G,
            process_group=pg), "refused their arguments"),
        "dp_dtype_differs": (lambda: conflict_weights(pad_ids[mine], None, pad_adv[mine], G, process_group=pg,
                                                      dtype=torch.float64 if me else torch.float32),
                             "disagree on the options"),
    }


def odd_value(me, mine, others):
    return mine if me else others


def _plain(v):
    """JSON-able: tensors as lists."""
    if isinstance(v, torch.Tensor):
        return v.tolist()
    return [_plain(x) for x in v] if isinstance(v, (tuple, list)) else v


def _outcome(call):
    try:
        return {"raised": False, "value": _plain(call())}
    except Exception as e:  # noqa: BLE001 - recorded, as a trainer would log it
        return {"raised": True, "text": f"{type(e).__name__}: {e}",
                "cause": None if e.__cause__ is None else f"{type(e.__cause__).__name__}: {e.__cause__}"}


def run_agreement(rank, world):
    """Every scenario on this rank (rank 0 the odd one with 2 ranks, the last with 3) -> outcomes."""
    global _OTHER_GROUP
    _OTHER_GROUP = dist.new_group(list(range(world)))  # every rank makes it (collective); one passes it
    out, bad = {}, (0 if world == 2 else world - 1)
    for name, (call, expect) in {**_vocab_scenarios(rank, world, bad), **_dp_scenarios(rank, world, bad)}.items():
        out[name] = dict(_outcome(call), expect=expect, bad=bad)
        progress(name)
        sync(name)  # a rank that raised waits here, alive, for the others
    return out


def check_agreement(results, world):
    """The ranks' outcomes (rank order): printed, then each scenario as expected on every rank."""
    print(f"\n{world} ranks, what the ranks must agree on:")
    for key, first in results[0].items():
        outs = [res[key] for res in results]
        texts = {o.get("text", "returned") for o in outs}
        print(f"  {key}: " + (f"all {world} ranks raised: {first['text'][:150]}" if len(texts) == 1 and first["raised"]
                               else " | ".join(f"rank {r}: {o.get('text', 'returned')[:100]}"
                                               for r, o in enumerate(outs))))
    for key, first in results[0].items():
        outs = [res[key] for res in results]
        texts = {o.get("text", "returned") for o in outs}
        if first["expect"] == "same":  # every rank returns the same numbers
            assert not any(o["raised"] for o in outs), (key, outs)
            assert all(o["value"] == first["value"] for o in outs), (key, [o["value"] for o in outs])
        elif first["expect"] == "returns":  # data-parallel: each rank its own rows
            assert not any(o["raised"] for o in outs), (key, outs)
        else:
            assert all(o["raised"] for o in outs), (key, outs)
            assert len(texts) == 1, (key, texts)
            assert first["expect"] in first["text"], (key, first["text"])
            named = re.search(r"rank\(s\) \[([0-9, ]*)\]", first["text"])
            assert named and str(first["bad"]) in named.group(1).split(", "), (key, first["text"])
