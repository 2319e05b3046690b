"""The verl plugin's modes (integrations/verl_modes.py) on the token advantages verl hands the loss, against
the float64 reference: for the token-level modes each token is its own completion there (the reference's batch
of N one-token completions), the per-token terms go through a stand-in of verl's agg_loss; geo_mean (its ratio
per completion, each token's sign in its clip) against reference/gtpo_verl.py's term on the token advantages;
value and gradient, on both backends (Triton's epilogue kernel, the eager surrogate), with verl's settings drawn
and rollout weights per token, per completion (B, 1) or none; and the launch count, flat in tokens.
Against verl's own functions: tests/test_verl_losses.py (verl's environment)."""
import dataclasses

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import gtpo_reference as ref
from gtpo_reference import gtpo_verl as gv
from conftest import TOL, assert_grad_close, assert_value_close, examples
from gtpo_kernels import gtpo_loss
from gtpo_kernels.integrations import verl_modes as vm
from test_verl_modes import margins

TOKEN_MODES = [m for m in vm.MODES if m != "geo_mean"]  # (geo_mean: its own test below, its ratio per completion)


class ActorConfig(dict):
    """verl's actor config as the modes read it: attributes, and .get for clip_ratio_c."""

    def __init__(self, **kw):
        super().__init__(kw)
        self.__dict__.update(kw)


def token_mean(loss_mat, loss_mask, loss_agg_mode, **info):
    """A stand-in of verl's agg_loss (token-mean): the per-token terms reach it as they are."""
    assert loss_agg_mode == "token-mean" and not info
    m = loss_mask.to(loss_mat.dtype)
    return (loss_mat * m).sum() / m.sum().clamp(min=1)


@st.composite
def actor_configs(draw, mode):
    u = lambda lo, hi: draw(st.floats(lo, hi))  # noqa: E731
    pl = dict(dro_beta=u(0.05, 1.0), clip_cov_ratio=draw(st.sampled_from([0.2, 0.5])), clip_cov_lb=u(-0.6, 0.1),
              kl_cov_ratio=draw(st.sampled_from([0.1, 0.4])), ppo_kl_coef=u(0.05, 1.0))
    pl["clip_cov_ub"] = pl["clip_cov_lb"] + u(0.2, 1.0)
    over = {} if mode not in ("vanilla", "dppo_tv", "dppo_kl") else dict(clip_ratio_c=u(1.05, 3.0))
    return ActorConfig(clip_ratio=u(0.05, 0.3), clip_ratio_low=draw(st.sampled_from([None, u(0.05, 0.3)])),
                       clip_ratio_high=u(0.05, 0.35), policy_loss=ActorConfig(**pl), **over)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("mode", TOKEN_MODES)
@settings(max_examples=examples(2))
@given(data=st.data(), B=st.integers(1, 3), T=st.integers(1, 5), rollout=st.sampled_from([None, "token", "completion"]),
       seed=st.integers(0, 10**6))
def test_token_modes_match_reference(backend, mode, data, B, T, rollout, seed):
    assume(check_mode(backend, mode, data.draw(actor_configs(mode)), B, T, rollout, seed, 0.3))


def test_clip_cov_candidates_leave_the_clipped_tokens_out():
    """clip_cov's candidates are the tokens its PPO clip does not stop, by the sign of each token's own
    advantage: large steps (most tokens clipped), most candidates chosen."""
    actor = ActorConfig(clip_ratio=0.1, clip_ratio_low=None, clip_ratio_high=0.1,
                        policy_loss=ActorConfig(clip_cov_ratio=0.5, clip_cov_lb=-5.0, clip_cov_ub=5.0))
    assert sum(check_mode("triton", "clip_cov", actor, 3, 5, None, seed, 1.0) for seed in range(6)) >= 3


