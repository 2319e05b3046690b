"""The option space sampled jointly (issue 16, item 3): one generator (joint_strategies.joints) draws the
entry point (logits, hidden states + head, log-probs, token advantages), the form (padded, packed, empty,
one token), the preset with every option of spec 9, the rollout weights in every shape and mode, the
conflict weights (computed or precomputed), num_items_in_batch, dtype and backend, together with what a
trainer adds: validate=False, a max_seqlen shorter than the longest completion (refused with validate=True;
otherwise the reference's numbers or NaN, never a finite wrong one), a bfloat16 autocast region around a
float32 call, soft-caps saturated by every logit of a row, the sampler's temperature per completion or
per token on the logits and head entries (the reference divides each row by its own), and its kept sets on
the same entries, recorded (sampling_mask) or rebuilt by top_k / top_p / min_p (the reference's logits at
-inf outside each set: tests/joint_replay.py; what is not drawn and why: joint_strategies.replays). A call that
raises must raise one of the refusals the API documents (REFUSALS); every other call is compared with the
float64 reference on the same inputs (values, outputs, metrics, gradients; spec 7 tolerances), and the
family part with TRL 1.16's own _compute_loss on the same log-probs (tests/test_joint_trl.py). The calls, the
reference side and the comparison: tests/joint_calls.py.

Example counts: `python -m pytest -q tests/test_joint.py --hypothesis-show-statistics` lists the share of
each entry point, form and backend (hypothesis events)."""
import dataclasses
import re

import pytest
import torch
from hypothesis import event, given, settings

import gtpo_reference as ref
from conftest import TOL, assert_value_close, examples
from gtpo_kernels import GTPOConfig, gtpo_token_advantages
from joint_calls import (api_side, autocast, away_from_thresholds, call_linear, call_logits, call_logps, compare,
                         completion_entropy, held_values, lying, num_items, precomputed, reference,
                         rollout_weights, settle_filter)
from joint_replay import Replay
from joint_strategies import build_data, head_values, held_logits, joints, logits_values, materialize, side_inputs


# The refusals the API documents, each with the condition under which it applies (spec 6, 9, 11 and the
# docstrings). "required": the call must raise it; otherwise it may (it depends on the tiling).
REFUSALS = {
    "sequence level with cispo/sapo/vespo (spec 9)": r"importance_sampling_level",
    "loss_agg='none' with sequence level": r"loss_agg='none' with importance_sampling_level='sequence'",
    "num_items_in_batch with an aggregation other than token-mean (spec 4)": r"num_items_in_batch",
    "num_items_in_batch <= 0": r"num_items_in_batch",
    "num_items_in_batch with bnpo (spec 9: always the local count)": r"num_items_in_batch with config local_count",
    "beta > 0 without ref_logps": r"ref_logps",
    "schedule='fused' when the coefficients are not tile-local (spec 11)": r"schedule='fused'",
    "entropy missing where the config reads it (spec 10)": r"entropy .*required",
    "per-completion rollout weights (B,) in the packed form (spec 9: ambiguous)": r"rollout_is_weights",
    "max_seqlen shorter than the longest completion (spec 6)": r"max_seqlen",
    "a (B,) temperature in the packed form when B == N (spec 13: ambiguous)": r"temperature of shape .* is ambiguous",
    "a (B,) top_k / top_p / min_p in the packed form when B == N (spec 13: ambiguous)":
        r"(top_k|top_p|min_p) of shape .* is ambiguous",
    "inplace=True with the sampler's kept sets (spec 13)": r"inplace=True is not taken with sampling_mask",
}


def _tau(j):
    """(B, T) float64 temperatures, exact in float32 (the call's dtype for them), one per completion (B, B1)
    or per token (BT), or None."""
    if j.tau is None:
        return None
    g = torch.Generator().manual_seed(j.seed + 11)
    if j.tau in ("B", "B1"):
        t = (torch.rand(j.B, 1, generator=g) * 1.2 + 0.5).float().double()
        return t.expand(j.B, j.T).contiguous()
    return (torch.rand(j.B, j.T, generator=g) * 1.2 + 0.5).float().double()


