"""Validating on vocabulary-parallel logits (spec 8, 12): the value checks ride on the agreement's read, and
the row's own kernel forms their predicates (core.host_read.RowCheck: advantages, old / ref log-probs and
lam finite at counted tokens, ids >= 0 at counted tokens, n_conf finite and >= 1, rollout weights per
token finite and >= 0 at counted tokens, per completion where a counted token reads them (never spread on the
tokens), the mask's values 0 or 1, the packed form's
cu_seqlens from 0 to N, never decreasing, and no completion longer than max_seqlen), so that they launch
nothing of their own. On 2 gloo ranks, the Triton backend under the interpreter: a bad value on one rank
makes every rank raise the same error naming that rank, chained on it to the check's own error (the first
check made, when two fail); a bad value where the mask drops the token is no error, and the loss is the
clean call's on every rank; unvalidated, a malformed cu_seqlens gives NaN at every counted output and
gradient row of every rank (a masked-out token's 0 and no gradient, as one process gives), and token_logprobs gives NaN at a flagged counted token (a NaN logit in one
slice, an id outside the vocabulary) and 0 where masked, as one process on the whole vocabulary does. The LM
head's calls (linear_gtpo_loss, linear_token_logprobs) hand their value checks to the agreement alike."""
import pytest
import torch
import torch.distributed as dist

from gloo import run_ranks_ok
from gtpo_kernels import GTPOConfig, gtpo_loss, linear_gtpo_loss, linear_token_logprobs, token_logprobs

SIZES = [20, 17]
B, T, V = 4, 5, 37
REFUSED = "refused their arguments"


def _data():
    g = torch.Generator().manual_seed(13)
    x = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[3, 4] = 0
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    old = -torch.rand(B, T, generator=g) * 3 - 1.5
    return x, ids, mask, adv, old


def _edit(t, idx, v, me):
    t = t.clone()
    if me:
        t[idx] = v
    return t


def _refused(call, text):
    """Whether call() raises a ValueError holding `text` (a disagreement: the same on every rank, no cause)."""
    try:
        call()
    except ValueError as e:
        return text in str(e)
    return False


