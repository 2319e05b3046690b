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
import pytest
import torch
import torch.distributed as dist

from gloo import progress, record, run_ranks_ok, sync
from gloo_cases import B, EMPTY, SPLITS, T, TOL, Ctx, dp_empty, dtensor, logprobs, packed_view, summary
from gtpo_kernels import GTPOConfig, gtpo_loss
from gtpo_kernels.core import vocab_block

WATCHDOG_S = 30
ALIGNED16 = {2: [16, 21], 3: [16, 16, 5]}  # every slice at a multiple of 16, not of 8192


def with_block(block, call):
    """call() with this process's VOCAB_BLOCK as GTPO_VOCAB_BLOCK=block would set it at import."""
    saved, vocab_block.VOCAB_BLOCK = vocab_block.VOCAB_BLOCK, block
    try:
        return call()
    finally:
        vocab_block.VOCAB_BLOCK = saved

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
        # the fused head puts the rows it may skip (A = 0: completion 2) last in their tile, when it skips
        "requires_grad: weight and bias frozen on one rank (head)": (lambda: c.linear(
            grpo, grpo, rg=(True, not odd, not odd)), "same"),
        "requires_grad: nothing on one rank (head)": (lambda: c.linear(
            grpo, grpo, rg=(not odd, not odd, not odd), sum_hidden=False), "same"),
        "entropy_coef 0.0 | tensor(0.) (head)": (lambda: c.linear(grpo.replace(entropy_coef=rep(0.0)), grpo), "same"),
        "logit_scale 1 | 1.0, logit_softcap 4 | 4.0 (head)": (lambda: c.linear(  # (numbers only: documented)
            gtpo, gtpo, scale=one(1, 1.0), cap=one(4, 4.0), schedule="recompute"), "same"),
        "empty slice: gtpo_loss": (lambda: c.logits(gtpo, gtpo, splits=EMPTY), "same"),
        "empty slice: token_logprobs, linear_token_logprobs": (lambda: logprobs(c, EMPTY), "same"),
        "token_logprobs temperature 1 | tensor(1.) | 1.0": (lambda: logprobs(c, SPLITS, rep(1)), "same"),
        "cu_seqlens int64 | int32": (lambda: c.packed(gtpo, cu=packed_view(d)[1].to(one(torch.int64, torch.int32)),
                                                      max_seqlen=T), "same"),
        "data-parallel conflict_weights, a rank with no rows": (lambda: dp_empty(c), "same"),
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
        "group_size 2 | 4": (lambda: summary(gtpo_loss(d["x"][..., c.sl()], d["ids"], d["adv"], d["mask"],
                                                       group_size=one(2, 4), process_group=c.pg)), "refuse"),
        "logit_scale 1.0 | 0.5 (head)": (lambda: c.linear(grpo, scale=one(1.0, 0.5)), "refuse"),
        "logit_softcap None | 4 (head)": (lambda: c.linear(grpo, cap=one(None, 4.0)), "refuse"),
        "cu_seqlens around a masked-out token": (lambda: c.packed(gtpo, cu=torch.tensor(one([0, 5, 10, 15, 20],
                                                                                         [0, 4, 10, 15, 20]))),
                                                 "refuse"),
        "max_seqlen 5 | 6": (lambda: c.packed(gtpo, max_seqlen=one(5, 6)), "refuse"),
        "token_logprobs temperature 1.0 | 0.5": (lambda: logprobs(c, SPLITS, one(1.0, 0.5)), "refuse"),
        # last: on a defect these hang, and the watchdog then ends the whole group
        "empty slice: head, tiles, fused": (lambda: c.linear(grpo, grpo, splits=EMPTY, memory_budget=2 * 37 * 4 * 3,
                                                             schedule="fused"), "same"),
        "empty slice: head, tiles, recompute": (lambda: c.linear(gtpo, gtpo, splits=EMPTY, memory_budget=2 * 37 * 4 * 3,
                                                                 schedule="recompute"), "same"),
        "max_seqlen lying on one rank (head, filter, validate=False)": (lambda: c.packed(
            GTPOConfig(entropy_threshold=3.3, use_conflict_mask=False), max_seqlen=one(5, 2), head=True,
            validate=False, memory_budget=2 * 20 * 4 * 6), "refuse"),
        "DTensor Shard(-1), one rank also passing process_group": (lambda: dtensor(c, one(None, c.other)), "refuse"),
        # (before, silently wrong: every rank placed its shard at its group rank, not at its mesh coordinate)
        "DTensor Shard(-1) on a mesh listing the ranks in reverse": (lambda: dtensor(c, None, c.reversed), "refuse"),
        # (before, a hang: the odd rank merged by blocks, the others by all-reduces)
        "GTPO_VOCAB_BLOCK 8192 | 16": (lambda: with_block(one(vocab_block.VOCAB_BLOCK, 16), lambda: c.logits(
            grpo, splits=ALIGNED16)), "refuse"),
    }
    return S


def _outcome(call):
    try:
        return {"raised": False, **call()}
    except Exception as e:  # noqa: BLE001 - recorded, as a trainer would log it
        cause = e.__cause__
        return {"raised": True, "text": f"{type(e).__name__}: {e}",
                "cause": None if cause is None else f"{type(cause).__name__}: {cause}"}


def _run(rank, world):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    c = Ctx(rank, world)
    c.mesh = init_device_mesh("cpu", (world,))
    c.other = dist.new_group(list(range(world)))  # the same ranks, another group object
    c.reversed = DeviceMesh("cpu", torch.arange(world).flip(0))  # rank r at coordinate world - 1 - r
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
    results = run_ranks_ok(_run, world, watchdog=WATCHDOG_S, partial=True)
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