def _tau_per_completion(j):
    g = torch.Generator().manual_seed(j.seed + 11)
    return (torch.rand(j.B, 1, generator=g) * 1.2 + 0.5).float().double()[:, 0]


def expected_refusals(j, cfg, lie=False, N=None):
    """[(reason, required)] for this configuration (cfg built; the config's own refusal is checked apart);
    lie: the call is given a max_seqlen shorter than its longest completion; N: the number of packed
    tokens, when known ((B,) rollout weights are per-token ones when N == B)."""
    out = [("max_seqlen shorter than the longest completion (spec 6)", True)] if lie and j.validate else []
    if j.tau in ("B", "BT") and j.packed and N is not None and N == j.B:
        out.append(("a (B,) temperature in the packed form when B == N (spec 13: ambiguous)", True))
    if j.replay == "rules" and j.packed and N is not None and N == j.B and \
            any(shape in ("B", "BT") for _, shape in j.rules.values()):
        out.append(("a (B,) top_k / top_p / min_p in the packed form when B == N (spec 13: ambiguous)", True))
    if j.replay is not None and j.inplace:
        out.append(("inplace=True with the sampler's kept sets (spec 13)", True))
    if j.entry == "token_adv":
        if not j.with_entropy and cfg.shapes_advantages:
            out.append(("entropy missing where the config reads it (spec 10)", True))
        return out
    seq = cfg.importance_sampling_level == "sequence"
    if cfg.loss_agg == "none" and seq:
        out.append(("loss_agg='none' with sequence level", True))
    if j.num_items is not None and cfg.loss_agg != "token-mean":
        out.append(("num_items_in_batch with an aggregation other than token-mean (spec 4)", True))
    if j.num_items is not None and cfg.local_count and cfg.loss_agg == "token-mean":
        out.append(("num_items_in_batch with bnpo (spec 9: always the local count)", True))
    if j.num_items is not None and j.num_items[1] == 0:
        # a 0-d tensor is read on the host only when validating (unvalidated: NaN, spec 6)
        out.append(("num_items_in_batch <= 0", j.validate or j.num_items[0] == "float"))
    if cfg.beta > 0 and not j.with_ref:
        out.append(("beta > 0 without ref_logps", True))
    if j.entry == "logps" and not j.with_entropy and cfg.needs_entropy:
        out.append(("entropy missing where the config reads it (spec 10)", True))
    if j.packed and j.rollout == "b" and N != j.B:
        out.append(("per-completion rollout weights (B,) in the packed form (spec 9: ambiguous)", True))
    if j.entry == "linear" and j.head["schedule"] == "fused" and j.replay is None:  # kept sets: no schedule
        span_batch = cfg.top_entropy_quantile < 1.0
        span_completion = cfg.shapes_advantages or seq or cfg.off_policy_mask_threshold is not None or \
            cfg.policy_loss == "vespo"
        if span_batch or cfg.loss_agg == "none" or span_completion:
            out.append(("schedule='fused' when the coefficients are not tile-local (spec 11)",
                        span_batch or cfg.loss_agg == "none"))
    return out


def call_checked(expected, fn):
    """fn() -> its result, or None when it raised one of `expected`; fails on anything else."""
    try:
        result = fn()
    except (ValueError, TypeError) as e:
        reasons = [r for r, _ in expected if re.search(REFUSALS[r], str(e))]
        assert reasons, f"refused, but no documented refusal applies (expected {expected}): {e!r}"
        event(f"refused: {reasons[0]}")
        return None
    required = [r for r, req in expected if req]
    assert not required, f"accepted, but the API documents refusing it: {required}"
    return result


def build_config(j):
    try:
        return GTPOConfig.preset(j.preset, **j.over)
    except ValueError as e:
        level = j.over.get("importance_sampling_level")
        policy = GTPOConfig.preset(j.preset).policy_loss
        assert level == "sequence" and policy != "ppo", f"config refused: {e!r}"
        assert re.search(REFUSALS["sequence level with cispo/sapo/vespo (spec 9)"], str(e))
        event("refused: sequence level with cispo/sapo/vespo (spec 9)")
        return None


