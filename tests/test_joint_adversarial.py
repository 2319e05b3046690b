"""The option space under the conditions a trainer creates and the first generator never drew: every
option traced by torch.compile(fullgraph=True) (with a max_seqlen that lies, autocast, saturated
soft-caps and the sampler's kept sets, recorded or rebuilt, on the logits and the head, drawn as in
tests/test_joint.py), and non-finite values in every O(B) / O(N) input with the
entropy filter on (spec 6): refused naming the argument with validate=True, NaN in every output it
touches with validate=False, even where the filter drops the completion."""
import dataclasses
import re
import types

import pytest
import torch
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

import joint_calls
from conftest import examples
from gtpo_kernels import conflict_weights
from joint_calls import (api_side, call_linear, call_logits, call_logps, completion_entropy, precomputed,
                         rollout_weights)
from joint_replay import Replay
import gtpo_reference as ref
from joint_strategies import (LOSS_AGGS, Joint, build_data, head_values, joints, logits_values, materialize,
                              side_inputs)
from test_joint import REFUSALS, build_config, check_joint, expected_refusals

# dynamo's whole-graph trace (fake tensors: data-dependent shapes, graph breaks), run eagerly: AOTAutograd
# and inductor cost 20-60 s an example on a CPU (inductor with the defaults: tests/test_contract.py)
BACKEND = "eager"
FIELDS = ("loss", "logps", "entropy", "per_token_loss", "lam", "n_conf", "kept", "seq_entropy", "metrics")


def compiled(f):
    """f() traced whole by torch.compile(fullgraph=True) (a graph break fails); the output's fields."""
    torch._dynamo.reset()
    step = torch.compile(lambda: tuple(getattr(f(), k) for k in FIELDS), fullgraph=True, backend=BACKEND)
    try:
        return types.SimpleNamespace(**dict(zip(FIELDS, step())))
    except torch._dynamo.exc.Unsupported as e:  # an exception raised inside the trace: the eager call's own
        if "Observed exception" not in str(e):
            raise
        f()  # raises it (a refusal is checked as one); if eager returns, the trace failed on valid input
        raise


@settings(max_examples=examples(3))
@pytest.mark.filterwarnings("ignore::UserWarning")
@given(j=joints(triton_share=0.0, entries=("logits", "linear", "logps")))
def test_compiled_joint_matches_reference(j):
    """torch.compile(fullgraph=True) around the call (the torch backend) with every option drawn and, on
    every example, the ones whose values steer the computation on: the entropy quantile, the bonus, the
    off-policy mask and the KL term. The same numbers as the float64 reference, or the refusal the API
    documents, or NaN for a lie."""
    event(f"compiled entry={j.entry}")
    over = dict(j.over, top_entropy_quantile=0.5, entropy_coef=0.01, off_policy_mask_threshold=0.5, beta=0.04)
    check_joint(dataclasses.replace(j, over=over, with_ref=True, **traced_kept_sets(j)), around=compiled)


def traced_kept_sets(j):
    """The kept sets the compiled test draws: every kind on every entry (a recorded mask or the rules, on
    the logits and on the head); in-place gradients are not taken with them."""
    return {} if j.replay is None else dict(inplace=False)