def check_mode(backend, mode, actor, B, T, rollout, seed, step):
    """mode_loss on `backend` = the reference on N one-token completions, value and gradient (old log-probs
    `step` away in log space); False (nothing checked) for inputs at a threshold or without a gradient."""
    g = torch.Generator().manual_seed(seed)
    V, N = 7, B * T
    cfg = vm.mode_config(mode, actor)
    x = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) < 0.8).long()
    if not mask.any():
        return False
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    rlp = torch.log_softmax(x, -1).gather(-1, ids[..., None])[..., 0]
    old = (rlp + step * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    w = None if rollout is None else torch.rand(B, T if rollout == "token" else 1, generator=g,
                                                 dtype=torch.float64) * 1.5 + 0.25
    counted = mask.bool()
    if margins(cfg, rlp.reshape(N, 1), old.reshape(N, 1), adv.reshape(N), counted.reshape(N, 1)) <= 1e-4:
        return False

    # the reference: N one-token completions, each with its token's advantage
    xr = x.reshape(N, 1, V).clone().requires_grad_()
    fields = dict(dataclasses.asdict(cfg), loss_agg="none")
    torch.manual_seed(seed)  # clip_cov draws from the default generator
    r = ref.gtpo_loss(xr, ids.reshape(N, 1), adv.reshape(N), counted.reshape(N, 1), old_logps=old.reshape(N, 1),
                      rollout_is_weights=None if w is None else w.expand(B, T).reshape(N, 1), **fields)
    want = token_mean(r["loss"].reshape(B, T), mask, "token-mean")  # loss_agg="none": per token
    want.backward()
    if not xr.grad.abs().max() > 0:  # (clip_cov may choose every counted token)
        return False

    dt = torch.float32 if backend == "triton" else torch.float64  # (the epilogue kernel takes 16/32-bit log-probs)
    xx = x.to(dt).requires_grad_()
    lp = torch.log_softmax(xx, -1).gather(-1, ids[..., None])[..., 0]
    torch.manual_seed(seed)
    loss, metrics = vm.mode_loss(mode, old.to(dt), lp, adv.to(dt), mask, "token-mean", actor,
                                 None if w is None else w.to(dt), token_mean, backend=backend)
    loss.backward()
    tol = TOL[dt]
    assert_value_close("loss", loss.detach(), want.detach(), tol["loss"])
    assert_grad_close("grad logits", xx.grad, xr.grad.reshape(B, T, V), tol["grad"])
    assert set(metrics) == set(LOGGED[mode]) and all(isinstance(v, float) for v in metrics.values()), metrics
    return True


# what verl 0.9.1's modes log
LOGGED = {m: ("actor/ppo_kl", "actor/pg_clipfrac", "actor/pg_clipfrac_lower")
          for m in ("vanilla", "dppo_tv", "dppo_kl", "cispo", "geo_mean")}
LOGGED.update(gpg=(), dro=("actor/ppo_kl",), kl_cov=("actor/ppo_kl",), clip_cov=("actor/ppo_kl", "actor/pg_clipfrac"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # (16-bit log-probs: both in float32)
@pytest.mark.parametrize("mode", sorted(LOGGED))
def test_the_metrics_kernel_equals_its_torch_twin(mode, dtype):
    """verl's metrics of each mode on Triton (one launch: kernels/verl_metrics_triton.py) equal the torch
    statement (verl_modes.mode_metrics, checked against verl's own functions in test_verl_losses) on float32
    tokens past one block, a float mask with zeros, ratios beyond the clips and the dual clip, and
    probabilities near 1 (dppo's divergences)."""
    g = torch.Generator().manual_seed(len(mode))
    B, T = 5, 301
    lp = -torch.rand(B, T, generator=g) * 3
    lp[0, :40] = -torch.rand(40, generator=g) * 1e-3
    old = lp + torch.randn(B, T, generator=g) * 0.6
    old[1, :5] = lp[1, :5] - 25.0  # log r beyond 20: clamped where the mode clamps
    adv = torch.randn(B, T, generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    actor = ActorConfig(clip_ratio=0.2, clip_ratio_low=0.15, clip_ratio_high=0.28, clip_ratio_c=2.0,
                        policy_loss=ActorConfig(dro_beta=0.1, clip_cov_ratio=0.2, clip_cov_lb=1.0, clip_cov_ub=5.0,
                                                kl_cov_ratio=0.2, ppo_kl_coef=1.0))
    cfg = vm.mode_config(mode, actor)
    frac = torch.tensor(0.125)
    lp, old, adv = lp.to(dtype), old.to(dtype), adv.to(dtype)
    got = vm.mode_metrics(mode, cfg, lp, old, adv, mask, frac, backend="triton")
    want = vm.mode_metrics(mode, cfg, lp, old, adv, mask, frac, backend="torch")
    assert set(got) == set(want) == set(LOGGED[mode])
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), (k, got, want)
    if mode in ("vanilla", "dppo_tv", "cispo", "geo_mean"):
        assert 0 < want["actor/pg_clipfrac"] < 1, want


def test_token_modes_launch_count_is_flat_in_tokens():
    """On Triton each mode is gtpo_loss_from_logps' epilogue path: the same count at 2 x 3 and 6 x 5 tokens,
    the loss within 8 launches of the package's per forward + backward (spec 8: any verl mode), 3 of them Triton,
    and one more for the metrics verl's mode logs (clip_cov: 9 in all, with the caller's seed and sum)
    (clip_cov: its choice's key kernel and sort, and its draws, too); verl's agg_loss stands as a plain sum
    (its launch and autograd's seed of the loss are not the package's), and geo_mean aggregates in the
    kernel (the stand-in is not called)."""
    from bench.launches import counting
    calls = []

    def plain_sum(loss_mat, loss_mask, loss_agg_mode, **info):
        calls.append(1)
        return loss_mat.sum()

    def count(mode, B, T):
        g = torch.Generator().manual_seed(B)
        lp = (-torch.rand(B, T, generator=g) * 2).requires_grad_()
        old, adv = lp.detach() + 0.1 * torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
        mask = (torch.rand(B, T, generator=g) > 0.2).long()
        actor = ActorConfig(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=0.28,
                            policy_loss=ActorConfig(dro_beta=0.1, clip_cov_ratio=0.2, clip_cov_lb=1.0, clip_cov_ub=5.0,
                                                    kl_cov_ratio=0.2, ppo_kl_coef=1.0))
        call = lambda: vm.mode_loss(mode, old, lp, adv, mask, "token-mean", actor, None, plain_sum,  # noqa: E731
                                    backend="triton")[0].backward()
        call()
        calls.clear()
        lp.grad = None  # (else autograd's accumulation into the leaf's gradient is counted: one add)
        with counting() as c:
            call()
        return c.launches - 1 - len(calls), c.host_reads, c.triton  # (-1: the seed; the stand-in's sum)

    for mode in ("vanilla", "clip_cov", "geo_mean"):
        small, large = count(mode, 2, 3), count(mode, 6, 5)
        assert small == large, (mode, small, large)
        # as counted at 2 x 3 tokens: the three kernels; clip_cov: its draws, key kernel and sort too (spec 8's
        # bound: 8, with the caller's seed and aggregation)
        # (one more, Triton, each: verl's metrics, kernels/verl_metrics_triton.py)
        assert small == {"vanilla": (4, 1, 4), "clip_cov": (7, 1, 5), "geo_mean": (4, 1, 4)}[mode], (mode, small)


def test_token_ppo_validates_and_names_the_argument():
    """SkyRL's and OpenRLHF's shared PPO term validates: a non-finite counted token advantage raises, naming
    it; one at a token that does not count is ignored; any nonzero mask value counts."""
    from gtpo_kernels.integrations.token_ppo import token_config, token_ppo_losses
    g = torch.Generator().manual_seed(3)
    lp = -torch.rand(2, 4, generator=g, dtype=torch.float64)
    old, adv = lp + 0.1 * torch.randn(2, 4, generator=g, dtype=torch.float64), torch.randn(2, 4, generator=g,
                                                                                          dtype=torch.float64)
    mask = torch.ones(2, 4)
    mask[1, 3] = 0
    cfg = token_config(0.2, 0.28)
    adv[1, 3] = float("nan")
    out = token_ppo_losses(lp, old, adv, mask, cfg)
    assert torch.isfinite(out).all() and out[1, 3] == 0
    assert torch.equal(token_ppo_losses(lp, old, adv, mask * 2.5, cfg), out)  # nonzero: the token counts
    adv[0, 1] = float("inf")
    with pytest.raises(ValueError, match="token_advantages must be finite at counted positions; flat position 1"):
        token_ppo_losses(lp, old, adv, mask, cfg)
    # with SkyRL's and OpenRLHF's log-ratio clamp, a log-prob of +-inf at a counted token is refused (the clamp
    # made it a finite ratio: a finite loss of 3e8); at a token that does not count it is ignored
    adv[0, 1] = 1.0
    for v in (float("inf"), float("-inf")):
        bad = lp.clone()
        bad[0, 2] = v
        with pytest.raises(ValueError, match="logps must be finite at counted positions; flat position 2"):
            token_ppo_losses(bad, old, adv, mask, cfg, log_ratio_clip=20.0)
        bad = lp.clone()
        bad[1, 3] = v
        assert torch.isfinite(token_ppo_losses(bad, old, adv, mask, cfg, log_ratio_clip=20.0)).all()


def geo_mean_reference(x, ids, old, adv, mask, actor, w):
    """verl's geo_mean on token advantages in float64 (reference/gtpo_verl.py: each token's sign in the clip,
    the completion's ratio the exp of the mean of y), as mode_loss aggregates it: the mean over the
    completions of each one's mean of -A R over its counted tokens (verl's -mean_t(A) R, averaged)."""
    lp = torch.log_softmax(x, -1).gather(-1, ids[..., None])[..., 0]
    m = mask.bool()
    lo = actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low
    pg, _ = gv.policy_term("geo-mean", lp, old, adv, m, w, eps_low=lo, eps_high=actor.clip_ratio_high, clip=True,
                           delta=None, dual_clip_c=None, dro_beta=None, clip_cov_ratio=None, clip_cov_lb=None,
                           clip_cov_ub=None, kl_cov_ratio=None, ppo_kl_coef=None, generator=None)
    n = m.sum(1).clamp(min=1)
    return (torch.where(m, pg, 0.0).sum(1) / n).mean()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@settings(max_examples=examples(6))
@given(B=st.integers(1, 3), T=st.integers(1, 6), rollout=st.sampled_from([None, "token", "completion"]),
       low=st.sampled_from([None, 0.1]), zero_adv=st.booleans(), seed=st.integers(0, 10**6))
def test_geo_mean_on_token_advantages_matches_reference(backend, B, T, rollout, low, zero_adv, seed):
    """geo_mean (verl's GMPO) on token advantages: the sign of each token's advantage in the clip (some
    advantages 0: their tokens neither move the ratio nor count), the ratio over each completion; on Triton
    the epilogue kernel's TOK_ADV path (no eager surrogate), value and gradient against the float64
    reference; steps large enough that the clip stops some tokens."""
    from gtpo_kernels.pipeline.token_terms import in_kernel
    actor = ActorConfig(clip_ratio=0.2, clip_ratio_low=low, clip_ratio_high=0.25, policy_loss=None)
    assert in_kernel(vm.mode_config("geo_mean", actor))
    g = torch.Generator().manual_seed(seed)
    V = 6
    x = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) < 0.8).long()
    rlp = torch.log_softmax(x, -1).gather(-1, ids[..., None])[..., 0]
    old = rlp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    if zero_adv:
        adv[torch.rand(B, T, generator=g) < 0.3] = 0.0
    w = None if rollout is None else torch.rand(B, T if rollout == "token" else 1, generator=g,
                                                 dtype=torch.float64) * 1.5 + 0.25
    xr = x.clone().requires_grad_()
    want = geo_mean_reference(xr, ids, old, adv, mask, actor, w)
    want.backward()
    assume(xr.grad.abs().max() > 0)
    dt = torch.float32 if backend == "triton" else torch.float64
    xx = x.to(dt).requires_grad_()
    lp = torch.log_softmax(xx, -1).gather(-1, ids[..., None])[..., 0]
    loss, metrics = vm.mode_loss("geo_mean", old.to(dt), lp, adv.to(dt), mask, "token-mean", actor,
                                 None if w is None else w.to(dt), token_mean, backend=backend)
    loss.backward()
    assert_value_close("loss", loss.detach(), want.detach(), TOL[dt]["loss"])
    assert_grad_close("grad logits", xx.grad, xr.grad, TOL[dt]["grad"])
    assert 0.0 <= metrics["actor/pg_clipfrac"] <= 1.0


def test_geo_mean_on_token_advantages_clips_and_runs_in_the_kernel():
    """The drawn test's batches are not vacuous: on a fixed batch the clip stops some counted tokens (not
    all), and on Triton the loss runs in the epilogue kernel (three Triton launches, no eager surrogate)."""
    from bench.launches import counting
    g = torch.Generator().manual_seed(11)
    B, T = 3, 5
    lp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 2).requires_grad_()
    old = lp.detach() + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.long)
    actor = ActorConfig(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=0.25, policy_loss=None)
    _, metrics = vm.mode_loss("geo_mean", old, lp, adv, mask, "token-mean", actor, None, token_mean, backend="torch")
    assert 0.0 < metrics["actor/pg_clipfrac"] < 1.0
    x, old32, adv32 = lp.detach().float().requires_grad_(), old.float(), adv.float()
    with counting() as c:
        vm.mode_loss("geo_mean", old32, x, adv32, mask, "token-mean", actor, None, token_mean,
                     backend="triton")[0].backward()
    assert c.triton == 4 and c.launches <= 5, (c.launches, c.triton)  # the three kernels, verl's metrics, the seed
    # what reads a completion's advantage stays on the eager surrogate: the sequence level, the off-policy mask
    from gtpo_kernels.pipeline.token_terms import in_kernel
    cfg = vm.mode_config("vanilla", actor)
    assert in_kernel(cfg) and not in_kernel(cfg.replace(importance_sampling_level="sequence"))
    assert not in_kernel(cfg.replace(off_policy_mask_threshold=0.1))
    assert not in_kernel(cfg.replace(policy_loss="vespo", dual_clip_c=None))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_token_terms_refuse_misshapen_inputs_and_nan_invalid_ones(backend):
    """Token advantages (and old log-probs, the mask) must be (B, T) like the log-probs: refused by name (a
    (B, 1) tensor was read past its end); a log-prob of -inf at a counted token gives a NaN loss (never a
    finite one); an empty micro-batch gives an empty loss."""
    actor = ActorConfig(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=0.28, policy_loss=None)
    g = torch.Generator().manual_seed(1)
    lp = (-torch.rand(2, 4, generator=g)).requires_grad_()
    old, adv, mask = lp.detach() + 0.1, torch.randn(2, 4, generator=g), torch.ones(2, 4)
    with pytest.raises(ValueError, match=r"token_advantages must be a \(B, T\) tensor like logps"):
        vm.mode_loss("vanilla", old, lp, adv[:, :1], mask, "token-mean", actor, None, token_mean, backend=backend)
    with torch.no_grad():
        lp[0, 1] = float("-inf")
    for mode in ("vanilla", "clip_cov", "gpg", "geo_mean"):
        loss, _ = vm.mode_loss(mode, old, lp, adv, mask, "token-mean", actor, None, token_mean, backend=backend)
        assert torch.isnan(loss), (mode, loss)
    # geo_mean: a NaN token advantage makes its completion's ratio NaN (its sign is NaN), so the loss
    lp2, adv2 = lp.detach().clamp(min=-5.0).requires_grad_(), adv.clone()
    adv2[1, 2] = float("nan")
    loss, _ = vm.mode_loss("geo_mean", old, lp2, adv2, mask, "token-mean", actor, None, token_mean, backend=backend)
    assert torch.isnan(loss), loss
    loss.backward()  # every token of that completion moves its NaN ratio: NaN gradient; the other one's finite
    assert torch.isnan(lp2.grad[1]).all() and torch.isfinite(lp2.grad[0]).all(), lp2.grad
    empty = torch.zeros(0, 4)
    loss, _ = vm.mode_loss("vanilla", empty, empty.requires_grad_(), empty, empty, "token-mean", actor, None,
                           token_mean, backend=backend)
    assert loss == 0


