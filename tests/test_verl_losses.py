"""verl 0.9.1's loss modes (spec 9) against verl's own registered functions (skipped without verl; CI runs
this file in its verl environment, .ci/run): random float64 inputs, every verl `loss_agg_mode`, with and
without rollout weights, through `get_policy_loss_fn(name)`: gtpo_loss_from_logps with the mode's preset,
and the plugin's `gtpo_<mode>` on the same token advantages, equal verl's function in value and gradient.
verl's `gspo` and `sapo` against the `gspo` and `sapo` presets: equal where they agree, and the two places
they differ shown."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples
from gtpo_kernels import GTPOConfig, gtpo_loss_from_logps

F64 = torch.float64
VERL_AGGS = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]
# verl's mode -> (this package's preset, the mode's options drawn below)
MODES = {"vanilla": "vanilla", "gpg": "gpg", "dppo_tv": "dppo-tv", "dppo_kl": "dppo-kl", "dro": "dro",
         "cispo": "verl-cispo", "geo_mean": "geo-mean", "clip_cov": "clip-cov", "kl_cov": "kl-cov"}
# relative to max(1, |verl|). verl divides by (count + 1e-8) in its means, which its bool response_mask
# makes a float32 count where the 1e-8 vanishes; measured worst differences are ~4e-16
TOL = 1e-13


def _verl():
    pytest.importorskip("verl")
    import gtpo_kernels.integrations.verl as plugin
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import ActorConfig, PolicyLossConfig
    return plugin, get_policy_loss_fn, ActorConfig, PolicyLossConfig


def batch(seed, B=None, T=None):
    """Ragged float64 log-probs (one row may be empty), old log-probs near them, per-completion advantages
    (the last one 0 when B > 2), rollout weights."""
    g = torch.Generator().manual_seed(seed)
    B = B or int(torch.randint(2, 7, (1,), generator=g))
    T = T or int(torch.randint(1, 9, (1,), generator=g))
    lens = torch.randint(0, T + 1, (B,), generator=g)
    lens[0] = T
    mask = torch.arange(T)[None] < lens[:, None]
    logp = -torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.01
    old = (logp + 0.4 * torch.randn(B, T, generator=g, dtype=F64)).clamp(max=-1e-3)
    adv = torch.randn(B, generator=g, dtype=F64)
    if B > 2:
        adv[-1] = 0.0  # a group whose rewards tie: its tokens' advantage is exactly 0 (clip_cov may choose them)
    w = torch.rand(B, T, generator=g, dtype=F64) * 1.5 + 0.25
    return logp, old, adv, mask, w, g


def options(mode, g):
    """The mode's settings, drawn: (actor kwargs for verl, PolicyLossConfig kwargs, GTPOConfig overrides)."""
    u = lambda lo, hi: float(lo + (hi - lo) * torch.rand((), generator=g, dtype=F64))  # noqa: E731
    lo, hi = u(0.1, 0.3), u(0.1, 0.35)
    if mode == "cispo" and float(torch.rand((), generator=g)) < 0.5:
        lo = u(1.0, 10.0)  # 1 - clip_ratio_low <= 0: no lower bound (CISPO's own setting)
    actor, pl, over = dict(clip_ratio=0.2, clip_ratio_low=lo, clip_ratio_high=hi), {}, dict(eps_low=lo, eps_high=hi)
    if mode in ("vanilla", "dppo_tv", "dppo_kl"):
        c = u(1.05, 3.0)
        actor["clip_ratio_c"], over["dual_clip_c"] = c, c
    if mode == "dro":
        b = u(0.05, 1.0)
        pl["dro_beta"], over["dro_beta"] = b, b
    if mode == "clip_cov":  # ratio 1: every candidate is chosen (verl's random choice then is no choice)
        lb = u(-0.6, 0.0)
        pl.update(clip_cov_ratio=1.0, clip_cov_lb=lb, clip_cov_ub=lb + u(0.3, 1.0))
        over.update(clip_cov_ratio=1.0, clip_cov_lb=lb, clip_cov_ub=pl["clip_cov_ub"])
    if mode == "kl_cov":
        r, k = u(0.05, 0.5), u(0.05, 1.0)
        pl.update(kl_cov_ratio=r, ppo_kl_coef=k)
        over.update(kl_cov_ratio=r, ppo_kl_coef=k)
    return actor, pl, over


