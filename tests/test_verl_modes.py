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
def mode_configs(draw, modes=tuple(MODES)):
    """A verl preset with random options; GTPO's conflict weights and shaping on top half of the time."""
    preset = draw(st.sampled_from(modes))
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
    if pl == "kl-cov":  # a chosen token's -A r + coef sign(log r) cancelling: ill-conditioned in float32 (a
        # ratio of 6e-4 to its parts gave a relative gradient error of 2e-4); 1e-4 here stands for a ratio 0.05
        coef = cfg.ppo_kl_coef
        d += [2e-3 * (-A * r + coef * lr.sign()).abs() / (A.abs() * r + coef)]
    return min(float(x.min()) if x.numel() else 1.0 for x in d)


def inputs(case, cfg, seed, rollout):
    g = torch.Generator().manual_seed(seed)
    B, T = case.ids.shape
    rlp, _ = ref.token_logprobs(case.logits[:, case.logits_start:case.logits_start + T].double(), case.ids,
                                case.temperature, case.counted)
    if seed % 3 < 2:  # a step in log space, small or large
        old = rlp + [0.1, 0.7][seed % 3] * torch.randn(B, T, generator=g, dtype=torch.float64)
    else:  # a step in probability (dppo's trust regions bind)
        old = torch.log((rlp.exp() + torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5).clamp(1e-3, 0.999))
    old = torch.where(case.counted, old.clamp(max=0), rlp)
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


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=examples(5))
@given(data=st.data(), case=cases(), rollout=st.sampled_from([None, "token", "sequence"]),
       entry=st.sampled_from(["logits", "logps"]), seed=st.integers(0, 1000))
def test_modes_match_reference_float64(mode, data, case, rollout, entry, seed):
    """float64: gtpo_loss (torch backend) or gtpo_loss_from_logps (chained through log_softmax) = the
    reference, value, per-token loss and gradient."""
    cfg = data.draw(mode_configs((mode,)))
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


def _clip_cov_batch():
    g = torch.Generator().manual_seed(11)
    B, T = 6, 8
    logp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logp + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)  # all inside the clip range
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return logp, old, adv, torch.zeros(B, T, dtype=torch.long)


def test_clip_cov_draw_reproducible_uniform_and_sized():
    """clip_cov chooses max(1, floor(ratio * M)) of its candidates (here every counted token), the same
    ones for the same generator state, and each candidate about equally often over many draws."""
    logp, old, adv, ids = _clip_cov_batch()
    M = logp.numel()
    cfg = GTPOConfig.preset("clip_cov", clip_cov_ratio=0.25, clip_cov_lb=-100.0, clip_cov_ub=100.0)
    k = int(0.25 * M)

    def chosen(seed):
        out = gtpo_loss_from_logps(logp, ids, adv, old_logps=old,
                                   config=cfg.replace(generator=torch.Generator().manual_seed(seed)))
        return out.per_token_loss == 0

    assert torch.equal(chosen(1), chosen(1)) and not torch.equal(chosen(1), chosen(2))
    counts = torch.zeros(logp.shape)
    n = 300
    gen = torch.Generator().manual_seed(5)  # one generator, advancing
    for _ in range(n):
        out = gtpo_loss_from_logps(logp, ids, adv, old_logps=old, config=cfg.replace(generator=gen))
        sel = out.per_token_loss == 0
        assert int(sel.sum()) == k
        counts += sel
    p = k / M  # each token's chance; binomial(300, 0.25): sd 7.5
    assert (counts - n * p).abs().max() < 6 * (n * p * (1 - p)) ** 0.5


