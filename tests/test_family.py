"""The GRPO family (spec 9) and GTPO from per-token log-probs (spec 10), against the float64 reference:
every preset and field, GTPO's conflict weights and entropy control on top of each policy term, the
rollout weights, the packed form; gtpo_loss_from_logps against gtpo_loss; the refusals."""
import dataclasses

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import gtpo_reference as ref
from gtpo_reference import gtpo_family
from batches import cases, reference_logps
from conftest import TOL, assert_grad_close, assert_value_close, examples
from gtpo_kernels import GTPOConfig, gtpo_loss, gtpo_loss_from_logps, rollout_is_weights

BACKENDS = ["triton", "torch"]
FAMILY = ["bnpo", "cispo", "sapo", "gspo", "luspo", "vespo", "grpo", "dapo", "dr_grpo", "gtpo"]


@st.composite
def family_configs(draw):
    """A family preset with random options, and GTPO's parts switched on half of the time."""
    preset = draw(st.sampled_from(FAMILY))
    over = {}
    if draw(st.booleans()):  # GTPO on top of the TRL loss type
        over.update(use_conflict_mask=True, entropy_penalty=draw(st.sampled_from([0.0, 0.1])))
    if draw(st.booleans()):
        over["beta"] = 0.04
        over["use_bias_correction_kl"] = draw(st.booleans())
    if draw(st.booleans()):
        over["off_policy_mask_threshold"] = draw(st.sampled_from([0.0, 0.02, 0.5]))
    if draw(st.booleans()):
        over["top_entropy_quantile"] = draw(st.sampled_from([0.2, 0.5, 1.0]))
    if draw(st.booleans()):
        over["entropy_coef"] = 0.01
    cfg = GTPOConfig.preset(preset)
    if cfg.policy_loss == "ppo" and draw(st.booleans()):
        over["delta"] = draw(st.sampled_from([1.1, 1.5]))
    if cfg.policy_loss == "ppo" and draw(st.booleans()):
        over["clip"] = False
    return cfg.replace(**over)


def _inputs(case, cfg, gen, rollout):
    B, T = case.ids.shape
    rlp = reference_logps(case)
    nan = torch.full((B, T), float("nan"))
    old = torch.where(case.counted, rlp + 0.3 * torch.randn(B, T, generator=gen), nan).float()
    refl = torch.where(case.counted, rlp + 0.3 * torch.randn(B, T, generator=gen), nan).float() \
        if cfg.beta > 0 else None
    roll_lp = torch.where(case.counted, old.double() + 0.2 * torch.randn(B, T, generator=gen), nan).float()
    w = None
    if rollout == "token":
        w = (torch.rand(B, T, generator=gen) * 1.5 + 0.25)
    elif rollout == "sequence":
        w = torch.rand(B, generator=gen) * 1.5 + 0.25
    return old, refl, roll_lp, w


def _away_from_thresholds(case, cfg, old, roll_lp):
    """Decisions taken on float32 vs float64 values must not sit on their thresholds."""
    _, rent = ref.token_logprobs(case.logits[:, case.logits_start:case.logits_start + case.ids.shape[1]].double(),
                                 case.ids, case.temperature, case.counted)
    rlp = reference_logps(case)
    m = case.counted
    r = torch.exp(rlp - old.double())[m]
    if r.numel() and cfg.policy_loss == "ppo" and cfg.importance_sampling_level == "token":
        for edge in (1 - cfg.eps_low, 1 + cfg.eps_high) + ((cfg.delta,) if cfg.delta else ()):
            assume((r - edge).abs().min() > 1e-4)
    if cfg.importance_sampling_level == "sequence":
        n = m.sum(1).clamp(min=1)
        rs = torch.exp(torch.where(m, rlp - old.double(), torch.zeros(())).sum(1) / n)
        for edge in (1 - cfg.eps_low, 1 + cfg.eps_high) + ((cfg.delta,) if cfg.delta else ()):
            assume((rs - edge).abs().min() > 1e-4)
    if cfg.top_entropy_quantile < 1.0 and m.any():
        h = rent[m].sort().values
        assume(h.numel() < 2 or (h[1:] - h[:-1]).min() > 1e-4)
    if cfg.off_policy_mask_threshold is not None:
        n = m.sum(1).clamp(min=1)
        kl = torch.where(m, roll_lp.double() - rlp, torch.zeros(())).sum(1) / n
        assume((kl - cfg.off_policy_mask_threshold).abs().min() > 1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(10))  # CI time: nightly runs 100