def verl_call(fn, mode, agg, actor, pl, logp, old, adv, mask, w, B):
    """verl's registered function: (loss, d loss / d logp)."""
    _, _, ActorConfig, PolicyLossConfig = _verl()
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size=2, loss_agg_mode=agg,
                      policy_loss=PolicyLossConfig(loss_mode=mode, **pl), use_kl_loss=False, **actor)
    cfg.global_batch_info.update(global_batch_size=B)  # empty rows count, as in this package
    x = logp.clone().requires_grad_()
    tok_adv = adv[:, None].expand_as(logp).clone()
    loss, metrics = fn(old_log_prob=old, log_prob=x, advantages=tok_adv, response_mask=mask, loss_agg_mode=agg,
                       config=cfg, rollout_is_weights=w)
    loss.backward()
    verl_call.metrics = metrics  # (the last call's, for the metrics' comparison)
    return loss.detach(), x.grad


def ours(preset, agg, over, logp, old, adv, mask, w):
    """gtpo_loss_from_logps with the preset (token-sum: loss_agg='none', summed)."""
    cfg = GTPOConfig.preset(preset, **over)
    if cfg.policy_loss != "geo-mean":  # verl's geo_mean takes the mean over completions whatever agg says
        cfg = cfg.replace(loss_agg="none" if agg == "token-sum" else agg)
    x = logp.clone().requires_grad_()
    ids = torch.zeros(logp.shape, dtype=torch.long)
    out = gtpo_loss_from_logps(x, ids, adv, mask, old_logps=old, config=cfg, rollout_is_weights=w)
    loss = out.loss.sum() if cfg.loss_agg == "none" else out.loss
    loss.backward()
    return loss.detach(), x.grad


def worst(a, b):
    return float(((a - b).abs() / b.abs().clamp(min=1)).max()) if b.numel() else 0.0


def differences(mode, seed, agg, rollout):
    """(loss, gradient, plugin loss, plugin gradient) differences against verl's function, and whether
    the gradient was non-zero."""
    plugin, get_fn, *_ = _verl()
    logp, old, adv, mask, w, g = batch(seed)
    actor, pl, over = options(mode, g)
    w = w if rollout else None
    B = logp.shape[0]
    lv, gv = verl_call(get_fn(mode), mode, agg, actor, pl, logp, old, adv, mask, w, B)
    lo, go = ours(MODES[mode], agg, over, logp, old, adv, mask, w)
    want = verl_call.metrics
    lp, gp = verl_call(get_fn(f"gtpo_{mode}"), mode, agg, actor, pl, logp, old, adv, mask, w, B)
    got = verl_call.metrics
    assert sorted(got) == sorted(want), (mode, got, want)  # the metrics verl's mode logs, by its names
    for k in want:
        # (verl takes its means in float32: a bool mask's .float())
        assert got[k] == pytest.approx(float(want[k]), rel=1e-6, abs=1e-9), (mode, k, got[k], want[k])
    m = mask
    return (worst(lo, lv), worst(go[m], gv[m]), worst(lp, lv), worst(gp[m], gv[m]), bool(gv[m].abs().sum() > 0))