@pytest.mark.parametrize("call,match", [
    (lambda: GTPOConfig.preset("dro"), "dro_beta must be > 0 with policy_loss='dro'"),
    (lambda: GTPOConfig.preset("dro", dro_beta=0.0), "dro_beta must be None or > 0"),
    (lambda: GTPOConfig.preset("vanilla", dual_clip_c=1.0), "dual_clip_c must be None or > 1"),
    (lambda: GTPOConfig.preset("sapo", dual_clip_c=3.0), "dual_clip_c must be None with policy_loss='sapo'"),
    (lambda: GTPOConfig.preset("dppo_tv", dual_clip_c=0.0), "dual_clip_c must be None or > 0"),
    (lambda: GTPOConfig.preset("clip_cov", clip_cov_ratio=0.0), "clip_cov_ratio must be > 0"),
    (lambda: GTPOConfig.preset("kl_cov", kl_cov_ratio=-1.0), "kl_cov_ratio must be > 0"),
    (lambda: GTPOConfig.preset("kl_cov", ppo_kl_coef=-0.1), "ppo_kl_coef must be >= 0"),
    (lambda: GTPOConfig.preset("clip_cov", clip_cov_lb=5.0), "clip_cov_lb must be < clip_cov_ub"),
    (lambda: GTPOConfig.preset("clip_cov", clip_cov_ub=float("nan")), "clip_cov_ub must be a finite number"),
    (lambda: GTPOConfig.preset("clip_cov", generator=3), "generator must be None or a torch.Generator"),
    (lambda: GTPOConfig.preset("geo_mean", loss_agg="none"), "loss_agg must be aggregated"),
    (lambda: GTPOConfig.preset("verl_cispo", eps_high=-0.1), "eps_high must be >= 0"),
    (lambda: GTPOConfig.preset("geo_mean", importance_sampling_level="sequence"), "importance_sampling_level"),
    (lambda: GTPOConfig(policy_loss="dppo"), "policy_loss must be one of"),
])
def test_verl_mode_refusals(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_fused_head_refused_where_the_term_spans_the_batch():
    """clip_cov's and kl_cov's selections span the batch: the fused schedule is refused, auto recomputes."""
    g = torch.Generator().manual_seed(2)
    h, w = torch.randn(4, 3, 5, generator=g), torch.randn(7, 5, generator=g)
    ids, adv = torch.randint(0, 7, (4, 3), generator=g), torch.randn(4, generator=g)
    for preset in ("clip_cov", "kl_cov"):
        with pytest.raises(ValueError, match="clip_cov's, kl_cov's selection"):
            linear_gtpo_loss(h, w, ids, adv, config=preset, schedule="fused", backend="torch")
        out = linear_gtpo_loss(h, w, ids, adv, config=preset, backend="torch")
        assert float(out.metrics["grad_in_forward"]) == 0.0


@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl"])
def test_dppo_trust_region_edges(mode):
    """DPPO's asymmetric trust region, by hand: steps in probability whose divergence lies below, between
    and above eps_low < eps_high, for A > 0 (the step up within eps_high) and A < 0 (the step down within
    eps_low)."""
    lo, hi = (0.1, 0.2) if mode == "dppo_tv" else (0.05, 0.2)
    d = torch.tensor([0.05, 0.15, 0.25, 0.35, -0.05, -0.15, -0.25, -0.35], dtype=torch.float64)
    p_old = torch.full((8,), 0.5, dtype=torch.float64)
    logp, old = torch.log(p_old + d).repeat(2, 1), torch.log(p_old).repeat(2, 1)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    if mode == "dppo_tv":
        div = d
    else:
        p = p_old + d
        div = p_old * (old[0] - logp[0]) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
    up = (div <= hi) if mode == "dppo_tv" else (div <= hi) | (d <= 0)
    down = (div >= -lo) if mode == "dppo_tv" else (div <= lo) | (d >= 0)
    valid = torch.stack([up, down])
    between = (div.abs() > lo) & (div.abs() <= hi)  # where eps_low and eps_high decide differently
    assert between[d > 0].any() and between[d < 0].any()
    cfg = GTPOConfig.preset(mode, eps_low=lo, eps_high=hi)
    out = gtpo_loss_from_logps(logp.clone().requires_grad_(), torch.zeros(2, 8, dtype=torch.long), adv,
                               old_logps=old, config=cfg)
    assert torch.equal(out.per_token_loss != 0, valid)
    # the same through the reference (logits whose log-probs are logp: the target's logit logp, the other
    # entry's log(1 - p))
    z = torch.stack([logp, torch.log1p(-logp.exp())], -1)
    r = ref.gtpo_loss(z, torch.zeros(2, 8, dtype=torch.long), adv, old_logps=old, **dataclasses.asdict(cfg))
    assert_value_close("per_token_loss", out.per_token_loss, r["per_token_loss"], 1e-12)


def test_selections_trace_without_a_host_read():
    """clip_cov's and kl_cov's selections trace whole under torch.compile(fullgraph=True): no shape read
    from the data (nonzero, boolean indexing: a host sync); the traced result equals eager. (An explicit
    generator is outside what dynamo traces: there clip_cov uses the device's default one.)"""
    from gtpo_kernels.objective import verl_modes as vm
    g = torch.Generator().manual_seed(4)
    N = 40
    A, logp, log_r = torch.randn(N, generator=g), -torch.rand(N, generator=g) * 3, 0.3 * torch.randn(N, generator=g)
    m, on_clip = torch.rand(N, generator=g) > 0.2, torch.rand(N, generator=g) > 0.8
    M = m.sum().float()
    kl = GTPOConfig.preset("kl_cov", kl_cov_ratio=0.2)
    cc = GTPOConfig.preset("clip_cov", clip_cov_ratio=0.2, clip_cov_lb=-9.0, clip_cov_ub=9.0)
    calls = [lambda A, lp, lr, m, M: vm.kl_cov(A, lp, lr, m, M, M.clamp(min=1), kl)[:2],
             lambda A, lp, lr, m, M: vm.clip_cov(lr, lr, on_clip & False, on_clip, A, lp, m, M, M.clamp(min=1), cc)]
    import torch._dynamo as dynamo
    for fn in calls:
        torch.manual_seed(1)
        with dynamo.config.patch(capture_scalar_outputs=False, capture_dynamic_output_shape_ops=False):
            got = torch.compile(fn, fullgraph=True, backend="eager")(A, logp, log_r, m, M)
        torch.manual_seed(1)
        want = fn(A, logp, log_r, m, M)
        assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert not torch.equal(want[0], log_r)  # clip_cov chose some tokens


@pytest.mark.parametrize("mode", ["dro"])
def test_fused_head_keeps_rows_of_zero_advantage_where_the_term_needs_them(mode):
    """dro's quadratic term has a gradient where A = 0: the fused schedule must not skip those rows (it
    did: the head's hidden gradient was 0.99 off for a completion with A = 0). (kl_cov's penalty too, but
    its batch-wide selection never runs fused.)"""
    g = torch.Generator().manual_seed(0)
    B, T, V, D = 4, 3, 7, 5
    h, w = torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.tensor([0.0, 1.0, 0.0, -1.0])
    old = -torch.rand(B, T, generator=g) - 1.5
    over = dict(dro_beta=1.0) if mode == "dro" else dict(kl_cov_ratio=0.5)
    cfg = GTPOConfig.preset(mode, **over)
    x = (h @ w.t()).requires_grad_()
    gtpo_loss(x, ids, adv, old_logps=old, config=cfg, backend="torch").loss.backward()
    want = x.grad @ w
    assert (want[0] != 0).any()  # the A = 0 completion's rows have a gradient
    hh = h.clone().requires_grad_()
    out = linear_gtpo_loss(hh, w, ids, adv, old_logps=old, config=cfg, schedule="fused", backend="torch")
    out.loss.backward()
    assert float(out.metrics["grad_in_forward"]) == 1.0
    assert float((hh.grad - want).norm() / want.norm()) <= 1e-5


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_verl_cispo_takes_a_lower_clip_of_one_or_more(backend):
    """verl-cispo with eps_low >= 1 (1 - eps_low <= 0: no lower bound, CISPO's own setting, as verl takes it)
    equals the float64 reference, and every such eps_low gives the same loss; eps_low 0.2 clips some ratios
    below 0.8 here, so the loss differs."""
    g = torch.Generator().manual_seed(4)
    B, T, V = 4, 5, 11
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    old = torch.log_softmax(z, -1).gather(-1, ids[..., None])[..., 0] + 0.6 * torch.randn(B, T, generator=g,
                                                                                           dtype=torch.float64)
    losses = []
    for lo in (1.0, 1.5, 0.2):
        cfg = GTPOConfig.preset("verl-cispo", eps_low=lo, eps_high=4.0, entropy_threshold=None)
        r = ref.gtpo_loss(z, ids, adv, group_size=2, old_logps=old, **dataclasses.asdict(cfg))
        out = gtpo_loss(z.float(), ids, adv.float(), group_size=2, old_logps=old.float(), config=cfg, backend=backend)
        assert_value_close("loss", out.loss, r["loss"], TOL[torch.float32]["loss"])
        losses.append(float(out.loss))
    assert losses[0] == losses[1] and abs(losses[0] - losses[2]) > 1e-4, losses