@given(case=cases(), cfg=family_configs(), rollout=st.sampled_from([None, "token", "sequence"]),
       use_roll_lp=st.booleans(), seed=st.integers(0, 1000))
def test_family_matches_reference(backend, case, cfg, rollout, use_roll_lp, seed):
    gen = torch.Generator().manual_seed(seed)
    cfg = cfg.replace(temperature=case.temperature, entropy_threshold=None)
    old, refl, roll_lp, w = _inputs(case, cfg, gen, rollout)
    roll_lp = roll_lp if use_roll_lp else None
    _away_from_thresholds(case, cfg, old, roll_lp if roll_lp is not None else old)
    kw = dict(group_size=case.G, old_logps=old, ref_logps=refl, logits_start=case.logits_start,
              rollout_is_weights=w, rollout_logps=roll_lp)
    x = case.logits.clone().requires_grad_()
    out = gtpo_loss(x, case.ids, case.adv, case.mask, config=cfg, backend=backend, **kw)
    out.loss.backward()
    xr = case.logits.double().requires_grad_()
    r = ref.gtpo_loss(xr, case.ids, case.adv, case.mask, **kw, **dataclasses.asdict(cfg))
    r["loss"].backward()
    tol = TOL[case.logits.dtype]
    assert_value_close("loss", out.loss.detach(), r["loss"].detach(), tol["loss"])
    for name in ("logps", "entropy", "per_token_loss", "lam"):
        assert_value_close(name, getattr(out, name), r[name], tol["value"])
    assert_grad_close("grad logits", x.grad, xr.grad, tol["grad"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset", FAMILY)
def test_each_preset_packed_equals_padded_and_reference(backend, preset):
    """Every preset with GTPO's conflict weights on top, padded and packed, against the reference."""
    g = torch.Generator().manual_seed(7)
    B, T, V = 4, 5, 13
    x = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[1, :3] = ids[0, :3]
    ids[3, 2:] = ids[2, 2:]
    adv = torch.tensor([1.0, -1.0, -0.5, 0.7])
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2, 4] = False
    old = torch.randn(B, T, generator=g) * 0.3 - 2.6
    cfg = GTPOConfig.preset(preset, use_conflict_mask=True, entropy_threshold=None)
    kw = dict(group_size=2, old_logps=old)
    xp = x.clone().requires_grad_()
    pad = gtpo_loss(xp, ids, adv, mask, config=cfg, backend=backend, **kw)
    pad.loss.backward()
    xr = x.double().requires_grad_()
    r = ref.gtpo_loss(xr, ids, adv, mask, **kw, **dataclasses.asdict(cfg))
    r["loss"].backward()
    assert xr.grad.abs().sum() > 0 and (r["lam"] != 1).any()
    assert_value_close("loss", pad.loss.detach(), r["loss"].detach(), 1e-5)
    assert_grad_close("grad", xp.grad, xr.grad, 1e-5)
    # packed: drop the masked-out token
    keep = mask.reshape(-1)
    lengths = mask.sum(1)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    xk = x.reshape(B * T, V)[keep].clone().requires_grad_()
    pk = gtpo_loss(xk, ids.reshape(-1)[keep], adv, config=cfg, backend=backend, group_size=2,
                   old_logps=old.reshape(-1)[keep], cu_seqlens=cu, max_seqlen=T)
    pk.loss.backward()
    if cfg.loss_agg != "seq-mean-token-sum-norm":  # its default denominator differs (T vs the longest)
        assert_value_close("packed loss", pk.loss.detach(), pad.loss.detach(), 1e-6)
        assert_grad_close("packed grad", xk.grad, xp.grad.reshape(B * T, V)[keep], 1e-5)
    assert_value_close("packed per_token_loss", pk.per_token_loss, pad.per_token_loss.reshape(-1)[keep], 1e-6)


@given(case=cases(), cfg=family_configs(), with_old=st.booleans(), seed=st.integers(0, 1000))
def test_from_logps_equals_gtpo_loss(case, cfg, with_old, seed):
    """gtpo_loss_from_logps on the log-probs and entropies of the logits = gtpo_loss on the logits:
    the value, the outputs and the gradient (chained through log_softmax in float64)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = cfg.replace(temperature=case.temperature, entropy_threshold=draw_threshold(case))
    old, refl, roll_lp, _ = _inputs(case, cfg, gen, None)
    old = old if with_old else None
    if old is not None:
        _away_from_thresholds(case, cfg, old, old)
    kw = dict(group_size=case.G, old_logps=old, ref_logps=refl, config=cfg)
    T = case.ids.shape[1]
    z = case.logits[:, case.logits_start:case.logits_start + T].double().requires_grad_()
    lp_all = torch.log_softmax(z / case.temperature, -1)
    logps = lp_all.gather(-1, case.ids.long().clamp(min=0)[..., None])[..., 0]
    p = lp_all.exp()
    entropy = -(p * torch.where(p > 0, lp_all, torch.zeros(()))).sum(-1)
    a = gtpo_loss_from_logps(logps, case.ids, case.adv, case.mask, entropy=entropy, **kw)
    a.loss.backward()
    x = z.detach().clone().requires_grad_()
    b = gtpo_loss(x, case.ids, case.adv, case.mask, backend="torch", **kw)  # float64: the torch path
    b.loss.backward()
    assert_value_close("loss", a.loss.detach(), b.loss.detach(), 1e-10)
    for name in ("logps", "entropy", "per_token_loss", "lam", "n_conf", "seq_entropy"):
        assert_value_close(name, getattr(a, name), getattr(b, name), 1e-10)
    assert torch.equal(a.kept, b.kept)
    for k, v in b.metrics.items():
        assert_value_close(k, a.metrics[k], v, 1e-10)
    assert_grad_close("grad", z.grad, x.grad, 1e-9)


def draw_threshold(case):
    """An entropy threshold between the completions' mean entropies (some kept, some filtered)."""
    _, rent = ref.token_logprobs(case.logits[:, case.logits_start:case.logits_start + case.ids.shape[1]].double(),
                                 case.ids, case.temperature, case.counted)
    n = case.counted.sum(1)
    hbar = (rent.sum(1) / n.clamp(min=1))[n > 0].sort().values
    if hbar.numel() < 2 or (hbar[1:] - hbar[:-1]).max() < 1e-3:
        return None
    k = int((hbar[1:] - hbar[:-1]).argmax())
    return float((hbar[k] + hbar[k + 1]) / 2)


def test_from_logps_gradient_reaches_entropy_only_with_the_bonus():
    g = torch.Generator().manual_seed(3)
    B, T = 4, 5
    logps = (-torch.rand(B, T, generator=g) * 3).requires_grad_()
    ent = (torch.rand(B, T, generator=g) * 2).requires_grad_()
    ids = torch.randint(0, 9, (B, T), generator=g)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    out = gtpo_loss_from_logps(logps, ids, adv, entropy=ent, group_size=2,
                               config=GTPOConfig(entropy_threshold=None, entropy_coef=0.1))
    out.loss.backward()
    assert logps.grad.abs().sum() > 0
    assert torch.allclose(ent.grad, torch.full((B, T), -0.1 / (B * T)))
    # without the bonus, with the entropy filter (one completion dropped) and shaping on: Hbar is a
    # constant (spec 2), so no gradient reaches the entropies, while the log-probs still get theirs
    hbar = ent.detach().mean(1)
    cut = float(hbar.sort().values[2:].mean())  # between the 3rd and 4th completion's Hbar
    assert (hbar > cut).sum() == 1
    for coef in (0.0, 0.1):
        logps.grad = ent.grad = None
        out = gtpo_loss_from_logps(logps, ids, adv, entropy=ent, group_size=2,
                                   config=GTPOConfig(entropy_threshold=cut, entropy_coef=coef))
        out.loss.backward()
        assert float(out.metrics["filtered_frac"]) == 0.25 and logps.grad.abs().sum() > 0
        reached = ent.grad is not None and bool(ent.grad.abs().sum() > 0)
        assert reached == (coef != 0.0), (coef, ent.grad)
    with pytest.raises(ValueError, match="entropy .* is required"):
        gtpo_loss_from_logps(logps, ids, adv, group_size=2)  # the default gtpo preset filters on entropy
    out = gtpo_loss_from_logps(logps, ids, adv, config="grpo")  # no entropy needed
    assert torch.isfinite(out.loss)
    mask = torch.ones(B, T)
    mask[0, 3:] = 0
    garbage = logps.detach().clone()
    garbage[0, 3:] = float("nan")  # masked-out values are ignored
    lg = garbage.requires_grad_()
    out = gtpo_loss_from_logps(lg, ids, adv, mask, config="grpo")
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(lg.grad).all() and (lg.grad[0, 3:] == 0).all()


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("clip_min", [None, 0.5])
def test_rollout_is_weights_match_reference(mode, clip_min):
    g = torch.Generator().manual_seed(5)
    B, T = 4, 6
    old = -torch.rand(B, T, generator=g) * 3
    roll = old + torch.randn(B, T, generator=g) * 0.15
    roll[1, 2] = float("nan")
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[2, 4:] = False
    w = rollout_is_weights(old, roll, mask, mode, clip_min=clip_min, clip_max=1.8)
    rw = ref.rollout_is_weights(old.double(), roll.double(), mask, mode, clip_min=clip_min, clip_max=1.8)
    assert_value_close("weights", w, rw, 1e-6)
    assert ((w > 0) & (w < 1.8)).any()
    # bf16 log-probs: float32 weights of those values (exp in bf16 was 3.3e-3 off)
    ob, rb = old.bfloat16(), roll.bfloat16()
    w = rollout_is_weights(ob, rb, mask, mode, clip_min=clip_min, clip_max=1.8)
    rw = ref.rollout_is_weights(ob.double(), rb.double(), mask, mode, clip_min=clip_min, clip_max=1.8)
    assert w.dtype == torch.float32
    assert_value_close("weights (bf16 inputs)", w, rw, 1e-6)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("clip_min,clip_max", [(0.8, None), (None, None), (1.2, 1.2), (1.5, 1.2), (None, 1.3)])
def test_rollout_is_weights_bounds_as_trl(mode, clip_min, clip_max):
    """TRL's bounds (GRPOConfig's checks, mirrored by the reference): clip_max None is an open upper bound (mask
    below clip_min alone; refused before), both None refused for a truncate mode, clip_min < clip_max (equal
    bounds were taken before); the weights as the reference's, or the same refusal."""
    g = torch.Generator().manual_seed(7)
    old = -torch.rand(3, 5, generator=g) * 3
    roll = old + torch.randn(3, 5, generator=g) * 0.4
    try:
        rw = ref.rollout_is_weights(old.double(), roll.double(), None, mode, clip_min=clip_min, clip_max=clip_max)
    except ValueError as e:
        with pytest.raises(ValueError, match="clip_m"):
            rollout_is_weights(old, roll, None, mode, clip_min=clip_min, clip_max=clip_max)
        assert "clip_m" in str(e)
        return
    w = rollout_is_weights(old, roll, None, mode, clip_min=clip_min, clip_max=clip_max)
    assert_value_close("weights", w, rw, 1e-6)
    assert w.unique().numel() >= 2 and (w > 0).any()


@pytest.mark.parametrize("call,match", [
    (lambda: GTPOConfig(policy_loss="ppo2"), "policy_loss must be one of"),
    (lambda: GTPOConfig(importance_sampling_level="seq"), "importance_sampling_level must be one of"),
    (lambda: GTPOConfig(delta=1.0), "delta must be None or > 1"),
    (lambda: GTPOConfig(top_entropy_quantile=0.0), r"top_entropy_quantile must be in \(0, 1\]"),
    (lambda: GTPOConfig(top_entropy_quantile=1.5), r"top_entropy_quantile must be in \(0, 1\]"),
    (lambda: GTPOConfig.preset("cispo", importance_sampling_level="sequence"), "importance_sampling_level"),
    (lambda: GTPOConfig.preset("sapo", importance_sampling_level="sequence"), "importance_sampling_level"),
    (lambda: GTPOConfig.preset("vespo", importance_sampling_level="sequence"), "importance_sampling_level"),
    (lambda: GTPOConfig.preset("cispo", eps_high=0.0), "eps_high must be > 0"),
    (lambda: GTPOConfig(sapo_temperature_pos=0.0), "sapo_temperature_pos must be > 0"),
    (lambda: rollout_is_weights(torch.zeros(2, 3), torch.zeros(2, 3), None, "tis"), "mode must be one of"),
    (lambda: rollout_is_weights(torch.zeros(2, 3), torch.zeros(2, 4), None, "token_mask"), "rollout_logps must have"),
])
def test_family_refusals(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("w,match", [
    (torch.ones(4, 4), "rollout_is_weights must have completion_ids' shape"),
    (torch.ones(3), "rollout_is_weights must have"),
    (-torch.ones(4, 5), "rollout_is_weights must be >= 0"),
    (torch.full((4,), float("nan")), "rollout_is_weights must be >= 0"),
])
def test_rollout_weights_of_the_wrong_shape_or_sign_are_refused(w, match):
    x = torch.randn(4, 5, 7)
    ids = torch.randint(0, 7, (4, 5))
    with pytest.raises(ValueError, match=match):
        gtpo_loss(x, ids, torch.randn(4), config="grpo", rollout_is_weights=w)


def test_none_aggregation_with_sequence_ratios_is_refused():
    x = torch.randn(4, 5, 7)
    ids = torch.randint(0, 7, (4, 5))
    with pytest.raises(ValueError, match="loss_agg='none' with importance_sampling_level='sequence'"):
        gtpo_loss(x, ids, torch.randn(4), config=GTPOConfig.preset("gspo", loss_agg="none"))


@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
@pytest.mark.parametrize("rho,kept", [(0.7, 8), (0.2, 3), (0.9, 10)])
def test_top_entropy_quantile_at_a_whole_position(backend, rho, kept):
    """(n - 1)(1 - rho) a whole number (10 x 0.3 = 3 for rho = 0.7 over 11 tokens): the threshold is that token's
    entropy, which keeps its policy term, in the package (float32, as TRL's torch.quantile on a float32 copy) and
    in the reference, which reads rho as the decimal it is written as (its float64 1 - 0.7 = 0.30000000000000004
    put the position past 3 and masked that token out: 7 kept, the loss -0.63 against -0.72)."""
    g = torch.Generator().manual_seed(3)
    ent = torch.tensor([5e-4, 8e-4, 9e-4, 1e-3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0])[torch.randperm(11, generator=g)]
    logps = (-torch.rand(1, 11, generator=g) - 0.1).double()
    old = (logps + 0.05 * torch.randn(1, 11, generator=g, dtype=torch.float64)).float()
    ids, adv = torch.arange(11).reshape(1, 11), torch.tensor([1.0])
    lp = logps.float().requires_grad_()
    out = gtpo_loss_from_logps(lp, ids, adv, entropy=ent.reshape(1, 11), old_logps=old, backend=backend,
                               config=GTPOConfig.preset("grpo", top_entropy_quantile=rho))
    out.loss.backward()
    assert int((lp.grad != 0).sum()) == kept
    assert (lp.grad.reshape(-1)[ent >= ent.sort().values[11 - kept]] != 0).all()
    keep = gtpo_family.top_entropy_mask(ent.double().reshape(1, 11), torch.ones(1, 11, dtype=torch.bool), rho)
    assert int(keep.sum()) == kept
