"""The GRPO family of spec 9 in the float64 reference: hand-computed examples of every piece (PPO's clip and
delta, CISPO, SAPO, VESPO, the sequence-level ratio, the bias-corrected KL, the off-policy mask, the top-entropy
quantile, rollout importance weights) and the refusals. Equality with TRL's own code:
tests/test_reference_family.py."""
import math

import pytest
import torch

import gtpo_reference as ref
from test_reference_family import F64, GTPO_OFF, close


def logits_for(logps):
    """(B, T, 2) logits whose token 0 has exactly the log-prob logps[b, t] (ids are all 0)."""
    lp = torch.as_tensor(logps, dtype=F64)
    return torch.stack([lp, torch.log1p(-lp.exp())], dim=-1)


def run(logps, A, mask=None, **kw):
    """Reference on logits_for(logps), GTPO parts off unless overridden; returns (out, grad of loss)."""
    z = logits_for(logps).requires_grad_()
    ids = torch.zeros(z.shape[:2], dtype=torch.long)
    out = ref.gtpo_loss(z, ids, torch.tensor(A, dtype=F64), mask, **{**GTPO_OFF, **kw})
    out["loss"].sum().backward()
    return out, z.grad


# ------------------------------------------------------------------------ hand examples, per piece

def test_ppo_delta_two_sided_clip():
    lp = torch.tensor([[-0.5], [-0.5]], dtype=F64)
    old = lp - math.log(3.0)                                  # r = 3 for both
    out, g = run(lp, [1.0, -1.0], old_logps=old, delta=2.0, loss_agg="none")
    close(out["per_token_loss"], [[-1.2], [2.0]])             # -min(min(3,2) A, 1.2 A)
    assert torch.all(g == 0) and out["metrics"]["clip_frac"] == 1.0   # clip (A>0), delta (A<0)
    out, g = run(lp, [1.0, -1.0], old_logps=old, loss_agg="none")
    close(out["per_token_loss"], [[-1.2], [3.0]])
    assert out["metrics"]["clip_frac"] == 0.5 and g[1].abs().sum() > 0
    out, _ = run(lp, [-1.0, -1.0], old_logps=old, delta=2.0, clip=False, loss_agg="none")
    close(out["per_token_loss"], [[2.0], [2.0]])              # clip=False: -min(r, delta) A


def test_cispo_term_and_gradient():
    lp = torch.tensor([[-0.5]], dtype=F64)
    out, g = run(lp, [2.0], old_logps=lp - math.log(7.0), policy_loss="cispo", eps_high=5.0)
    close(out["loss"], -5.0 * 2.0 * -0.5)                     # -sg(min(r, 5)) A logp
    p = math.exp(-0.5)
    close(g[0, 0], [-10.0 * (1 - p), 10.0 * (1 - p)])         # d/dlogp = -10, dlogp/dz = onehot - p


def test_sapo_term():
    lp = torch.tensor([[-0.5], [-0.5]], dtype=F64)
    out, _ = run(lp, [1.0, -1.0], old_logps=lp - math.log(1.5), policy_loss="sapo", loss_agg="none")
    sig = lambda x: 1 / (1 + math.exp(-x))
    close(out["per_token_loss"], [[-4.0 * sig(0.5)], [4.0 / 1.05 * sig(1.05 * 0.5)]])


def test_vespo_phi_and_rollout_weights_folded_in():
    lp = torch.tensor([[-0.5, -1.0], [-0.5, -1.0]], dtype=F64)
    old = lp - torch.tensor([[0.1, 0.2]], dtype=F64)          # L = 0.3 for both
    phi_pos = math.exp(3.0 + 2.0 * 0.3 - 3.0 * math.exp(0.3))      # (k, lambda) = (2, 3) for A >= 0
    phi_neg = math.exp(2.0 + 3.0 * 0.3 - 2.0 * math.exp(0.3))      # (3, 2) for A < 0
    want = torch.stack([-phi_pos * lp[0], phi_neg * lp[1]])
    out, _ = run(lp, [1.0, -1.0], old_logps=old, policy_loss="vespo", loss_agg="none")
    close(out["per_token_loss"], want)
    # per-token weights 2 and 1/2: log sum 0, phi unchanged, and not multiplied again
    w = torch.tensor([[2.0, 0.5], [2.0, 0.5]], dtype=F64)
    out, _ = run(lp, [1.0, -1.0], old_logps=old, policy_loss="vespo", loss_agg="none", rollout_is_weights=w)
    close(out["per_token_loss"], want)
    # a per-completion weight enters log w once
    out, _ = run(lp[:1], [1.0], old_logps=old[:1], policy_loss="vespo", loss_agg="none",
                 rollout_is_weights=torch.tensor([2.0]))
    L = 0.3 + math.log(2.0)
    close(out["per_token_loss"], -math.exp(3.0 + 2.0 * L - 3.0 * math.exp(L)) * lp[:1])