# Options that once broke the whole-graph trace, each checked on one small example every run: the rules'
# rebuild (a size known only after it runs: a custom op), the head over kept sets (custom ops), and the
# conflict weights of a packed batch without max_seqlen (a longest completion known only at run time).
ONCE_UNTRACED = {
    "kept sets rebuilt by the rules on the logits": dict(replay="rules"),
    "recorded kept sets on the head": dict(entry="linear", replay="mask"),
    "kept sets rebuilt by the rules on the head": dict(entry="linear", replay="rules"),
    "packed without max_seqlen, conflict weights computed": dict(form="packed", preset="gtpo"),
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("case", sorted(ONCE_UNTRACED))
@settings(max_examples=1, database=None)
@given(seed=st.just(3))
def test_traces_whole(case, seed):
    """One small example of each option that torch.compile(fullgraph=True) once could not trace: traced
    whole and equal to the float64 reference."""
    j = Joint(entry="logits", form="padded", dtype=torch.float32, backend="torch", seed=seed, P=1, G=2, T=3, V=8,
              preset="grpo", over={"temperature": 1.0}, logits_start=None, with_old=True, with_ref=True,
              with_roll_lp=False, rollout="none", clip_min=None, clip_max=1.5, conflict="computed", num_items=None,
              with_entropy=True, head=dict(D=4, bias=False, scale=1.0, cap=None, schedule="auto", budget_rows=1000),
              max_seqlen=False, adv_shape="B", uid="int", filter_between=False, rules={"top_k": (3, "num")})
    check_joint(dataclasses.replace(j, **ONCE_UNTRACED[case]), around=compiled)


@settings(max_examples=examples(20))
@pytest.mark.filterwarnings("ignore::UserWarning")
@given(j=joints(entries=("logits", "linear", "linear", "logps"), lie=True), validate=st.booleans())
def test_lying_max_seqlen_refused_or_right_or_nan(j, validate):
    """The packed form with a max_seqlen shorter than the longest completion, every other option drawn:
    validate=True refuses it naming max_seqlen; validate=False gives the reference's numbers or NaN, never
    a finite wrong one (a tile plan resting on it would split a completion the plan thinks whole)."""
    check_joint(dataclasses.replace(j, validate=validate))


@st.composite
def head_joints(draw):
    """The head's tiles made to cut the batch: 4 to 6 completions of 1 or 2 tokens, a budget of 2 or 3 rows
    a tile (tiles of one, several or part of a completion), the fused schedule asked for or chosen, every
    aggregation (the ones that read a whole completion or batch included)."""
    j = dataclasses.replace(draw(joints(entries=("linear",), lie=False)), num_items=None)
    if j.form in ("padded", "packed"):
        j = dataclasses.replace(j, P=2, G=draw(st.sampled_from([2, 3])), T=draw(st.sampled_from([1, 2])))
    agg = draw(st.sampled_from(LOSS_AGGS + ("gtpo-official",) * 3))  # the one that reads n_conf: 4 in 9
    return dataclasses.replace(j, over=dict(j.over, loss_agg=agg),
                               head=dict(j.head, schedule=draw(st.sampled_from(["auto", "fused", "fused"])),
                                         budget_rows=draw(st.sampled_from([2, 3]))))


@settings(max_examples=examples(30))
@pytest.mark.filterwarnings("ignore::UserWarning")
@given(j=head_joints())
def test_head_tiles_match_reference(j):
    """Hidden states + head with tiles of 2 or 3 rows (completions cut between and across tiles), every
    option drawn: the reference's numbers or a documented refusal."""
    check_joint(j)


# (rollout_logps is not among them: spec 9 counts a NaN difference to the sampler's log-probs as 0)
POISON = ("advantages", "old_logps", "ref_logps", "rollout_is_weights", "lam", "n_conf", "entropy", "cu_seqlens")


@st.composite
def poisoned(draw, target):
    """A joint configuration (entry logits, head or log-probs; only the log-probs entry takes `entropy`)
    with `target` made NaN, +inf or -inf on one completion that has counted tokens, validate either way,
    the entropy filter on (dropping that completion or not), the sampler's kept sets as drawn (logits and
    head), and the options under which the call reads that input."""
    j = draw(joints(triton_share=0.15, entries=("logps",) if target == "entropy" else ("logits", "linear", "logps"),
                    lie=False).filter(lambda j: j.B * j.T > 0 and (j.packed or target != "cu_seqlens")))
    j = dataclasses.replace(j, validate=draw(st.sampled_from([False, False, True])), tau=None)  # (tau: not passed)
    return j, target, draw(st.sampled_from([float("nan"), float("inf"), float("-inf")])), draw(st.booleans())


def _reads(j, cfg, target):
    """(j, cfg) changed so that the call reads `target` on every completion."""
    j = dataclasses.replace(j, num_items=None, with_old=j.with_old or target == "old_logps",
                            with_ref=j.with_ref or target == "ref_logps",
                            with_roll_lp=j.with_roll_lp or target == "rollout_logps",
                            with_entropy=True, conflict="precomputed" if target in ("lam", "n_conf") else j.conflict,
                            rollout=("token" if j.rollout in ("none", "b") else j.rollout)
                            if target == "rollout_is_weights" else j.rollout)
    over = {}
    if target == "ref_logps":
        over["beta"] = 0.04
    if target == "rollout_logps":
        over["off_policy_mask_threshold"] = 0.5
    if target == "n_conf":
        over.update(loss_agg="gtpo-official", use_conflict_mask=True)
    if target == "lam":
        over["use_conflict_mask"] = True
    return j, cfg.replace(**over) if over else cfg


@pytest.mark.parametrize("target", POISON)
@pytest.mark.filterwarnings("ignore::UserWarning")
@settings(max_examples=examples(8))
@given(data=st.data())
def test_nonfinite_input_refused_or_nan(target, data):
    j, target, value, drop = data.draw(poisoned(target), label="joint, target, value, drop")
    cfg = build_config(j)
    if cfg is None:
        return
    j, cfg = _reads(j, cfg, target)
    d = build_data(j)
    counted = d.mask.any(1).nonzero().squeeze(1)
    assume(counted.numel() > 0)
    b = int(counted[int(torch.randint(0, counted.numel(), (1,), generator=d.gen))])
    t = int(d.mask[b].nonzero()[0])
    head = head_values(j, d) if j.entry == "linear" else None
    Z = logits_values(j, d) if head is None else materialize(*[None if x is None else x.double() for x in head],
                                                               j.head["scale"], j.head["cap"])
    sampler = Replay(j, d, Z / cfg.temperature)  # the kept sets drawn (logits, head), passed with the poison
    rlp, rent = ref.token_logprobs(sampler.masked(Z), d.ids, cfg.temperature, d.mask)
    hbar = completion_entropy(rent, d.mask)
    # the filter on, the poisoned completion dropped (threshold below its entropy) or kept (above)
    cfg = cfg.replace(entropy_threshold=float(hbar[b]) * (0.5 if drop else 1.5) + (0.0 if drop else 0.1),
                      initial_entropy=None)
    event(f"poison {target} {value} filter {'drops' if drop else 'keeps'} it, validate={j.validate}")
    if j.replay is not None:
        event(f"with kept sets: replay={j.replay}")
    old, refl, roll = side_inputs(j, d, rlp)
    ids, mask, old_a, ref_a, roll_a, form_kw = api_side(j, d, old, refl, roll)
    w_api, _ = rollout_weights(j, d, old, roll)
    lam_kw = {}
    if j.conflict == "precomputed":
        (lam, n_conf), _ = precomputed(j, d, cfg, ids, mask, {k: v for k, v in form_kw.items() if k != "validate"},
                                       torch.float64 if j.dtype == torch.float64 else torch.float32)
        lam_kw = dict(lam=lam, n_conf=n_conf)
    kw = dict(group_size=j.G, old_logps=old_a, ref_logps=ref_a, config=cfg, rollout_is_weights=w_api,
              rollout_logps=roll_a, **lam_kw, **form_kw, **sampler.api, **({"inplace": True} if j.inplace else {}))
    pos = int((d.pos == b * j.T + t).nonzero()[0]) if j.packed else (b, t)  # the token's place in the call

    def poison(x, per_completion):
        x = x.clone()
        x[b if per_completion else pos] = value
        return x
    if target == "advantages":
        d.adv = poison(d.adv, True)
    elif target == "n_conf":
        kw["n_conf"] = poison(kw["n_conf"], True)
    elif target == "rollout_is_weights":
        w = kw[target]
        kw[target] = poison(w, True) if w.dim() == 2 and w.shape[1] == 1 else poison(w, False)
    elif target == "cu_seqlens":  # malformed: not ending at N, not starting at 0, or decreasing
        cu, kind = d.cu_seqlens.clone(), int(torch.randint(0, 3, (1,), generator=d.gen))
        cu[(-1, 0, 1)[kind]] += (1, 1, 2 + int(d.lengths[1:].sum()) if j.B > 1 else 1)[kind]
        kw["cu_seqlens"] = cu
        cw = _outcome(lambda: conflict_weights(ids, mask, d.adv, j.G, cu_seqlens=cu, validate=j.validate))
        assert (j.validate and "cu_seqlens" in cw) or (not j.validate and isinstance(cw, tuple) and all(
            bool(t.isnan().all()) for t in cw)), f"conflict_weights, cu_seqlens {cu.tolist()}: {cw}"
    elif target != "entropy":
        kw[target] = poison(kw[target], False)
    up = torch.randn(j.B, j.T, generator=d.gen, dtype=torch.float64)
    caller = {"logits": call_logits, "logps": call_logps, "linear": call_linear}[j.entry]
    if target == "entropy":  # the log-probs entry's own entropies: poisoned inside the call's input
        real = joint_calls.gtpo_loss_from_logps
        joint_calls.gtpo_loss_from_logps = lambda lp, i, a, m, entropy=None, **k: real(
            lp, i, a, m, entropy=poison(entropy, False), **k)
    try:
        res = caller(j, d, Z if head is None else head, cfg, (ids, mask), kw, d.pack(up) if j.packed else up)
    except (ValueError, TypeError) as e:
        if j.validate and target in str(e):
            event("refused naming the argument")
            return
        expected = dict(expected_refusals(j, cfg, N=int(d.lengths.sum()) if j.packed else None))
        assert any(re.search(pat, str(e)) for r, pat in REFUSALS.items() if r in expected), \
            f"{target} = {value}: unexpected refusal {e!r}"
        event("refused for another documented reason")
        return
    finally:
        if target == "entropy":
            joint_calls.gtpo_loss_from_logps = real
    out, grads = res
    assert not j.validate, f"validate=True accepted {target} = {value} (spec 6: refused naming the argument)"
    required = [r for r, req in expected_refusals(j, cfg, N=int(d.lengths.sum()) if j.packed else None) if req]
    assert not required or target == "cu_seqlens", f"accepted, but the API documents refusing it: {required}"
    loss = out.loss.detach()
    assert not bool(torch.isfinite(loss).all()), f"validate=False, {target} = {value}: finite loss {loss} (spec 6: NaN)"
    event("NaN loss" if bool(loss.isnan().any()) else "infinite loss")
    bad = [n for n, (g, _) in grads.items() if g is not None and bool(torch.isfinite(g).all()) and
           bool((g != 0).any())]
    assert not bad, f"validate=False, {target} = {value}: finite gradients {bad} beside a NaN loss"
    if target == "cu_seqlens":  # spec 6: every output and gradient NaN (zeros where nothing is read: let be)
        live = lambda x: bool((torch.isfinite(x) & (x != 0)).any())  # noqa: E731
        finite = [n for n in ("logps", "entropy", "per_token_loss") if live(getattr(out, n))]
        finite += [n for n, (g, _) in grads.items() if g is not None and live(g)]
        assert not finite, f"validate=False, cu_seqlens {kw['cu_seqlens'].tolist()}: finite entries in {finite}"


def _outcome(f):
    try:
        return f()
    except (ValueError, TypeError) as e:
        return str(e)
