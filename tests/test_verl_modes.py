"""verl 0.9.1's loss modes as presets (spec 9) against the float64 reference: every mode with random
options, GTPO's conflict weights and entropy shaping on top half of the time, every loss_agg, rollout
weights per token or per completion, in float64 (the logits on the torch backend, and
gtpo_loss_from_logps) and in float32 on both backends (gtpo_loss and the fused LM head); clip_cov's draw
reproducible with its generator and a uniform choice of the right size; the refusals. Against verl's own
functions: tests/test_verl_losses.py."""
import dataclasses

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import gtpo_reference as ref
from batches import cases
from conftest import TOL, assert_grad_close, assert_value_close, examples
from gtpo_kernels import LOSS_AGGS, GTPOConfig, gtpo_loss, gtpo_loss_from_logps, linear_gtpo_loss

MODES = ["vanilla", "gpg", "dppo_tv", "dppo_kl", "dro", "verl_cispo", "geo_mean", "clip_cov", "kl_cov"]


@st.composite
def mode_configs(draw):
    """A verl preset with random options; GTPO's conflict weights and shaping on top half of the time."""
    preset = draw(st.sampled_from(MODES))
    u = lambda lo, hi: draw(st.floats(lo, hi))  # noqa: E731
    over = dict(eps_low=u(0.05, 0.3), eps_high=u(0.05, 0.35), entropy_threshold=None)
    if preset in ("vanilla", "dppo_tv", "dppo_kl"):
        over["dual_clip_c"] = draw(st.sampled_from([None, u(1.05, 3.0)]))
    if preset == "dro":
        over["dro_beta"] = u(0.05, 1.0)
    if preset == "clip_cov":
        lb = u(-0.6, 0.1)
        over.update(clip_cov_ratio=draw(st.sampled_from([1e-4, 0.2, 0.5, 1.0])), clip_cov_lb=lb,
                    clip_cov_ub=lb + u(0.2, 1.0), generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    if preset == "kl_cov":
        over.update(kl_cov_ratio=draw(st.sampled_from([1e-4, 0.1, 0.4])), ppo_kl_coef=u(0.05, 1.0))
    if draw(st.booleans()):  # GTPO on top
        over.update(use_conflict_mask=True, entropy_penalty=draw(st.sampled_from([0.0, 0.1])))
    aggs = [a for a in LOSS_AGGS if not (preset == "geo_mean" and a == "none")]
    over["loss_agg"] = draw(st.sampled_from(aggs))
    return GTPOConfig.preset(preset, **over)


def margins(cfg, rlp, old, a_hat, m):
    """The distance of every decision the mode takes (clip edges, trust regions, covariance bounds,
    the top-k boundary) from its threshold, in float64: inputs too close are skipped."""
    lr, A = (rlp - old.double())[m], a_hat[:, None].expand_as(m)[m]
    r, p, p_old = lr.exp(), rlp[m].exp(), old.double()[m].exp()
    lo, hi, pl = cfg.eps_low, cfg.eps_high, cfg.policy_loss
    d = [lr.abs()]
    if pl in ("ppo", "clip-cov"):
        d += [(r - 1 + lo).abs(), (r - 1 - hi).abs()] + ([(r - cfg.dual_clip_c).abs()] if cfg.dual_clip_c else [])
    if pl in ("dppo-tv", "dppo-kl"):
        kl = p_old * (old.double()[m] - rlp[m]) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
        d += [(p - p_old - hi).abs(), (p - p_old + lo).abs(), (kl - hi).abs(), (kl - lo).abs()]
    if pl == "geo-mean":
        d += [(lr + lo).abs(), (lr - hi).abs()]
    if pl in ("clip-cov", "kl-cov") and m.any():
        cov = (A - A.mean()) * (rlp[m] - rlp[m].mean())
        d += [(cov - cfg.clip_cov_lb).abs(), (cov - cfg.clip_cov_ub).abs()] if pl == "clip-cov" else []
        k = max(1, int(cfg.kl_cov_ratio * int(m.sum())))
        srt = cov.sort(descending=True).values
        d += [srt[k - 1:k] - srt[k:k + 1]] if pl == "kl-cov" and srt.numel() > k else []
    return min(float(x.min()) if x.numel() else 1.0 for x in d)


def inputs(case, cfg, seed, rollout):
    g = torch.Generator().manual_seed(seed)
    B, T = case.ids.shape
    rlp, _ = ref.token_logprobs(case.logits[:, case.logits_start:case.logits_start + T].double(), case.ids,
                                case.temperature, case.counted)
    old = torch.where(case.counted, rlp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64), rlp)
    w = {None: None, "token": torch.rand(B, T, generator=g) * 1.5 + 0.25,
         "sequence": torch.rand(B, generator=g) * 1.5 + 0.25}[rollout]
    return rlp, old, w


