"""The epilogue kernel (kernels/epilogue_triton.py: every O(B) / O(N) step of the loss in one launch) against
the float64 reference and against its eager twin (the torch backend's objective/surrogate.py), options
drawn together: every preset of the three-launch path, padded and packed, the mask absent / bool / float,
old and ref log-probs, the KL and its bias correction, delta and verl's dual clip, the entropy filter (its
threshold drawn among the completions' entropies), gate, penalty and bonus, every aggregation ('none'
with a per-token upstream gradient that is inf where a token is not counted), num_items_in_batch as a
number or a tensor, max_completion_length, a temperature per completion, conflict weights given or
computed, rollout weights per token or per completion, rollout log-probs (one NaN among them drawn), the
off-policy sequence mask (its threshold drawn among the completions' mean log-ratios) and the top-entropy mask
(top_entropy_quantile drawn; tests/test_top_entropy.py holds its fixed cases). Tolerances: spec 7
(float32: 1e-5)."""

import pytest
import torch
from hypothesis import assume as _assume
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from bench.launches import counting
from conftest import assert_grad_close, assert_value_close, compiled_ahead, examples
from gtpo_kernels import GTPOConfig, conflict_weights, gtpo_loss, gtpo_loss_from_logps

FAST = ["gtpo", "gtpo-official", "grpo", "dapo", "dr-grpo", "bnpo", "gspo", "luspo", "vanilla"]
AGGS = ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "gtpo-official",
        "none"]
TOL = 1e-5
# the other token-level policy terms of the kernel (POLICY != 0, epilogue_triton.POLICIES)
OTHER = ["cispo", "sapo", "gpg", "verl-cispo", "dro", "dppo-tv", "dppo-kl", "geo-mean", "vespo"]


def assume(ok):
    """hypothesis' assume in a property test; a plain test (test_epilogue_masks' fixed cases) must meet the
    condition with its own draw."""
    if currently_in_test_context():
        return _assume(ok)
    assert ok, "the fixed case draws a value within 1e-4 of a decision's cut: pick another seed"