def test_verl_settings_out_of_range_are_refused_by_their_verl_names():
    """A clip range the PPO clip does not take (clip_ratio_low >= 1 but for cispo) or clip_cov bounds that
    select nothing are refused naming verl's setting, not only the GTPOConfig field it becomes."""
    _, get_fn, *_ = _verl()
    logp, old, adv, mask, w, _ = batch(3)
    B = logp.shape[0]
    with pytest.raises(ValueError, match=r"clip_ratio_low \(or clip_ratio\) \(GTPOConfig\.eps_low\) must be in \[0, 1\)"):
        verl_call(get_fn("gtpo_vanilla"), "vanilla", "token-mean", dict(clip_ratio=0.2, clip_ratio_low=1.5,
                                                                        clip_ratio_high=0.2), {}, logp, old, adv, mask, w, B)
    with pytest.raises(ValueError, match=r"policy_loss\.clip_cov_lb \(GTPOConfig\.clip_cov_lb\) must be < clip_cov_ub"):
        verl_call(get_fn("gtpo_clip_cov"), "clip_cov", "token-mean", dict(clip_ratio=0.2),
                  dict(clip_cov_lb=2.0, clip_cov_ub=1.0), logp, old, adv, mask, w, B)


@pytest.mark.parametrize("mode", list(MODES))
@settings(max_examples=examples(4))
@given(seed=st.integers(0, 2**31 - 1), agg=st.sampled_from(VERL_AGGS), rollout=st.booleans())
def test_mode_equals_verl(mode, seed, agg, rollout):
    d = differences(mode, seed, agg, rollout)
    assert max(d[:4]) <= TOL, f"{mode} {agg} rollout={rollout}: differences {d[:4]}"


def test_modes_not_vacuous():
    """On these batches every mode's gradient is non-zero, and the clips and selections act: the dual
    clip, dppo's trust region, geo_mean's clip and clip_cov's choice remove some tokens' gradient (not
    all), kl_cov's penalty changes the loss."""
    _verl()
    for mode in MODES:
        frac, nonzero = [], False
        for seed in range(6):
            logp, old, adv, mask, w, g = batch(seed, B=6, T=8)
            actor, pl, over = options(mode, g)
            out = gtpo_loss_from_logps(logp.clone().requires_grad_(), torch.zeros(6, 8, dtype=torch.long), adv, mask,
                                       old_logps=old, config=GTPOConfig.preset(MODES[mode], **over))
            frac.append(float(out.metrics["clip_frac"]))
            nonzero |= differences(mode, seed, "token-mean", True)[4]
            if mode == "kl_cov":
                off = gtpo_loss_from_logps(logp, torch.zeros(6, 8, dtype=torch.long), adv, mask, old_logps=old,
                                           config=GTPOConfig.preset("kl-cov", **{**over, "ppo_kl_coef": 0.0}))
                assert float(out.loss.detach() - off.loss) > 0
        assert nonzero, mode
        if mode in ("vanilla", "dppo_tv", "dppo_kl", "geo_mean", "clip_cov"):
            assert max(frac) > 0 and min(frac) < 1, (mode, frac)


def _gspo_sapo(name, seed, agg, w_kind, shift=0.0):
    """verl's gspo / sapo and the preset of the same name: (loss difference, gradient difference)."""
    _, get_fn, *_ = _verl()
    logp, old, adv, mask, w, g = batch(seed, B=5, T=6)
    mask[:, 0] = True
    old = old - shift  # shift: a mean log-ratio above verl's cap of 10 (GSPO)
    w = None if w_kind is None else (w if w_kind == "token" else w[:, :1].expand_as(w).clone())
    lv, gv = verl_call(get_fn(name), name, agg, dict(clip_ratio=0.2), {}, logp, old, adv, mask, w, 5)
    lo, go = ours(name, agg, {}, logp, old, adv, mask, w)
    return worst(lo, lv), worst(go[mask], gv[mask])