def test_sequence_level_ratio_and_gradient_through_the_mean():
    lp = torch.tensor([[-0.5, -1.0, -2.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]])
    old = lp - torch.tensor([[0.05, 0.15, 5.0]], dtype=F64)   # the masked-out 5.0 is ignored
    out, g = run(lp, [1.0], mask, old_logps=old, importance_sampling_level="sequence")
    r = math.exp(0.1)                                          # exp(mean of the counted log-ratios)
    close(out["loss"], -r)
    p = lp.exp()[0]
    dlogp = torch.tensor([-r / 2, -r / 2, 0.0], dtype=F64)     # d(-r)/dlogp_t = -r m_t / n
    close(g[0], torch.stack([dlogp * (1 - p), -dlogp * (1 - p)], dim=-1))
    # token level differs: per-token ratios exp(0.05), exp(0.15)
    out_tok, _ = run(lp, [1.0], mask, old_logps=old)
    close(out_tok["loss"], -(math.exp(0.05) + math.exp(0.15)) / 2)


def test_sequence_level_gradient_matches_finite_difference():
    torch.manual_seed(3)
    z = torch.randn(2, 4, 5, dtype=F64)
    ids, mask = torch.randint(0, 5, (2, 4)), torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    old = torch.log_softmax(z, -1).gather(-1, ids[..., None])[..., 0] + 0.1 * torch.randn(2, 4, dtype=F64)
    kw = dict(GTPO_OFF, old_logps=old, importance_sampling_level="sequence", eps_low=0.5, eps_high=0.5,
              beta=0.1, ref_logps=old - 0.2, use_bias_correction_kl=True)
    A = torch.tensor([1.0, -0.5], dtype=F64)
    zz = z.clone().requires_grad_()
    ref.gtpo_loss(zz, ids, A, mask, **kw)["loss"].backward()
    f = lambda x: ref.gtpo_loss(x, ids, A, mask, **kw)["loss"].item()
    fd = torch.zeros_like(z)
    for idx in torch.cartesian_prod(*(torch.arange(s) for s in z.shape)).tolist():
        e = torch.zeros_like(z)
        e[tuple(idx)] = 1e-6
        fd[tuple(idx)] = (f(z + e) - f(z - e)) / 2e-6
    close(zz.grad, fd, tol=1e-7)


def test_bias_corrected_kl():
    lp = torch.tensor([[-0.5]], dtype=F64)
    r, d, beta = 1.1, 0.3, 0.5
    k3 = math.exp(d) - d - 1
    kw = dict(old_logps=lp - math.log(r), beta=beta, ref_logps=lp + d)
    out, g = run(lp, [1.0], **kw, use_bias_correction_kl=True)
    close(out["loss"], -r + beta * r * k3)
    dtok = -r + beta * (r * k3 + r * (1 - math.exp(d)))      # d/dlogp of -r A + beta r k3
    close(g[0, 0, 0], dtok * (1 - math.exp(-0.5)))
    out, _ = run(lp, [1.0], **kw)
    close(out["loss"], -r + beta * k3)


def test_off_policy_mask():
    lp = torch.full((3, 2), -1.0, dtype=F64)
    roll = lp + torch.tensor([[0.5, 0.5], [0.15, float("nan")], [0.5, 0.5]], dtype=F64)
    kw = dict(old_logps=lp, beta=0.5, ref_logps=lp + 0.3, off_policy_mask_threshold=0.1, loss_agg="none")
    out, _ = run(lp, [-1.0, -1.0, 1.0], rollout_logps=roll, **kw)
    kl = 0.5 * (math.exp(0.3) - 1.3)
    # row 0: A < 0 and mean KL 0.5 > 0.1: policy term dropped, KL kept; row 1: the NaN counts as 0 and
    # stays in the denominator -> mean 0.075 <= 0.1, kept (dropped from the denominator it would be
    # 0.15 > 0.1 and the row masked); row 2: A >= 0 kept
    close(out["per_token_loss"], [[kl, kl], [1 + kl, 1 + kl], [-1 + kl, -1 + kl]])
    # without rollout_logps the mask reads old_logps (here = logp: every completion kept)
    out, _ = run(lp, [-1.0, -1.0, 1.0], **kw)
    close(out["per_token_loss"][0], [1 + kl, 1 + kl])