def _scenarios(rank, bad):
    """name -> (call, the text of the bad rank's own error, or None: no error, the clean loss)."""
    x, ids, mask, adv, old = _data()
    sl = slice(sum(SIZES[:rank]), sum(SIZES[:rank + 1]))
    xs, me, pg = x[..., sl], rank == bad, dist.group.WORLD
    h = torch.randn(B, T, 8, generator=torch.Generator().manual_seed(5))
    hw = torch.randn(V, 8, generator=torch.Generator().manual_seed(6))[sl]  # this rank's rows of the head
    official = GTPOConfig(loss_agg="gtpo-official")
    lam, n_conf = torch.rand(B, T, generator=torch.Generator().manual_seed(2)) + 0.5, torch.tensor([1.0, 2, 1, 3])

    def loss(i=ids, m=mask, a=adv, o=old, cfg="grpo", **kw):
        out = gtpo_loss(xs, i, a, m, group_size=2, old_logps=o, config=cfg, backend="triton", process_group=pg, **kw)
        return float(out.loss)

    keep = mask.reshape(-1) != 0
    cu = torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(1).cumsum(0)])  # [0, 5, 10, 15, 19]

    def packed(o=old, c=cu, max_seqlen=T, validate=True, m=None, **kw):
        part = xs.reshape(B * T, -1)[keep].clone().requires_grad_()
        m = m if validate else (torch.arange(19) != 6).float()  # (unvalidated: token 6 masked out)
        out = gtpo_loss(part, ids.reshape(-1)[keep], adv, m, group_size=2, old_logps=o.reshape(-1)[keep],
                        config="grpo", backend="triton", process_group=pg, cu_seqlens=c, max_seqlen=max_seqlen,
                        validate=validate, **kw)
        if validate:
            return float(out.loss)
        out.loss.backward()  # unvalidated, malformed: every counted output and gradient row NaN, on every rank;
        counted = m != 0  # the masked-out token's 0 and no gradient, as one process on the whole vocabulary gives
        return bool(out.loss.isnan() and out.logps[counted].isnan().all() and out.entropy[counted].isnan().all()
                    and part.grad[counted].isnan().all(1).all() and out.logps[6] == 0 and out.entropy[6] == 0
                    and (part.grad[6] == 0).all())

    nan, inf = float("nan"), float("inf")

    def logprobs_flagged(backend):  # unvalidated: NaN at a flagged counted token, 0 where masked, as one process gives
        xx, i = x.clone(), ids.clone()
        xx[1, 2, 3] = nan  # (in rank 0's slice)
        i[2, 1], i[3, 4] = V + 4, -2  # out of range at a counted token; at the masked-out one
        lp1, h1 = token_logprobs(xx, i, 0.8, mask, backend=backend, validate=False)
        lp, h = token_logprobs(xx[..., sl], i, 0.8, mask, backend=backend, validate=False, process_group=pg)
        same = all(torch.equal(a.isnan(), b.isnan()) and torch.allclose(a.nan_to_num(), b.nan_to_num(), atol=1e-5)
                   for a, b in ((lp, lp1), (h, h1)))
        return bool(same and lp[1, 2].isnan() and h[2, 1].isnan() and lp[3, 4] == 0 and h[3, 4] == 0
                    and int(lp.isnan().sum()) == 2)
    return {
        "clean": (lambda: loss(), None),
        "advantage_nan": (lambda: loss(a=_edit(adv, 2, nan, me)), "advantages must be finite; flat position 2 holds nan"),
        "old_logps_inf": (lambda: loss(o=_edit(old, (1, 3), -inf, me)),
                          "old_logps must be finite at counted positions; flat position 8 holds -inf"),
        "old_logps_nan_masked_out": (lambda: loss(o=_edit(old, (3, 4), nan, me)), None),
        "old_logps_nan_float_mask_out": (lambda: loss(m=mask.float(), o=_edit(old, (3, 4), nan, me)), None),
        "ref_logps_nan": (lambda: loss(cfg=GTPOConfig.preset("grpo", beta=0.1), ref_logps=_edit(old, (0, 1), nan, me)),
                          "ref_logps must be finite at counted positions; flat position 1 holds nan"),
        "lam_inf": (lambda: loss(cfg=official, lam=_edit(lam, (2, 0), inf, me), n_conf=n_conf),
                    "lam must be finite at counted positions; flat position 10 holds inf"),
        "id_negative": (lambda: loss(i=_edit(ids, (1, 2), -3, me)),  # (V is known after the agreement, not [0, inf))
                        "(V: the whole vocabulary over the group) at counted positions; flat position 7 holds -3"),
        "n_conf_below_1": (lambda: loss(cfg=official, lam=lam, n_conf=_edit(n_conf, 2, 0.5, me)),
                           "n_conf must be finite and >= 1 (conflict_weights' counts: at least 1 per completion); "
                           "completion 2 holds 0.5"),
        "rollout_weight_negative": (lambda: loss(rollout_is_weights=_edit(torch.ones(B, T), (0, 3), -0.5, me)),
                                    "rollout_is_weights must be >= 0 and finite at counted positions"),
        "rollout_seq_weight_inf": (lambda: loss(rollout_is_weights=_edit(torch.ones(B, 1), 1, float("inf"), me)),
                                   "rollout_is_weights must be >= 0 and finite at counted positions"),
        "rollout_seq_weight_nan_at_a_masked_completion": (lambda: loss(m=_edit(mask, 2, 0, True), rollout_is_weights=_edit(
            torch.ones(B, 1), 2, nan, me)), None),
        "rollout_weight_nan_masked_out": (lambda: loss(rollout_is_weights=_edit(torch.ones(B, T), (3, 4), nan, me)),
                                          None),
        # the same weights in another form, or different only where nothing is counted: no disagreement
        "rollout_seq_differs_at_a_masked_completion": (lambda: loss(m=_edit(mask, 2, 0, True), rollout_is_weights=_edit(
            torch.ones(B, 1), 2, 3.0, me)), None),
        "rollout_seq_differs_at_a_counted_completion": (lambda: _refused(lambda: loss(rollout_is_weights=_edit(
            torch.ones(B, 1), 1, 3.0, me)), "disagree on rollout_is_weights"), True),
        "rollout_seq_and_token_forms": (lambda: loss(rollout_is_weights=torch.full((B, 1), 0.5) if me else
                                                     torch.full((B, T), 0.5)), None),
        "rollout_b_and_b1_at_t1": (lambda: float(gtpo_loss(xs[:, :1], ids[:, :1], adv, _edit(mask[:, :1], 2, 0, True),
                                                           group_size=2, old_logps=old[:, :1], config="grpo",
                                                           backend="triton", process_group=pg, rollout_is_weights=(
                                                               torch.full((B,), 0.5) if me else torch.full((B, 1), 0.5))
                                                           ).loss), None),
        "id_negative_masked_out": (lambda: loss(i=_edit(ids, (3, 4), -3, me)), None),
        "mask_value_2": (lambda: loss(m=_edit(mask, (2, 2), 2, me)), "completion_mask must hold only 0 and 1"),
        # two checks fail: the first made (the mask's, in the tokens' preparation) is the one named
        "mask_and_advantage": (lambda: loss(m=_edit(mask, (2, 2), 2, me), a=_edit(adv, 0, nan, me)),
                               "completion_mask must hold only 0 and 1"),
        "advantage_and_old_logps": (lambda: loss(a=_edit(adv, 1, inf, me), o=_edit(old, (0, 0), nan, me)),
                                    "advantages must be finite; flat position 1 holds inf"),
        "packed_old_logps_nan": (lambda: packed(_edit(old, (2, 1), nan, me)),
                                 "old_logps must be finite at counted positions; flat position 11 holds nan"),
        "packed_clean": (lambda: packed(), None),
        "packed_cu_decreasing": (lambda: packed(c=_edit(cu, 2, 4, me)), "cu_seqlens must start at 0, never decrease"),
        "packed_cu_short_of_n": (lambda: packed(c=_edit(cu, 4, 18, me)), "and end at N = 19"),
        "packed_cu_not_from_0": (lambda: packed(c=_edit(cu, 0, 1, me)), "cu_seqlens must start at 0"),
        "packed_max_seqlen_short": (lambda: packed(max_seqlen=4), "max_seqlen = 4 is shorter than the longest "
                                    "completion in cu_seqlens (5)"),  # (on every rank: both refuse)
        "packed_max_seqlen_short_first": (lambda: packed(c=torch.tensor([0, 7, 11, 15, 19]), max_seqlen=6),
                                          "max_seqlen = 6 is shorter than the longest completion in cu_seqlens (7)"),
        # per completion, packed: checked where a counted token of its completion reads it (cu_seqlens' [5, 10))
        "packed_rollout_seq_inf": (lambda: packed(rollout_is_weights=_edit(torch.ones(B, 1), 1, inf, me)),
                                   "rollout_is_weights must be >= 0 and finite at counted positions"),
        "packed_rollout_seq_nan_at_a_masked_completion": (lambda: packed(
            m=(torch.arange(19) // 5 != 1).long(), rollout_is_weights=_edit(torch.ones(B, 1), 1, nan, me)), None),
        "packed_tau_seq_negative": (lambda: packed(temperature=_edit(torch.ones(B), 1, -1.0, me)),
                                    "temperature must be finite and > 0, with 1 / tau finite, at counted tokens; "
                                    "flat token position 5 holds -1.0"),
        "tau_seq_zero": (lambda: loss(temperature=_edit(torch.ones(B, 1), 3, 0.0, me)),
                         "temperature must be finite and > 0, with 1 / tau finite, at counted tokens; "
                         "flat token position 15 holds 0.0"),
        "packed_tau_seq_nan_at_a_masked_completion": (lambda: packed(
            m=(torch.arange(19) // 5 != 1).long(), temperature=_edit(torch.ones(B), 1, nan, me)), None),
        "packed_malformed_unvalidated": (lambda: packed(c=torch.tensor([0, 5, 4, 15, 19]), validate=False), True),
        "logprobs_flagged_unvalidated": (lambda: logprobs_flagged("triton"), True),
        "logprobs_flagged_unvalidated_torch": (lambda: logprobs_flagged("torch"), True),
        # the LM head: its value checks ride on the agreement's read too
        "linear_advantage_nan": (lambda: float(linear_gtpo_loss(h, hw, ids, _edit(adv, 2, nan, me), mask, group_size=2,
                                                                old_logps=old, config="grpo", backend="triton",
                                                                process_group=pg).loss),
                                 "advantages must be finite; flat position 2 holds nan"),
        "linear_logprobs_mask_value_2": (lambda: float(linear_token_logprobs(h, hw, ids, 1.0, _edit(mask, (1, 1), 2, me),
                                                                             backend="triton", process_group=pg)[0].sum()),
                                         "completion_mask must hold only 0 and 1"),
        "logprobs_id_negative": (lambda: float(token_logprobs(xs, _edit(ids, (0, 0), -1, me), 1.0, mask,
                                                              backend="triton", process_group=pg)[0].sum()),
                                 "flat position 0 holds -1"),
    }


def _run(rank, world):
    out = {}
    for bad in (0, world - 1):
        for name, (call, expect) in _scenarios(rank, bad).items():
            try:
                out[f"{name}/{bad}"] = dict(value=call(), expect=expect, bad=bad)
            except Exception as e:  # noqa: BLE001 - recorded, compared across the ranks
                out[f"{name}/{bad}"] = dict(text=f"{type(e).__name__}: {e}", expect=expect, bad=bad,
                                            cause=None if e.__cause__ is None else str(e.__cause__))
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks_ok(_run, 2, watchdog=120)


def test_a_bad_value_on_one_rank_makes_every_rank_raise_the_check_s_error(results):
    clean = [res["clean/0"]["value"] for res in results]
    assert clean[0] == clean[1] and clean[0] == clean[0]  # a number, the same on both ranks
    assert abs(results[0]["packed_clean/0"]["value"] - clean[0]) < 1e-6 * abs(clean[0])  # packed as padded
    for key, first in results[0].items():
        outs = [res[key] for res in results]
        if first["expect"] is None or first["expect"] is True:  # no error: the clean call's loss, or all NaN
            assert all("value" in o for o in outs), (key, outs)
            assert all(o["value"] == first["value"] for o in outs), (key, outs)  # the same on every rank
            if key.startswith(("old_logps_nan", "id_negative_masked")):
                assert all(o["value"] == clean[0] for o in outs), (key, outs)
            assert first["expect"] is None or all(o["value"] is True for o in outs), (key, outs)
            continue
        bad = [0, 1] if key.startswith("packed_max_seqlen_short") else [first["bad"]]  # (short on every rank)
        assert all("text" in o for o in outs), (key, outs)
        assert len({o["text"] for o in outs}) == 1, (key, outs)  # the same error on every rank
        assert REFUSED in first["text"] and f"rank(s) {bad}" in first["text"], (key, first["text"])
        assert all(first["expect"] in (outs[r]["cause"] or "") for r in bad), (key, outs)
        assert all(o["cause"] is None for r, o in enumerate(outs) if r not in bad), (key, outs)