def _term_options(draw, preset):
    """The policy term's own hyper-parameters, drawn so that its cuts are met by the inputs' ratios (log r
    ~ 0.1 N(0, 1)): cispo's bound, verl_cispo's clip, dppo's trust region; sapo's temperatures, dro's beta."""
    if preset == "cispo":
        return dict(eps_high=draw(st.sampled_from([5.0, 1.05])))
    if preset == "sapo":
        pos, neg = draw(st.sampled_from([(1.0, 1.05), (3.0, 0.5)]))
        return dict(sapo_temperature_pos=pos, sapo_temperature_neg=neg)
    if preset == "verl-cispo":
        lo, hi = draw(st.sampled_from([(0.2, 0.28), (0.05, 0.03)]))
        return dict(eps_low=lo, eps_high=hi)
    if preset == "dro":
        return dict(dro_beta=draw(st.sampled_from([0.1, 2.0])))
    if preset in ("dppo-tv", "dppo-kl"):
        lo, hi = draw(st.sampled_from([(0.2, 0.2), (0.01, 0.02), (0.001, 0.002)]))
        return dict(eps_low=lo, eps_high=hi)
    if preset == "vespo":  # TRL's defaults, or weights that let phi vary with L
        kl = draw(st.sampled_from([(2.0, 3.0, 3.0, 2.0), (1.0, 0.5, 0.5, 1.5)]))
        return dict(zip(("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"), kl))
    if preset == "geo-mean":  # the clip of log r: off or met by the ratios
        lo, hi = draw(st.sampled_from([(0.4, 0.4), (0.03, 0.12), (0.12, 0.03)]))
        return dict(eps_low=lo, eps_high=hi)
    if preset == "clip-cov":  # bounds within the covariances' range (A ~ N(0, 1), logp ~ -3) or around all
        lb, ub = draw(st.sampled_from([(-0.5, 0.5), (0.0, 2.0), (-100.0, 100.0)]))
        return dict(clip_cov_lb=lb, clip_cov_ub=ub, clip_cov_ratio=draw(st.sampled_from([0.2, 0.5, 1.0])),
                    generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    if preset == "kl-cov":
        return dict(kl_cov_ratio=draw(st.sampled_from([0.1, 0.4, 1.0])), ppo_kl_coef=draw(st.sampled_from([0.5, 2.0])))
    return {}


@st.composite
def calls(draw, presets=FAST):
    G = 2
    B = G * draw(st.integers(1, 3))
    T = draw(st.integers(1, 6))
    V = draw(st.integers(4, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    preset = draw(st.sampled_from(presets))
    over = {}
    cfg = GTPOConfig.preset(preset, **_term_options(draw, preset))
    if draw(st.booleans()):
        over["loss_agg"] = draw(st.sampled_from([a for a in AGGS if not (a == "none" and cfg.sequence_term)]))
    if draw(st.booleans()):
        over.update(beta=0.04, use_bias_correction_kl=draw(st.booleans()))
    if draw(st.booleans()):
        over["entropy_coef"] = 0.01
    if draw(st.booleans()):
        over["delta"] = draw(st.sampled_from([1.1, 1.5]))
    if draw(st.booleans()) and cfg.policy_loss in ("ppo", "clip-cov", "dppo-tv", "dppo-kl"):  # dppo's caps at 3
        over["dual_clip_c"] = 3.0 if cfg.policy_loss in ("ppo", "clip-cov") else None
    if draw(st.booleans()):
        over["clip"] = False
    if draw(st.booleans()):
        over["entropy_penalty"] = 0.1
    if draw(st.booleans()):
        over["max_completion_length"] = T + draw(st.integers(0, 3))
    filt = draw(st.sampled_from(["keep", "off", "drawn", "gate"]))
    return dict(B=B, T=T, V=V, G=G, seed=seed, cfg=cfg.replace(**over), filt=filt,
                packed=draw(st.booleans()), mask=draw(st.sampled_from(["none", "bool", "float"])),
                old=draw(st.booleans()), lam=draw(st.sampled_from(["given", "computed", "off"])),
                items=draw(st.sampled_from([None, "number", "tensor"])), tau=draw(st.sampled_from([None, "seq"])),
                rw=draw(st.sampled_from([None, "token", "completion"])),
                roll=draw(st.sampled_from([None, "given", "nan"])),
                off=draw(st.booleans()), top=draw(st.sampled_from([1.0, 1.0, 0.2, 0.5, 0.7])))


def _rollout(c, mask):
    """(rollout weights, rollout log-probs, the off-policy mask's sampling log-probs' differences source) of
    a drawn call: weights in [0.25, 1.75) per token (B, T) or per completion (B, 1); rollout log-probs near
    the old ones, with one NaN at a counted token ("nan": spec 9 counts it as 0)."""
    g = torch.Generator().manual_seed(c["seed"] + 1)
    B, T = mask.shape
    w = torch.rand(B, T if c.get("rw") == "token" else 1, generator=g) * 1.5 + 0.25
    roll = torch.randn(B, T, generator=g) * 0.1
    if c.get("roll") == "nan":  # at a drawn counted token, or at the first one of each completion in c["nan_at"]
        k = int(torch.randint(0, int(mask.sum()), (1,), generator=g))
        at = [mask.reshape(-1).nonzero()[k, 0]] if c.get("nan_at") is None else \
            [i * T + mask[i].nonzero()[0, 0] for i in c["nan_at"]]
        for j in at:
            roll.view(-1)[j] = float("nan")
    return w, roll


def _inputs(c):
    g = torch.Generator().manual_seed(c["seed"])
    B, T, V = c["B"], c["T"], c["V"]
    logits = torch.randn(B, T, V, generator=g) * 4
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[0, 0] = True
    adv = torch.randn(B, generator=g)
    lp = torch.log_softmax(logits.double(), -1).gather(-1, ids[..., None])[..., 0]
    old = (lp + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    # |ref - logp| >= 0.05: the KL's gradient beta (1 - exp(ref - logp)) from float32 log-probs keeps 1e-5 of
    # relative accuracy only while ulp(logp) / |ref - logp| is below it (tests/test_kl_conditioning.py holds
    # the reference at the call's own log-probs to test smaller gaps)
    gap = torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = (lp + 0.1 * torch.sign(gap) * (0.5 + gap.abs())).float()
    tau = torch.rand(B, generator=g) * 0.8 + 0.6
    return logits, ids, mask, adv, old, ref, tau


def _call(c, logits, ids, mask, adv, old, ref, tau, backend, upstream):
    cfg = c["cfg"]
    if cfg.generator is not None:  # clip_cov: each call draws from the same state
        cfg = cfg.replace(generator=torch.Generator().manual_seed(cfg.generator.initial_seed()))
    B, T = ids.shape
    kw = dict(config=cfg, backend=backend, validate=False, group_size=c["G"])
    if c["old"]:
        kw["old_logps"] = old
    if cfg.beta:
        kw["ref_logps"] = ref
    if c["lam"] == "given":
        kw["lam"], kw["n_conf"] = conflict_weights(ids, mask, adv, c["G"]) if "weights" not in c else c["weights"]
    elif c["lam"] == "off":
        kw["config"] = cfg = cfg.replace(use_conflict_mask=False)
    if cfg.loss_agg == "token-mean" and c["items"]:
        n = float(mask.sum()) + 3.0
        kw["num_items_in_batch"] = n if c["items"] == "number" else torch.tensor(n)
    if c["tau"] == "seq":
        kw["temperature"] = tau[:, None]  # (B, 1): per completion in both forms
    if c.get("rw") or c.get("roll"):
        w, roll = _rollout(c, mask)
        if c.get("rw"):
            kw["rollout_is_weights"] = w.to(logits.dtype)
        if c.get("roll"):
            kw["rollout_logps"] = (old + roll).to(logits.dtype)  # near the old log-probs, one NaN with "nan"
    m = None if c["mask"] == "none" else (mask if c["mask"] == "bool" else mask.float())
    x = logits.clone().requires_grad_()
    args = (x, ids, adv, m)
    if c["packed"]:  # the whole rows of every completion, packed
        kw = {k: v.reshape(-1) if isinstance(v, torch.Tensor) and v.shape == (B, T) and k != "temperature" else v
              for k, v in kw.items()}
        kw.update(cu_seqlens=torch.arange(0, B * T + 1, T), max_seqlen=T)
        args = (x.view(B * T, -1), ids.reshape(-1), adv, None if m is None else m.reshape(-1))
    with counting() as k:  # the call alone: forward and backward
        out = gtpo_loss(*args, **kw)
        out.loss.backward(None if out.loss.dim() == 0 else upstream.reshape(out.loss.shape))  # (no op of the test's)
    return out, x.grad, k


def _compare(name, out, grad, ref_out, ref_grad, counted):
    assert_value_close(f"{name} loss", out.loss, ref_out.loss, TOL)
    for f in ("logps", "entropy", "per_token_loss", "lam"):
        assert_value_close(f"{name} {f}", getattr(out, f).reshape(counted.shape), getattr(ref_out, f).reshape(
            counted.shape), TOL, where=counted)
    assert_value_close(f"{name} n_conf", out.n_conf, ref_out.n_conf, TOL)
    assert torch.equal(out.kept, ref_out.kept), name
    assert_value_close(f"{name} seq_entropy", out.seq_entropy, ref_out.seq_entropy, TOL)
    for k in ("clip_frac", "filtered_frac", "conflict_frac", "mean_entropy"):
        assert_value_close(f"{name} {k}", out.metrics[k], ref_out.metrics[k], TOL)
    assert_grad_close(f"{name} grad", grad.reshape(ref_grad.shape), ref_grad, TOL)


@settings(max_examples=examples(16), deadline=None)  # CI time: nightly runs 160
@given(c=calls())
def test_epilogue_matches_reference_and_its_twin(c):
    _check(c)


def _cuts(cfg, lp, old):
    """(quantity, value) pairs per counted token at which the policy term decides (a clip, a cap, a trust
    region's bound), from float64 log-probs: an example with a token on a cut is not drawn."""
    r = torch.exp(lp - old)
    pl = cfg.policy_loss
    if pl in ("ppo", "clip-cov"):
        return [(r, e) for e in (1 - cfg.eps_low, 1 + cfg.eps_high) + ((cfg.delta,) if cfg.delta else ())]
    if pl == "cispo":
        return [(r, cfg.eps_high)]
    if pl == "verl-cispo":
        return [(r, 1 - cfg.eps_low), (r, 1 + cfg.eps_high)]
    if pl in ("dppo-tv", "dppo-kl"):
        p, p_old = torch.exp(lp), torch.exp(old)
        cuts = [(lp - old, 0.0)] + ([(r, cfg.dual_clip_c)] if cfg.dual_clip_c else [])
        if pl == "dppo-tv":
            return cuts + [(p - p_old, cfg.eps_high), (p - p_old, -cfg.eps_low)]
        kl = p_old * (old - lp) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
        return cuts + [(kl, cfg.eps_high), (kl, cfg.eps_low)]
    if pl == "geo-mean":
        return [(lp - old, -cfg.eps_low), (lp - old, cfg.eps_high)]
    return []  # sapo, gpg, dro: smooth in r and logp


def _cov_margin(cfg, ref_out, adv, counted):
    """The float64 covariances' distance from clip_cov's bounds, or kl_cov's gap at its k-th largest."""
    a_hat = torch.where(ref_out.kept, adv.double() - cfg.entropy_penalty * ref_out.seq_entropy, 0.0)
    A = a_hat[:, None].expand(counted.shape)[counted]
    lp = ref_out.logps.reshape(counted.shape)[counted]
    if lp.numel() == 0:
        return 1.0
    cov = (A - A.mean()) * (lp - lp.mean())
    if cfg.policy_loss == "clip-cov":
        return float(torch.minimum((cov - cfg.clip_cov_lb).abs(), (cov - cfg.clip_cov_ub).abs()).min())
    k = max(1, int(cfg.kl_cov_ratio * lp.numel()))
    srt = cov.sort(descending=True).values
    return float(srt[k - 1] - srt[k]) if srt.numel() > k else 1.0


def _off_policy_threshold(c, lp, ids, mask, counted, old):
    """A threshold between two completions' mean (sampling logp - logp) (float64 log-probs; rollout log-probs
    when given, else old ones, NaN as 0), none of them within 1e-4 of it; -1e-3 with neither (0 for each)."""
    if not (c["old"] or c.get("roll")):  # on-policy: every completion with A < 0 dropped
        return -1e-3
    samp = (old + _rollout(c, mask)[1]).double() if c.get("roll") else old.double()
    d = torch.nan_to_num(samp - lp.gather(-1, ids[..., None])[..., 0], nan=0.0)
    mean = (d * counted).sum(1) / counted.sum(1).clamp(min=1)
    thr = float(mean.sort().values[len(mean) // 2]) + 1e-3
    assume((mean - thr).abs().min() > 1e-4)
    return thr


def _check(c):
    """One drawn call: the 4-launch path against the float64 reference and against its eager twin."""
    logits, ids, mask, adv, old, ref, tau = _inputs(c)
    counted = mask if c["mask"] != "none" else torch.ones_like(mask)
    # entropy filter: off, keeping all, or a threshold between two completions' mean entropies
    H = torch.special.entr(torch.softmax(logits.double() / (tau[:, None, None].double() if c["tau"] else 1.0),
                                         -1)).sum(-1)
    hbar = (H * counted).sum(1) / counted.sum(1).clamp(min=1)
    cfg = c["cfg"]
    if c["filt"] == "off":
        cfg = cfg.replace(entropy_threshold=None)
    elif c["filt"] == "keep":
        cfg = cfg.replace(entropy_threshold=float(hbar.max()) + 1.0)
    elif c["filt"] == "drawn":
        srt = hbar.sort().values
        cfg = cfg.replace(entropy_threshold=float(srt[len(srt) // 2]) + 1e-3)
        assume((hbar - cfg.entropy_threshold).abs().min() > 1e-4)
    else:
        cfg = cfg.replace(entropy_threshold=0.5, initial_entropy=5.0)
    lp = torch.log_softmax(logits.double() / (tau[:, None, None].double() if c["tau"] else 1.0), -1)
    lp_tok = lp.gather(-1, ids[..., None])[..., 0][counted]
    if c.get("off"):  # the off-policy mask's threshold between two completions' means
        cfg = cfg.replace(off_policy_mask_threshold=_off_policy_threshold(c, lp, ids, mask, counted, old))
    if c.get("top", 1.0) < 1.0:  # the top-entropy mask: the counted entropies apart (the float32 quantile's
        gaps = H[counted].sort().values.diff()  # decisions as the float64 reference's)
        assume(gaps.numel() == 0 or gaps.min() > 1e-4)
        cfg = cfg.replace(top_entropy_quantile=c["top"])
    c = dict(c, cfg=cfg)
    for x, edge in _cuts(cfg, lp_tok, old.double()[counted]):  # no decision on a cut
        assume(not c["old"] or x.numel() == 0 or (x - edge).abs().min() > 1e-4)
    if cfg.policy_loss in ("dppo-tv", "dppo-kl") and cfg.dual_clip_c is None and c["old"] and lp_tok.numel():
        # dppo without its cap: -A r logp, r up to e^4 here (old log-probs drawn at temperature 1, the call's
        # tau per completion): terms of ~300 summing to ~1 carry float32's log-prob rounding past 1e-5 of the
        # loss (the eager twin as much as the kernel); r below the preset's cap keeps it conditioned
        assume(float(torch.exp(lp_tok - old.double()[counted]).max()) < 3.0)
    c["weights"] = tuple(w.to(logits.dtype) for w in conflict_weights(ids, mask, adv, c["G"]))  # outside the count
    upstream = torch.where(counted, torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) + 0.5,
                           torch.full(ids.shape, float("inf")))
    out, grad, k = _call(c, logits, ids, mask, adv, old, ref, tau, "triton", upstream)
    cov = {"clip-cov": 3, "kl-cov": 2}.get(cfg.policy_loss, 0)  # the keys' launch and their sort (clip_cov's draw)
    assert k.triton_names.get("_epilogue_kernel") == 1 + (cov > 0), dict(k.triton_names)  # the epilogue path ran
    if c["tau"] is None and c.get("rw") != "completion":  # the three-launch path's bound (spec 8), the seed
        # included; computed weights: one more (per-completion rollout weights: tests/test_launches.py); the
        # top-entropy mask: two more (its sort key and the sort; with clip_cov or kl_cov none: their key launch
        # writes its keys, sorted with theirs in one sort); clip_cov, kl_cov: epilogue_cov's
        top = cfg.top_entropy_quantile < 1.0
        assert k.launches <= 4 + (c["lam"] == "computed") + 2 * (cov == 0) * top + cov, (k.launches, k.ops)
    ref_out, ref_grad, _ = _call(c, logits.double(), ids, mask, adv, old.double(), ref.double(), tau.double(),
                                 "reference", torch.where(counted, upstream, 0.0).double())  # no inf gradient
    assume(torch.isfinite(ref_out.loss).all())
    if cov:  # no covariance within 1e-4 of clip_cov's bounds, nor kl_cov's k-th and (k+1)-th apart by less
        assume(_cov_margin(cfg, ref_out, adv, counted) > 1e-4)
    _compare("triton vs reference", out, grad, ref_out, ref_grad, counted)
    twin, twin_grad, _ = _call(c, logits, ids, mask, adv, old, ref, tau, "torch", upstream)
    _compare("triton vs torch", out, grad, twin, twin_grad.double(), counted)


def test_reference_gradient_is_not_zero_on_a_fixed_case():
    """The property test's inputs give a live gradient (its comparisons are not of zeros)."""
    c = dict(B=4, T=5, V=16, G=2, seed=3, cfg=GTPOConfig.preset("gtpo", entropy_threshold=None), filt="off",
             packed=False, mask="bool", old=True, lam="given", items=None, tau=None)
    logits, ids, mask, adv, old, ref, tau = _inputs(c)
    out, grad, _ = _call(c, logits, ids, mask, adv, old, ref, tau, "triton", torch.ones(4, 5))
    ref_out, ref_grad, _ = _call(c, logits.double(), ids, mask, adv, old.double(), ref.double(), tau.double(),
                              "reference", torch.ones(4, 5))
    assert ref_grad.abs().sum() > 0
    _compare("fixed", out, grad, ref_out, ref_grad, mask)


@pytest.mark.parametrize("policy", OTHER)
@settings(max_examples=examples(12), deadline=None)
@given(data=st.data())
def test_other_policy_terms_match_reference_and_twin(policy, data):
    """cispo, sapo and verl's gpg, verl_cispo, dro, dppo_tv / dppo_kl on the 4-launch path (the kernel's
    POLICY), with the options of the preset test drawn with them (the PPO clip's, delta: ignored by these
    terms; the dual clip: dppo's cap), against the float64 reference and the eager twin: values, outputs,
    clip_frac (dppo's tokens outside the trust region; 0 for the others) and the gradient."""
    _check(data.draw(calls(presets=[policy])))


# per policy: options whose cut the fixed case's ratios meet on both sides (cispo's bound, verl_cispo's
# clip, dppo's trust region), sapo's temperatures apart, dro's beta
_FIXED = {"cispo": dict(eps_high=1.05), "sapo": dict(sapo_temperature_pos=3.0, sapo_temperature_neg=0.5),
          "gpg": {}, "verl-cispo": dict(eps_low=0.05, eps_high=0.03), "dro": dict(dro_beta=2.0),
          "dppo-tv": dict(eps_low=0.001, eps_high=0.002), "dppo-kl": dict(eps_low=0.001, eps_high=0.002),
          "geo-mean": dict(eps_low=0.03, eps_high=0.12), "vespo": dict(vespo_k_pos=1.0, vespo_lambda_pos=0.5)}
_FIXED_SEED = {"dppo-kl": 4}  # (seed 3 leaves every token inside the KL trust region)


@pytest.mark.parametrize("policy", OTHER)
def test_other_policy_terms_on_a_fixed_case(policy):
    """A fixed case per policy term: the 4-launch path ran (the epilogue kernel, at most 4 launches), the
    reference gradient is not zero, the term's cut is met on both sides (some tokens capped or clipped,
    some not), and the outputs match the reference."""
    cfg = GTPOConfig.preset(policy, entropy_threshold=None, **_FIXED[policy])
    c = dict(B=4, T=5, V=16, G=2, seed=_FIXED_SEED.get(policy, 3), cfg=cfg, filt="off", packed=False, mask="bool",
             old=True, lam="given", items=None, tau=None)
    logits, ids, mask, adv, old, ref, tau = _inputs(c)
    out, grad, k = _call(c, logits, ids, mask, adv, old, ref, tau, "triton", torch.ones(4, 5))
    assert k.triton_names.get("_epilogue_kernel") == 1 and k.launches <= 4, (k.launches, dict(k.triton_names))
    ref_out, ref_grad, _ = _call(c, logits.double(), ids, mask, adv, old.double(), ref.double(), tau.double(),
                                 "reference", torch.ones(4, 5))
    assert ref_grad.abs().sum() > 0
    lp = torch.log_softmax(logits.double(), -1).gather(-1, ids[..., None])[..., 0][mask]
    r = torch.exp(lp - old.double()[mask])
    for x, edge in _cuts(cfg, lp, old.double()[mask]):
        assert (x - edge).abs().min() > 1e-4  # no token on a cut
    if policy == "cispo":
        assert (r > cfg.eps_high).any() and (r < cfg.eps_high).any(), r
    elif policy == "verl-cispo":
        assert ((r < 1 - cfg.eps_low) | (r > 1 + cfg.eps_high)).any() and \
            ((r > 1 - cfg.eps_low) & (r < 1 + cfg.eps_high)).any(), r
    elif policy in ("dppo-tv", "dppo-kl"):
        assert 0 < float(ref_out.metrics["clip_frac"]) < 1, ref_out.metrics
    elif policy == "sapo":
        assert (adv > 0).any() and (adv < 0).any(), adv  # both temperatures
    elif policy == "geo-mean":  # log r clipped on both sides, and not; some between -eps_high and -eps_low
        lr = lp - old.double()[mask]
        assert 0 < float(ref_out.metrics["clip_frac"]) < 1 and (lr > cfg.eps_high).any() and \
            (lr < -cfg.eps_low).any() and ((lr > -cfg.eps_high) & (lr < -cfg.eps_low)).any(), ref_out.metrics
    _compare("fixed", out, grad, ref_out, ref_grad, mask)
    twin, twin_grad, _ = _call(c, logits, ids, mask, adv, old, ref, tau, "torch", torch.ones(4, 5))
    _compare("fixed vs torch", out, grad, twin, twin_grad.double(), mask)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("policy", OTHER)
def test_other_policy_terms_from_logps_match_the_twin(policy, packed):
    """gtpo_loss_from_logps takes the same epilogue for these terms (pipeline/logps_epilogue.py): against its
    eager twin (the torch backend), with entropies (the bonus), old and ref log-probs and lam: values,
    outputs, clip_frac and the gradient w.r.t. the log-probs and the entropies."""
    cfg = lambda: GTPOConfig.preset(policy, entropy_threshold=None, beta=0.04, entropy_coef=0.01,  # noqa: E731
                                    **_FIXED[policy])
    from_logps_vs_twin(cfg, packed, _FIXED_SEED.get(policy, 3), {"_prep_kernel": 1, "_epilogue_kernel": 1,
                                                                 "_scale_kernel": 1})


def from_logps_vs_twin(make_cfg, packed, seed, kernels):
    """gtpo_loss_from_logps on the fixed batch of `seed` (entropies, old and ref log-probs, lam), padded or
    packed, each backend with a config from make_cfg(): the Triton kernels launched are `kernels`, and the
    values, outputs, metrics and gradients w.r.t. the log-probs and entropies equal the eager twin's."""
    c = dict(B=4, T=5, V=16, G=2, seed=seed)
    logits, ids, mask, adv, old, ref, _ = _inputs(c)
    logp_all = torch.log_softmax(logits, -1)
    lp = logp_all.gather(-1, ids[..., None])[..., 0]
    H = -(logp_all.exp() * logp_all).sum(-1)
    lam, n_conf = conflict_weights(ids, mask, adv, 2)
    kw = dict(old_logps=old, ref_logps=ref, lam=lam, n_conf=n_conf)
    args = [lp, ids, adv, mask]
    if packed:
        kw = {k: v[mask] if v.shape == mask.shape else v for k, v in kw.items()}
        kw.update(cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(1).cumsum(0)]),
                  max_seqlen=ids.shape[1])
        args, H = [lp[mask], ids[mask], adv, None], H[mask]
    outs = {}
    for backend in ("triton", "torch"):
        x, h = args[0].clone().requires_grad_(), H.clone().requires_grad_()
        with counting() as k:
            out = gtpo_loss_from_logps(x, *args[1:], entropy=h, config=make_cfg(), backend=backend, validate=False,
                                       **kw)
            out.loss.backward()
        outs[backend] = (out, x.grad, h.grad, k)
    (o, gx, gh, k), (t, tx, th, _) = outs["triton"], outs["torch"]
    assert k.triton_names == kernels, dict(k.triton_names)
    counted = mask[mask] if packed else mask
    assert tx.abs().sum() > 0
    assert_value_close("loss", o.loss, t.loss, TOL)
    for f in ("logps", "per_token_loss", "lam"):
        assert_value_close(f, getattr(o, f), getattr(t, f), TOL, where=counted)
    for name in ("clip_frac", "filtered_frac", "conflict_frac", "mean_entropy"):
        assert_value_close(name, o.metrics[name], t.metrics[name], TOL)
    assert_grad_close("grad logps", gx[..., None], tx[..., None].double(), TOL)
    assert_grad_close("grad entropy", gh[..., None], th[..., None].double(), TOL)


@pytest.mark.parametrize("bad", ["adv", "old", "lam", "n_conf", "num_items"])
def test_unvalidated_invalid_input_gives_nan_not_a_number(bad):
    """validate=False: a non-finite advantage, old log-prob or lam at a counted token, an n_conf below 1,
    a num_items_in_batch tensor of 0: the loss is NaN (never a finite wrong number), as on the eager path."""
    c = dict(B=4, T=5, V=16, G=2, seed=4, cfg=None, filt="off", packed=False, mask="bool", old=True, lam="given",
             items=None, tau=None)
    logits, ids, mask, adv, old, ref, tau = _inputs(c)
    lam, n_conf = conflict_weights(ids, mask, adv, 2)
    cfg = GTPOConfig.preset("gtpo-official" if bad == "n_conf" else ("dapo" if bad == "num_items" else "gtpo"),
                            entropy_threshold=None)
    kw = dict(old_logps=old, lam=lam, n_conf=n_conf)
    if bad == "adv":
        adv = adv.clone()
        adv[1] = float("inf")
    elif bad == "old":
        kw["old_logps"] = old.clone()
        kw["old_logps"][0, 0] = float("-inf")
    elif bad == "lam":
        kw["lam"] = lam.clone()
        kw["lam"][0, 0] = float("nan")
    elif bad == "n_conf":
        kw["n_conf"] = n_conf.clone()
        kw["n_conf"][0] = 0.5
    else:
        kw["num_items_in_batch"] = torch.tensor(-5.0)  # a finite wrong number if taken as it is
    for backend in ("triton", "torch"):
        out = gtpo_loss(logits, ids, adv, mask, config=cfg, backend=backend, validate=False, **kw)
        assert torch.isnan(out.loss), (backend, out.loss)


@pytest.mark.parametrize("cu", [[0, 2, 3], [1, 2, 5], [0, 4, 2, 5], [0, 3, 7]], ids=str)
def test_unvalidated_malformed_cu_seqlens_matches_the_eager_path(cu):
    """Packed, validate=False: the epilogue reads cu_seqlens as given; a malformed one (short of N, not from
    0, decreasing, past N) gives what the eager path gives, NaN at every counted token (none left unwritten)
    and in every metric (no completion is known: the filter's and the clip's counts were finite numbers)."""
    g = torch.Generator().manual_seed(5)
    N, V = 5, 12
    logits = torch.randn(N, V, generator=g)
    ids = torch.randint(0, V, (N,), generator=g)
    B = len(cu) - 1
    adv = torch.randn(B, generator=g)
    outs = {}
    for backend in ("triton", "torch"):
        x = logits.clone().requires_grad_()
        out = gtpo_loss(x, ids, adv, cu_seqlens=torch.tensor(cu), group_size=1, config="grpo", backend=backend,
                        validate=False)
        out.loss.backward()
        outs[backend] = (out, x.grad)
    (o, gr), (t, tg) = outs["triton"], outs["torch"]
    assert torch.isnan(o.logps).all() and torch.isnan(o.entropy).all() and torch.isnan(o.loss)
    for f in ("logps", "entropy", "per_token_loss", "lam", "seq_entropy", "n_conf"):
        torch.testing.assert_close(getattr(o, f), getattr(t, f), equal_nan=True, msg=f)
    assert torch.equal(o.kept, t.kept)
    torch.testing.assert_close(gr, tg, equal_nan=True)
    for out in (o, t):
        assert all(bool(torch.isnan(v)) for v in out.metrics.values()), out.metrics


# the epilogue's HP code with every float slot read by pointer (pipeline/epilogue.py hyper) and the PPO bounds
_HP_ALL = sum((k + 1) << (4 * k) for k in range(13)) | 1 << 52 | 14 << 56  # every slot, the bounds, the gate


def test_epilogue_compiles_for_the_gpus():
    """The epilogue compiled ahead of time for sm_90, sm_80 and sm_100 (no GPU needed; Triton's compiler in
    a process without the interpreter), every policy term (POLICY; clip_cov's and kl_cov's key launch, PHASE 1
    too), the rollout weights (RW) and the off-policy
    mask, the top-entropy mask (TOP_ENT) and its sort key's kernel, every hyper-parameter read by pointer (HP),
    the advantages per token (TOK_ADV) among its cases: what the interpreter does not check (a loop-carried variable that changes type, a global
    NaN that differs from itself between inner functions) fails here."""
    code = ("from bench.aot.compiler import compile_epilogue\n"
            "for arch, sw in [(90, {}), (90, dict(PACKED=True, SEQ=True, AGG=4)), (90, dict(AGG=5, HAS_LAM=False, HAS_ROLL=False)),\n"
            "                 (80, dict(PACKED=True, AGG=1, NITEMS=2)), (100, dict(SEQ=True, AGG=3, HAS_KL=False)),\n"
            "                 *[(90, dict(POLICY=p, PACKED=p % 2 == 1, HAS_DUAL=p != 7, AGG=p % 6)) for p in range(1, 12)],\n"
            "                 (90, dict(POLICY=10, PHASE=1, TOP_ENT=True, enable_fp_fusion=False)),\n"
            "                 (80, dict(POLICY=11, PHASE=1, PACKED=True, HAS_DUAL=False)),\n"
            "                 (80, dict(POLICY=6)), (100, dict(POLICY=2, HAS_OLD=False, HAS_LAM=False)),\n"
            "                 (80, dict(RW=2, OFF_POLICY=True, PACKED=True, SEQ=True, KEPT=True)),\n"
            "                 (100, dict(RW=1, OFF_POLICY=True, HAS_ROLL=False, HAS_OLD=False)),\n"
            "                 (90, dict(TOP_ENT=True, enable_fp_fusion=False, RW=1, OFF_POLICY=True)),\n"
            "                 (80, dict(TOP_ENT=True, enable_fp_fusion=False, PACKED=True, SEQ=True, AGG=1)),\n"
            "                 (90, dict(TOK_ADV=True, PENALTY=False, VALIDATE=False, POLICY=10, PHASE=1, RW=1)),\n"
            "                 (80, dict(TOK_ADV=True, PENALTY=False, VALIDATE=False, AGG=5)),\n"
            "                 (100, dict(TOK_ADV=True, PENALTY=False, VALIDATE=False, POLICY=8, AGG=2, RW=1)),\n"
            f"                 (90, dict(HP={_HP_ALL})), (100, dict(HP={_HP_ALL}, POLICY=2, TOP_ENT=True, enable_fp_fusion=False))]:\n"
            "    print(arch, sw)\n"
            "    assert compile_epilogue(arch, **sw).asm.get('ptx'), (arch, sw)\n"
            "import torch\n"
            "from bench.aot.compiler import _compile_ahead\n"
            "from gtpo_kernels.kernels.top_entropy import _entropy_key_kernel as k\n"
            "for arch in (90, 80, 100):\n"
            "    assert _compile_ahead(k, arch, {'bad_ptr': torch.int8, 'mask_ptr': torch.bool}, torch.float32,\n"
            "                          dict(N=32768), dict(HAS_MASK=True, BLOCK=1024, num_warps=4)).asm.get('ptx')\n"
            "print('compiled')\n")
    out = compiled_ahead(code)
    assert out.count("'POLICY'") == 18, out  # every policy term of the kernel compiled
    assert out.count("'PHASE': 1") == 3, out  # clip_cov's and kl_cov's keys (epilogue_cov)
    assert out.count("'TOK_ADV': True") == 3, out  # the advantages per token (pipeline/token_terms.py)
    assert out.count("'TOP_ENT'") == 4, out  # the top-entropy mask (and its key kernel) compiled
    assert out.count(f"'HP': {_HP_ALL}") == 2, out  # every hyper-parameter read by pointer


@pytest.mark.parametrize("bad", ["adv", "old", "ref", "lam", "n_conf", "num_items", "mask", "ids", "cu_seqlens",
                                 "max_seqlen", "logits"])
def test_validating_raises_the_same_error_as_the_eager_path(bad):
    """validate=True on the 4-launch path: the kernel makes the input checks (bit 2 of its status word, one
    host read with the rest); when one fails the host checks run again and raise the error that names the
    argument, the same error (type and message) as the eager path's (the torch backend)."""
    g = torch.Generator().manual_seed(6)
    B, T, V = 4, 5, 16
    logits = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    adv = torch.randn(B, generator=g)
    old = torch.randn(B, T, generator=g) - 2
    lam, n_conf = conflict_weights(ids, mask.bool(), adv, 2)
    kw = dict(old_logps=old, ref_logps=old.clone(), lam=lam, n_conf=n_conf,
              config=GTPOConfig.preset("dapo" if bad == "num_items" else "gtpo", beta=0.04))
    packed = bad in ("cu_seqlens", "max_seqlen")
    if bad == "adv":
        adv[2] = float("nan")
    elif bad in ("old", "ref", "lam"):
        kw[{"old": "old_logps", "ref": "ref_logps", "lam": "lam"}[bad]][1, 3] = float("inf")
    elif bad == "n_conf":
        kw["n_conf"] = n_conf.clone()
        kw["n_conf"][3] = 0.0
    elif bad == "num_items":
        kw["num_items_in_batch"] = torch.tensor(float("nan"))
    elif bad == "mask":
        mask[1, 1] = 0.5
    elif bad == "ids":
        ids[2, 2] = V + 3
    elif bad == "logits":
        logits[0, 1, 4] = float("nan")
    args = (logits, ids, adv, mask)
    if packed:
        kw = {k: v.reshape(-1) if isinstance(v, torch.Tensor) and v.shape == (B, T) else v for k, v in kw.items()}
        cu = torch.arange(0, B * T + 1, T)
        if bad == "cu_seqlens":
            cu[2] = cu[3] + 1
            kw["cu_seqlens"] = cu
        else:
            kw.update(cu_seqlens=cu, max_seqlen=T - 1)
        args = (logits.reshape(B * T, V), ids.reshape(-1), adv, mask.reshape(-1))
    errors = {}
    for backend in ("triton", "torch"):
        with pytest.raises(ValueError) as e:
            gtpo_loss(*args, group_size=2, backend=backend, validate=True, **kw)
        errors[backend] = str(e.value)
    assert errors["triton"] == errors["torch"], errors
    name = {"adv": "advantages", "old": "old_logps", "ref": "ref_logps", "num_items": "num_items_in_batch",
            "mask": "completion_mask", "ids": "completion_ids"}.get(bad, bad)
    assert name in errors["triton"], errors