def test_top_entropy_quantile_masks_policy_term_and_entropy_bonus():
    p = torch.tensor([[0.5, 0.4, 0.3, 0.2, 0.1]], dtype=F64)
    H = -(p * p.log() + (1 - p) * (1 - p).log())              # decreasing entropies
    kw = dict(entropy_coef=0.1, loss_agg="none")
    out, _ = run(p.log(), [1.0], top_entropy_quantile=0.4, **kw)
    # the 0.6 quantile sits between the 3rd and 4th smallest: the two largest entropies are kept
    keep = torch.tensor([[1.0, 1.0, 0, 0, 0]], dtype=F64)
    close(out["per_token_loss"], keep * (-1.0 - 0.1 * H))
    out, _ = run(p.log(), [1.0], top_entropy_quantile=1.0, **kw)
    close(out["per_token_loss"], -1.0 - 0.1 * H)


def test_rollout_weights_multiply_the_policy_term_only():
    lp = torch.tensor([[-0.5, -1.0]], dtype=F64)
    kw = dict(beta=0.5, ref_logps=lp + 0.3, loss_agg="none")
    kl = 0.5 * (math.exp(0.3) - 1.3)
    out, _ = run(lp, [1.0], rollout_is_weights=torch.tensor([[2.0, 0.5]]), **kw)
    close(out["per_token_loss"], [[-2.0 + kl, -0.5 + kl]])
    for w in (torch.tensor([3.0]), torch.tensor([[3.0]])):
        out, _ = run(lp, [1.0], rollout_is_weights=w, **kw)
        close(out["per_token_loss"], [[-3.0 + kl, -3.0 + kl]])


def test_gtpo_parts_compose_with_other_policy_terms():
    lp = torch.tensor([[-0.5, -1.0]], dtype=F64)
    lam = torch.tensor([[2.0, 0.0]], dtype=F64)
    out, _ = run(lp, [1.0], lam=lam, n_conf=torch.ones(1), old_logps=lp - math.log(7.0),
                 policy_loss="cispo", eps_high=5.0, entropy_penalty=0.1, loss_agg="none")
    Ahat = 1.0 - 0.1 * out["seq_entropy"][0]                  # shaping acts on Ahat
    close(out["per_token_loss"], lam * (-5.0 * Ahat * lp))    # lambda multiplies the cispo term


def test_rollout_is_weights_modes():
    ln = math.log
    old = torch.zeros(2, 3, dtype=F64)
    roll = -torch.tensor([[ln(2), ln(4), float("nan")], [ln(0.25), 0.0, float("-inf")]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])               # the masked-out -inf is ignored
    W = lambda mode, **kw: ref.rollout_is_weights(old, roll, mask, mode, **kw)
    close(W("token_truncate"), [[2, 3, 1], [0.25, 1, 1]])     # NaN difference -> ratio 1
    close(W("token_truncate", clip_min=0.5), [[2, 3, 1], [0.5, 1, 1]])
    close(W("token_mask"), [[2, 0, 1], [0.25, 1, 1]])
    close(W("token_mask", clip_min=0.5), [[2, 0, 1], [0, 1, 1]])
    close(W("sequence_truncate"), [[3], [0.25]])              # exp(ln 8) -> 3; one per completion
    close(W("sequence_mask"), [[0], [0.25]])
    close(W("sequence_mask", clip_min=0.5, clip_max=10.0), [[8], [0]])
    assert W("token_mask").dtype == F64 and W("sequence_mask").shape == (2, 1)


def test_refusals():
    lp = torch.tensor([[-0.5]], dtype=F64)
    bad = [(dict(policy_loss="reinforce"), "policy_loss"), (dict(importance_sampling_level="seq"),
           "importance_sampling_level"), (dict(delta=1.0), "delta"), (dict(top_entropy_quantile=0.0),
           "top_entropy_quantile"), (dict(top_entropy_quantile=1.5), "top_entropy_quantile"),
           (dict(rollout_is_weights=torch.ones(1, 2)), "rollout_is_weights"),
           (dict(rollout_is_weights=-torch.ones(1, 1)), "rollout_is_weights"),
           (dict(rollout_logps=torch.ones(2, 1)), "rollout_logps")]
    bad += [(dict(policy_loss=p, importance_sampling_level="sequence"), "importance_sampling_level")
            for p in ("cispo", "sapo", "vespo")]
    for kw, name in bad:
        with pytest.raises(ValueError, match=name):
            run(lp, [1.0], **kw)
    with pytest.raises(ValueError, match="mode"):
        ref.rollout_is_weights(lp, lp, None, "token_clip")
    with pytest.raises(ValueError, match="clip_min"):
        ref.rollout_is_weights(lp, lp, None, "token_truncate", clip_min=None, clip_max=None)