AOT = """
import torch
from bench.aot.compiler import _compile_ahead
from gtpo_kernels.kernels import verl_metrics_triton as K
f32 = torch.float32
for arch in (90, 80, 100):
    for mode in range(8):
        assert _compile_ahead(K._verl_metrics_kernel, arch, dict(logp_ptr=f32, old_ptr=f32, adv_ptr=f32,
                              mask_ptr=torch.bool, extra_ptr=f32, out_ptr=f32), f32,
                              dict(N=1 << 20, lo=0.2, hi=0.28, c=3.0),
                              dict(MODE=mode, HAS_EXTRA=mode == 5, BLOCK=1024, num_warps=4)).asm.get("ptx")
print("compiled")
"""


def test_the_metrics_kernel_compiles_for_the_gpus():
    """_verl_metrics_kernel, every mode, compiled ahead of time for sm_90, sm_80 and sm_100."""
    from conftest import compiled_ahead
    compiled_ahead(AOT)


@pytest.mark.parametrize("mode", ["gpg", "dro", "kl_cov"])
def test_modes_that_never_read_clip_ratio_take_any(mode):
    """gpg, dro and kl_cov: verl's functions never read clip_ratio, so a value outside PPO's [0, 1) (verl's dual
    clip takes clip_ratio_high = 2.0) is not refused there (it was: 'eps_high must be in [0, 1)'); the modes
    that read it still check it."""
    pl = ActorConfig(dro_beta=0.1)  # (dro's own setting, which verl requires too)
    actor = ActorConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=2.0, clip_ratio_c=3.0, policy_loss=pl)
    cfg = vm.mode_config(mode, actor)
    assert cfg.policy_loss == vm.MODES[mode]
    with pytest.raises(ValueError, match="clip_ratio_high"):
        vm.mode_config("vanilla", actor)