def check_token_adv(j, d, cfg):
    """gtpo_token_advantages against spec 2-3 in float64 (the reference's conflict weights): lam * Ahat,
    / n_conf with gtpo-official, 0 where masked out; rows in any order, grouped by uid."""
    B, T, m = j.B, j.T, d.mask
    _, H = ref.token_logprobs(logits_values(j, d), d.ids, cfg.temperature, m)
    cfg = settle_filter(j, cfg, completion_entropy(H, m), m)
    H = H.to(j.dtype)
    away_from_thresholds(cfg.replace(top_entropy_quantile=1.0, off_policy_mask_threshold=None), m, None,
                         H.double(), None, None)
    adv = d.adv.to(j.dtype)
    adv_in = {"B": adv, "B1": adv[:, None],
              "BT": torch.where(m, adv[:, None].expand(B, T), torch.zeros((), dtype=j.dtype))}[j.adv_shape]
    perm = torch.randperm(B, generator=d.gen) if j.uid == "shuffled" else torch.arange(B)
    uid = {"int": [int(i) // j.G for i in perm], "str": [f"p{int(i) // j.G}" for i in perm],
           "shuffled": perm // j.G}[j.uid]
    ent = H[perm] if j.with_entropy else None
    out = call_checked(expected_refusals(j, cfg), lambda: gtpo_token_advantages(
        adv_in[perm], d.ids[perm], m[perm], ent, uid, config=cfg))
    if out is None:
        return
    A = adv.double()
    if cfg.use_conflict_mask:
        lam, n_conf = ref.conflict_weights(d.ids, m, A, j.G, cfg.conflict_pos_weight, cfg.conflict_neg_weight)
    else:
        lam, n_conf = torch.ones(B, T, dtype=torch.float64), torch.ones(B, dtype=torch.float64)
    hbar = completion_entropy(torch.where(m, H.double(), torch.zeros(())) if j.with_entropy else
                              torch.zeros(B, T, dtype=torch.float64), m)
    thr, h0 = cfg.entropy_threshold, cfg.initial_entropy
    kept = torch.ones(B, dtype=torch.bool) if thr is None or (h0 is not None and h0 > thr) else hbar <= thr
    ahat = kept.double() * (A - cfg.entropy_penalty * hbar)
    if cfg.loss_agg == "gtpo-official":
        ahat = ahat / n_conf
    want = torch.where(m, lam * ahat[:, None], torch.zeros(()))[perm]
    assert out.dtype == j.dtype, f"token advantages are {out.dtype}, expected {j.dtype}"
    assert_value_close("token advantages", out, want, TOL[j.dtype]["value"])


@settings(max_examples=examples(150))
@pytest.mark.filterwarnings("ignore::UserWarning")
@given(j=joints())
def test_joint_matches_reference(j):
    check_joint(j)


def check_joint(j, around=None):
    """One drawn configuration called (inside `around(f) -> f()`'s wrapping, when given) and checked."""
    for e in (f"entry={j.entry}", f"form={j.form}", f"{j.backend} {str(j.dtype)[6:]}"):
        event(e)
    for e in ("lie", "autocast", "saturate"):
        if getattr(j, e):
            event(f"{e} (validate={j.validate})" if e == "lie" else e)
    if j.tau is not None:
        event(f"temperature per {'token' if j.tau == 'BT' else 'completion'}")
    if j.replay is not None:
        replay_events(j)
    cfg = build_config(j)
    if cfg is None:
        return
    d = build_data(j)
    if j.entry == "token_adv":
        return check_token_adv(j, d, cfg)
    head = head_values(j, d) if j.entry == "linear" else None
    if head is None:
        Z = logits_values(j, d)
    elif j.dtype == torch.bfloat16:  # the logits as bf16 holds them
        Z = held_logits(*head, j.head["scale"], j.head["cap"])
    else:
        Z = materialize(*[None if x is None else x.double() for x in head], j.head["scale"], j.head["cap"])
    tau = _tau(j)  # the sampler's temperature per completion / token (logits, head), or None
    Zr = Z if tau is None else Z / tau[..., None]  # the reference's view: each row over its own tau
    one_tau = cfg.temperature if tau is None else 1.0
    sampler = Replay(j, d, Zr / one_tau)  # the sampler's kept sets (none: sampler.keep is None)
    rlp, rent = ref.token_logprobs(sampler.masked(Zr), d.ids, one_tau, d.mask)
    cfg = settle_filter(j, cfg, completion_entropy(rent, d.mask), d.mask)
    old, refl, roll = side_inputs(j, d, rlp)
    sampling = roll if j.with_roll_lp else (old if j.with_old else None)
    away_from_thresholds(cfg, d.mask, rlp, rent, old if j.with_old else None, sampling)
    ids, mask, old_a, ref_a, roll_a, form_kw = api_side(j, d, old, refl, roll)
    lie = lying(j, d, form_kw)
    w_api, w_ref = rollout_weights(j, d, old, roll)
    lam_kw, lam_ref = {}, {}
    if j.conflict == "precomputed":
        dt = torch.float64 if j.dtype == torch.float64 else torch.float32
        cw = call_checked([r for r in expected_refusals(j, cfg, lie) if r[0].startswith("max_seqlen")],
                          lambda: precomputed(j, d, cfg, ids, mask, form_kw, dt, nan_ok=lie))
        if cw is None:
            return
        (lam, n_conf), (lr, nr) = cw
        lam_kw, lam_ref = dict(lam=lam, n_conf=n_conf), dict(lam=lr, n_conf=nr)
    items = num_items(j, d.mask)
    kw = dict(group_size=j.G, old_logps=old_a, ref_logps=ref_a, config=cfg, num_items_in_batch=items,
              rollout_is_weights=w_api, rollout_logps=roll_a, **lam_kw, **form_kw)
    if tau is not None:
        per_c = _tau_per_completion(j)
        kw["temperature"] = {"B": per_c, "B1": per_c[:, None]}.get(j.tau, d.pack(tau) if j.packed else tau).float()
    kw.update(sampler.api, **({"inplace": True} if j.inplace else {}))
    up = torch.randn(j.B, j.T, generator=d.gen, dtype=torch.float64)
    caller = {"logits": call_logits, "logps": call_logps, "linear": call_linear}[j.entry]
    inner = autocast if j.autocast else (lambda f: f())
    outer = around or (lambda f: f())
    around = lambda f: outer(lambda: inner(f))  # noqa: E731
    res = call_checked(expected_refusals(j, cfg, lie, int(d.lengths.sum())), lambda: caller(
        j, d, Z if head is None else head, cfg, (ids, mask), kw, d.pack(up) if j.packed else up, around))
    if res is None:
        return
    kw_ref = dict(dataclasses.asdict(cfg), group_size=j.G, old_logps=old if j.with_old else None,
                  ref_logps=refl if j.with_ref else None, rollout_is_weights=w_ref,
                  rollout_logps=roll if j.with_roll_lp else None, num_items_in_batch=items, **lam_ref)
    if j.packed and cfg.max_completion_length is None:  # the packed default: the longest completion
        kw_ref["max_completion_length"] = max(int(d.lengths.max()), 1) if j.B else 1
    if tau is not None:
        kw_ref["temperature"] = 1.0  # the rows are divided by their own tau (reference(..., tau))
    r, rgrads, slack = reference(j, d, Z, head, kw_ref, up, tau, sampler, held_values(j, d, res[0]))
    if not j.validate and j.num_items is not None and j.num_items[1] == 0:  # num_items_in_batch = tensor(0.)
        loss = res[0].loss.detach()  # unread: NaN (an all-masked batch may keep its loss of 0)
        assert bool(loss.isnan().all()) or (not d.mask.any() and bool((loss == 0).all())), f"loss {loss}"
        return
    compare(j, d, res[0], r, res[1], rgrads, slack, nan_ok=lie, sampler=sampler)


def replay_events(j):
    """Hypothesis events of the kept-set draws: the kind, the rules' shapes or the mask's sets, inplace."""
    if j.replay == "mask":
        sets = {"rules": "rebuilt by the rules", "random": "random"}.get(j.sets, "random, shuffled")
        event(f"replay=mask, sets {sets}")
    else:
        shapes = {shape for _, shape in j.rules.values()}
        widest = "per token" if "BT" in shapes else ("per completion" if shapes & {"B", "B1"} else "numbers")
        event(f"replay=rules, {widest}")
        event("replay=rules: " + "+".join(sorted(j.rules)))
    if j.inplace:
        event("replay with inplace=True")