@pytest.mark.parametrize("agg", [a for a in VERL_AGGS if a != "token-sum"])
def test_verl_gspo_against_the_gspo_preset(agg):
    """verl's gspo = the gspo preset (any aggregation, per-completion rollout weights); it differs with
    rollout weights that vary within a completion (verl: each token's weight on its own gradient; here
    the completion's mean weight on each) and where the mean log-ratio exceeds 10 (verl caps it)."""
    for seed in range(3):
        assert max(_gspo_sapo("gspo", seed, agg, None)) <= TOL
        assert max(_gspo_sapo("gspo", seed, agg, "sequence")) <= TOL
    d_loss, d_grad = _gspo_sapo("gspo", 0, agg, "token")
    assert d_loss <= TOL and d_grad > 1e-3
    assert _gspo_sapo("gspo", 0, agg, None, shift=11.0)[0] > 1e-3


@pytest.mark.parametrize("agg", VERL_AGGS)
def test_verl_sapo_against_the_sapo_preset(agg):
    """verl's sapo = the sapo preset (seq-mean-token-mean) whatever loss_agg_mode verl is given (verl
    forces seq-mean-token-mean); the preset with another loss_agg differs."""
    for seed, w_kind in ((0, None), (1, "token"), (2, "sequence")):
        _, get_fn, *_ = _verl()
        logp, old, adv, mask, w, g = batch(seed, B=5, T=6)
        w = None if w_kind is None else w
        lv, gv = verl_call(get_fn("sapo"), "sapo", agg, dict(clip_ratio=0.2), {}, logp, old, adv, mask, w, 5)
        lo, go = ours("sapo", "seq-mean-token-mean", {}, logp, old, adv, mask, w)
        assert max(worst(lo, lv), worst(go[mask], gv[mask])) <= TOL
    if agg not in ("seq-mean-token-mean", "token-sum"):
        lo, _ = ours("sapo", agg, {}, logp, old, adv, mask, w)
        assert worst(lo, lv) > 1e-6


@pytest.mark.parametrize("mode", ["vanilla", "gpg", "dppo_tv", "dppo_kl", "cispo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_plugin_mode_with_gtpo_equals_the_preset_with_gtpo_on_top(mode, agg):
    """get_policy_loss_fn('gtpo_<mode>') on the gtpo trainer's token advantages (rows shuffled) =
    gtpo_loss_from_logps with the mode's preset and GTPO's conflict weights and entropy filter on top
    (the terms homogeneous in A, where lambda * Ahat folds in exactly): loss and gradient."""
    import numpy as np

    from gtpo_kernels import gtpo_token_advantages
    from test_verl_plugin import _rollout
    _, get_fn, ActorConfig, PolicyLossConfig = _verl()
    r = _rollout(4)
    B = r["ids"].shape[0]
    r = {k: (v.double() if v.is_floating_point() else v) for k, v in r.items()}
    cfg = GTPOConfig.preset(MODES[mode], use_conflict_mask=True, entropy_threshold=0.7, loss_agg=agg)
    uid = np.array([f"uid{g}" for g in r["group"].tolist()], dtype=object)
    tok_adv = gtpo_token_advantages(r["adv"][:, None] * r["mask"], r["ids"], r["mask"], r["H"], uid, config=cfg)
    actor = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size=2, loss_agg_mode=agg, clip_ratio=0.2,
                        policy_loss=PolicyLossConfig(loss_mode=f"gtpo_{mode}"), use_kl_loss=False)
    x = r["logp"].clone().requires_grad_()
    mask = r["mask"].bool()
    lv, _ = get_fn(f"gtpo_{mode}")(old_log_prob=r["old"], log_prob=x, advantages=tok_adv, response_mask=mask,
                                   loss_agg_mode=agg, config=actor)
    lv.backward()
    order = torch.argsort(r["group"], stable=True)
    y = r["logp"].clone().requires_grad_()
    out = gtpo_loss_from_logps(y[order], r["ids"][order], r["adv"][order], mask[order], entropy=r["H"][order],
                               group_size=4, old_logps=r["old"][order], config=cfg)
    out.loss.backward()
    assert worst(out.loss.detach(), lv.detach()) <= TOL and worst(y.grad[mask], x.grad[mask]) <= TOL
    assert float(out.metrics["conflict_frac"]) > 0 and 0 < float(out.metrics["filtered_frac"]) < 1
