"""Unchecked bad input gives NaN in every output it touches, for every preset (spec 6: validate=False never
turns an invalid value into a finite number): a non-finite old log-prob or a NaN logit at a counted token
makes the loss, that token's per-token loss and log-prob, and its row of the gradient NaN, on both
backends, on logits and on log-probs. (Before, verl's dppo_tv / dppo_kl put a finite 0 there: their trust
region's comparisons are False on NaN and their ratio is clamped, so an invalid token was simply dropped.)"""
import pytest
import torch

from gtpo_kernels import GTPOConfig, gtpo_loss, gtpo_loss_from_logps
from gtpo_kernels.core.config import PRESETS

NOT_READING_OLD = ("gpg",)  # its term is -A logp: the old log-probs are not an input it touches


def _config(name):
    return GTPOConfig.preset(name, dro_beta=0.1) if name == "dro" else GTPOConfig.preset(name)


def _inputs(seed=0, B=2, T=3, V=7):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T), generator=g), torch.tensor([1.0, -1.0]),
            -torch.rand(B, T, generator=g) - 1.0)


@pytest.mark.parametrize("backend", ["torch", "triton", "reference"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("bad", ["old-nan", "old-inf", "old-neg-inf", "logit-nan"])
def test_an_unchecked_bad_value_makes_its_token_and_the_loss_nan(preset, bad, backend):
    if bad.startswith("old") and preset in NOT_READING_OLD:
        pytest.skip("the term does not read old_logps")
    z, ids, adv, old = _inputs()
    if bad == "logit-nan":
        z[0, 0, 3] = float("nan")
    else:
        old[0, 0] = {"old-nan": float("nan"), "old-inf": float("inf"), "old-neg-inf": float("-inf")}[bad]
    x = z.clone().requires_grad_()
    out = gtpo_loss(x, ids, adv, group_size=1, old_logps=old, config=_config(preset), backend=backend,
                    validate=False)
    out.loss.backward()
    assert torch.isnan(out.loss) and torch.isnan(out.per_token_loss[0, 0]), (out.loss, out.per_token_loss)
    assert torch.isnan(x.grad[0, 0]).all(), x.grad[0, 0]
    if bad == "logit-nan":
        assert torch.isnan(out.logps[0, 0])
    with pytest.raises(ValueError):  # checked, the same input is refused
        gtpo_loss(z, ids, adv, group_size=1, old_logps=old, config=_config(preset), backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("preset", ["dppo_tv", "dppo_kl", "grpo", "cispo", "vanilla"])
def test_from_logps_a_non_finite_log_prob_makes_its_token_nan(preset, backend):
    """gtpo_loss_from_logps: a NaN or infinite log-prob, or an infinite old log-prob, unchecked: the loss,
    the token's per-token loss and its gradient NaN (the torch backend gave a -inf or +inf log-prob a finite
    per-token loss and a zero gradient); checked, the log-prob is refused by name on both backends."""
    _, ids, adv, old = _inputs(1)
    lp = -torch.rand(2, 3, generator=torch.Generator().manual_seed(2)) - 0.5
    for value in (float("nan"), float("-inf"), float("inf")):
        bad = lp.clone()
        bad[1, 2] = value
        with pytest.raises(ValueError, match=f"logps must be finite at counted positions; flat position 5 holds {value}"):
            gtpo_loss_from_logps(bad, ids, adv, group_size=1, old_logps=old, config=_config(preset), backend=backend)
    for where, value in (("logp", float("nan")), ("logp", float("-inf")), ("logp", float("inf")),
                         ("old", float("-inf"))):
        lp_, old_ = lp.clone(), old.clone()
        (lp_ if where == "logp" else old_)[1, 2] = value
        lp_.requires_grad_()
        out = gtpo_loss_from_logps(lp_, ids, adv, group_size=1, old_logps=old_, config=_config(preset),
                                   backend=backend, validate=False)
        out.loss.backward()
        assert torch.isnan(out.loss) and torch.isnan(out.per_token_loss[1, 2]) and torch.isnan(lp_.grad[1, 2]), \
            (where, out.loss, out.per_token_loss, lp_.grad)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bad", ["decreasing", "wrong-count", "sampled-missing"])
def test_an_unchecked_malformed_sampling_mask_makes_its_rows_of_the_gradient_nan(bad, backend):
    """gtpo_loss over recorded kept sets, unvalidated: a malformed layout (offsets decreasing, or one set
    too few: every token invalid) or a set without its sampled id makes each affected token's logp and its
    row of the logits' gradient NaN. An empty or malformed set holds no column to carry the NaN
    coefficient: on Triton every such row was exactly 0; now its sampled id's entry is NaN (both backends)."""
    g = torch.Generator().manual_seed(3)
    B, T, V = 3, 4, 9
    z = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    sets = [sorted({int(ids[i, t]), (int(ids[i, t]) + 1) % V, (int(ids[i, t]) + 3) % V}) for i in range(B) for t in range(T)]
    token_ids = torch.tensor([v for s_ in sets for v in s_])
    offsets = torch.tensor([0] + [len(s_) for s_ in sets]).cumsum(0)
    hit = torch.zeros(B * T, dtype=torch.bool)
    if bad == "decreasing":
        offsets[4] = offsets[7] + 1
        hit[:] = True
    elif bad == "wrong-count":
        offsets = offsets[:-1]
        hit[:] = True
    else:  # token 5's set without its sampled id
        k = int(offsets[5])
        token_ids[k:int(offsets[6])] = torch.tensor([v for v in range(V) if v != int(ids.reshape(-1)[5])][:3])
        hit[5] = True
    x = z.clone().requires_grad_()
    out = gtpo_loss(x, ids, torch.tensor([1.0, -0.5, 0.3]), group_size=3, config="grpo", sampling_mask=(token_ids, offsets),
                    backend=backend, validate=False)
    out.loss.backward()
    rows = torch.isnan(x.grad.reshape(B * T, V)).any(-1)
    assert torch.isnan(out.logps.reshape(-1)[hit]).all() and rows[hit].all(), (rows, hit)


@pytest.mark.parametrize("backend", ["torch", "triton", "reference"])
@pytest.mark.parametrize("bad", ["n_conf-half", "n_conf-inf", "lam-inf", "rollout-negative", "rollout-seq-nan"])
def test_an_unchecked_bad_weight_makes_the_loss_nan(bad, backend):
    """n_conf below 1 or not finite, lam not finite at a counted token, a negative or NaN rollout weight,
    unchecked: the loss NaN on the three backends (backend='reference' passed them to the oracle, which
    returned a finite loss: 0.43 for n_conf 0.5); checked, refused."""
    z, ids, adv, old = _inputs(4)
    kw = dict(old_logps=old, lam=torch.ones(2, 3), n_conf=torch.tensor([2.0, 1.0]))
    cfg = GTPOConfig.preset("gtpo-official", entropy_threshold=None) if bad.startswith(("n_conf", "lam")) else \
        GTPOConfig.preset("grpo")
    if bad == "n_conf-half":
        kw["n_conf"][0] = 0.5
    elif bad == "n_conf-inf":
        kw["n_conf"][1] = float("inf")
    elif bad == "lam-inf":
        kw["lam"][1, 1] = float("inf")
    elif bad == "rollout-negative":
        kw["rollout_is_weights"] = torch.full((2, 3), 0.9)
        kw["rollout_is_weights"][0, 2] = -1.0
    else:
        kw["rollout_is_weights"] = torch.tensor([[0.9], [float("nan")]])
    x = z.clone().requires_grad_()
    out = gtpo_loss(x, ids, adv, group_size=2, config=cfg, backend=backend, validate=False, **kw)
    out.loss.backward()
    assert torch.isnan(out.loss), (bad, backend, out.loss)
    with pytest.raises(ValueError):
        gtpo_loss(z, ids, adv, group_size=2, config=cfg, backend=backend, **kw)