@pytest.mark.parametrize("mode,low,high", [("dppo_tv", 1.0, 0.2), ("dppo_kl", 0.2, 1.5)])
def test_dppo_takes_a_threshold_of_one_or_more(mode, low, high):
    """dppo's clip_ratio_low / high are a divergence's thresholds, not a ratio's bounds: verl runs 1.0 (TV: no
    constraint) or 1.5 (KL); the package refused them ('must be in [0, 1)'). The loss and its gradient on both
    backends against the float64 reference of the same thresholds."""
    actor = ActorConfig(clip_ratio=0.2, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=3.0, policy_loss=None)
    cfg = vm.mode_config(mode, actor)
    assert (cfg.eps_low, cfg.eps_high) == (low, high)
    g = torch.Generator().manual_seed(5)
    x, ids = torch.randn(2, 4, 9, generator=g) * 2, torch.randint(0, 9, (2, 4), generator=g)
    lp, _ = ref.token_logprobs(x.double(), ids, 1.0)
    old = (lp + torch.randn(2, 4, generator=g, dtype=torch.float64)).float()
    adv = torch.tensor([1.0, -0.7])
    full = dataclasses.replace(cfg, loss_agg="token-mean")
    xr = x.double().requires_grad_()
    want = ref.gtpo_loss(xr, ids, adv, old_logps=old, **{k: v for k, v in vars(full).items() if k != "generator"})
    want["loss"].backward()
    assert xr.grad.abs().sum() > 0
    for backend in ("triton", "torch"):
        z = x.clone().requires_grad_()
        out = gtpo_loss(z, ids, adv, old_logps=old, config=full, backend=backend)
        out.loss.backward()
        assert_value_close(f"{backend} loss", out.loss, want["loss"], TOL[torch.float32]["loss"])
        assert_grad_close(f"{backend} grad", z.grad, xr.grad, TOL[torch.float32]["grad"])