def reference(case, cfg, kw, logits):
    xr = logits.double().detach().requires_grad_()
    fields = dataclasses.asdict(cfg)  # a copy of the generator, in the same state
    r = ref.gtpo_loss(xr, case.ids, case.adv, case.mask, logits_start=case.logits_start, **kw, **fields)
    (r["loss"].sum() if cfg.loss_agg == "none" else r["loss"]).backward()
    return r, xr.grad


def _check(case, cfg, seed, rollout, eps):
    """Skips inputs at a threshold; -> (cfg with the case's temperature, keyword arguments, reference)."""
    cfg = cfg.replace(temperature=case.temperature)
    rlp, old, w = inputs(case, cfg, seed, rollout)
    kw = dict(group_size=case.G, old_logps=old, rollout_is_weights=w)
    r, grad = reference(case, cfg, kw, case.logits)
    assume(margins(cfg, rlp, old, (r["kept"] * (case.adv.double() - cfg.entropy_penalty * r["seq_entropy"])),
                   case.counted) > eps)
    return cfg, kw, r, grad


@settings(max_examples=examples(25))
@given(case=cases(), cfg=mode_configs(), rollout=st.sampled_from([None, "token", "sequence"]),
       entry=st.sampled_from(["logits", "logps"]), seed=st.integers(0, 1000))
def test_modes_match_reference_float64(case, cfg, rollout, entry, seed):
    """float64: gtpo_loss (torch backend) or gtpo_loss_from_logps (chained through log_softmax) = the
    reference, value, per-token loss and gradient."""
    case = dataclasses.replace(case, logits=case.logits.double())
    cfg, kw, r, grad = _check(case, cfg, seed, rollout, 1e-9)
    fresh = dict(kw, config=cfg.replace(generator=None if cfg.generator is None else
                                        torch.Generator().manual_seed(cfg.generator.initial_seed())))
    T = case.ids.shape[1]
    x = case.logits.clone().requires_grad_()
    if entry == "logits":
        out = gtpo_loss(x, case.ids, case.adv, case.mask, backend="torch", logits_start=case.logits_start, **fresh)
    else:
        z = x[:, case.logits_start:case.logits_start + T]
        lp_all = torch.log_softmax(z / case.temperature, -1)
        lp = lp_all.gather(-1, case.ids.long().clamp(min=0)[..., None])[..., 0]
        p = lp_all.exp()
        ent = -(p * torch.where(p > 0, lp_all, torch.zeros(()))).sum(-1)
        out = gtpo_loss_from_logps(lp, case.ids, case.adv, case.mask, entropy=ent, **fresh)
    (out.loss.sum() if cfg.loss_agg == "none" else out.loss).backward()
    tol = TOL[torch.float64]
    assert_value_close("loss", out.loss.detach(), r["loss"].detach(), tol["loss"])
    assert_value_close("per_token_loss", out.per_token_loss, r["per_token_loss"], tol["value"])
    assert_grad_close("grad logits", x.grad, grad, tol["grad"] if entry == "logits" else 1e-9)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@settings(max_examples=examples(4))
@given(case=cases(), cfg=mode_configs(), rollout=st.sampled_from([None, "token", "sequence"]),
       seed=st.integers(0, 1000))
def test_modes_match_reference_both_backends(backend, case, cfg, rollout, seed):
    """float32 on both backends: gtpo_loss on the logits and linear_gtpo_loss on hidden states and the
    LM head whose logits they are = the reference."""
    g = torch.Generator().manual_seed(seed)
    B, T_l, V = case.logits.shape
    D = 5
    h, w = torch.randn(B, T_l, D, generator=g), torch.randn(V, D, generator=g)
    case = dataclasses.replace(case, logits=(h @ w.t()).double().float())  # (exactly) the head's logits
    cfg, kw, r, grad = _check(case, cfg, seed, rollout, 1e-4)
    tol = TOL[torch.float32]
    gen = lambda: None if cfg.generator is None else torch.Generator().manual_seed(cfg.generator.initial_seed())  # noqa
    x = case.logits.clone().requires_grad_()
    out = gtpo_loss(x, case.ids, case.adv, case.mask, backend=backend, logits_start=case.logits_start,
                    config=cfg.replace(generator=gen()), **kw)
    (out.loss.sum() if cfg.loss_agg == "none" else out.loss).backward()
    assert_value_close("loss", out.loss.detach(), r["loss"].detach(), tol["loss"])
    assert_grad_close("grad logits", x.grad, grad, tol["grad"])
    T = case.ids.shape[1]
    hh = h[:, case.logits_start:case.logits_start + T].clone().requires_grad_()
    lin = linear_gtpo_loss(hh, w, case.ids, case.adv, case.mask, backend=backend, config=cfg.replace(generator=gen()),
                           **kw)
    (lin.loss.sum() if cfg.loss_agg == "none" else lin.loss).backward()
    assert_value_close("head loss", lin.loss.detach(), r["loss"].detach(), tol["loss"])
    want = grad[:, case.logits_start:case.logits_start + T] @ w.double()
    assert_grad_close("grad hidden", hh.grad, want, tol["grad"])
