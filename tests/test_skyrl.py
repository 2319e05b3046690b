"""GTPO through SkyRL's own code (skipped without SkyRL; CI installs it in an environment of its own):
the policy loss `gtpo` dispatched by SkyRL's PolicyLossRegistry equals SkyRL's stock `regular` loss
(float64, with and without SkyRL's off-policy correction); GTPOTrainer's advantage step on a batch built
by SkyRL's own preprocessing (right-aligned responses, uids) gives the float64 reference's conflict
weights; and the chain (SkyRL batch -> GTPO advantages -> SkyRL's loss reduction -> registered loss)
equals the package's GTPO loss on the same completions."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("skyrl.backends.skyrl_train.utils.ppo_utils")

import gtpo_reference as ref  # noqa: E402
from gtpo_kernels import GTPOConfig, gtpo_loss_from_logps  # noqa: E402
from gtpo_kernels.integrations import skyrl as gs  # noqa: E402
from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch  # noqa: E402
from skyrl.backends.skyrl_train.utils import ppo_utils  # noqa: E402
from skyrl.train.config import AlgorithmConfig, SkyRLTrainConfig  # noqa: E402
from skyrl.train.dataset.preprocess import convert_prompts_responses_to_batch_tensors  # noqa: E402
from skyrl.train.trainer import RayPPOTrainer  # noqa: E402


def _algorithm(loss_type, **kw):
    cfg = AlgorithmConfig()
    cfg.policy_loss_type = loss_type
    cfg.eps_clip_low, cfg.eps_clip_high = 0.2, 0.28
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def _inputs(g, B=5, T=9, dtype=torch.float64):
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    logp = (old + 0.4 * torch.randn(B, T, generator=g, dtype=dtype)).requires_grad_(True)
    adv = torch.randn(B, T, generator=g, dtype=dtype)
    mask = (torch.rand(B, T, generator=g) < 0.8).to(dtype)
    rollout = old + 0.1 * torch.randn(B, T, generator=g, dtype=dtype)
    return logp, old, adv, mask, rollout


@pytest.mark.parametrize("with_rollout", [False, True])
def test_registered_loss_equals_skyrl_regular(with_rollout):
    """PolicyLossRegistry.get('gtpo') (the worker's dispatch) = SkyRL's `regular` loss: value and gradient."""
    g = torch.Generator().manual_seed(3 + with_rollout)
    logp, old, adv, mask, rollout = _inputs(g)
    ours_fn = ppo_utils.PolicyLossRegistry.get("gtpo")
    stock_fn = ppo_utils.PolicyLossRegistry.get("regular")
    kw = {}
    if with_rollout:  # SkyRL's truncated importance sampling on the rollout log-probs
        kw = dict(off_policy_correction=_algorithm("regular").off_policy_correction)
        kw["off_policy_correction"].tis_ratio_type = "token"
    ours, m1 = ours_fn(logp, old, adv, config=_algorithm("gtpo", **kw), loss_mask=mask,
                       rollout_logprobs=rollout if with_rollout else None)
    (g1,) = torch.autograd.grad(ours, logp)
    stock, m2 = stock_fn(logp, old, adv, config=_algorithm("regular", **kw), loss_mask=mask,
                         rollout_logprobs=rollout if with_rollout else None)
    (g2,) = torch.autograd.grad(stock, logp)
    assert g2.abs().sum() > 0
    assert abs(float(ours) - float(stock)) <= 1e-6 * max(1.0, abs(float(stock)))
    torch.testing.assert_close(g1, g2, atol=1e-6, rtol=1e-6)
    assert m1["clip_ratio"] == pytest.approx(m2["clip_ratio"])


@pytest.mark.parametrize("loss_type,stock_type", [("gtpo", "regular"), ("gtpo_dual_clip", "dual_clip")])
def test_far_off_policy_tokens_are_clamped_as_skyrl_clamps_them(loss_type, stock_type):
    """Tokens with |log r| > 20 (a rollout/training mismatch): SkyRL's safe_exp_delta clamps log r to
    [-20, 20] before exp (no gradient through the clamp); so does `gtpo`: the same loss and gradient."""
    g = torch.Generator().manual_seed(11)
    logp, old, adv, mask, _ = _inputs(g)
    with torch.no_grad():
        logp[0, :3], adv[0, :3], mask[0, :3] = old[0, :3] + 25.0, -1.0, 1.0  # r = e^25: unclipped where A < 0
        logp[1, :2], adv[1, :2], mask[1, :2] = old[1, :2] - 23.0, 1.0, 1.0  # r = e^-23
    cfg = dict(clip_ratio_c=3.0) if loss_type == "gtpo_dual_clip" else {}
    ours, _ = ppo_utils.PolicyLossRegistry.get(loss_type)(logp, old, adv, config=_algorithm(loss_type, **cfg),
                                                          loss_mask=mask)
    (g1,) = torch.autograd.grad(ours, logp)
    stock, _ = ppo_utils.PolicyLossRegistry.get(stock_type)(logp, old, adv, config=_algorithm(stock_type, **cfg),
                                                            loss_mask=mask)
    (g2,) = torch.autograd.grad(stock, logp)
    assert g2.abs().sum() > 0 and float(g2[0, :3].abs().sum()) == 0  # the clamp holds the far tokens
    assert abs(float(ours) - float(stock)) <= 1e-6 * max(1.0, abs(float(stock)))
    torch.testing.assert_close(g1, g2, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("clip_ratio_c", [3.0, 1.5])
def test_dual_clip_loss_equals_skyrl_dual_clip(clip_ratio_c):
    """PolicyLossRegistry.get('gtpo_dual_clip') = SkyRL's `dual_clip` loss, with ratios where it binds."""
    g = torch.Generator().manual_seed(int(clip_ratio_c * 10))
    logp, old, adv, mask, _ = _inputs(g)
    with torch.no_grad():  # some tokens with A < 0 and a ratio far above clip_ratio_c
        logp[:, :3] = old[:, :3] + 2.0
        adv[:, :3] = -adv[:, :3].abs()
    ours, m1 = ppo_utils.PolicyLossRegistry.get("gtpo_dual_clip")(
        logp, old, adv, config=_algorithm("gtpo_dual_clip", clip_ratio_c=clip_ratio_c), loss_mask=mask)
    (g1,) = torch.autograd.grad(ours, logp)
    stock, m2 = ppo_utils.PolicyLossRegistry.get("dual_clip")(
        logp, old, adv, config=_algorithm("dual_clip", clip_ratio_c=clip_ratio_c), loss_mask=mask)
    (g2,) = torch.autograd.grad(stock, logp)
    plain, _ = ppo_utils.PolicyLossRegistry.get("regular")(logp, old, adv, config=_algorithm("regular"), loss_mask=mask)
    assert abs(float(plain) - float(stock)) > 1e-3  # the dual clip binds on these tokens
    assert abs(float(ours) - float(stock)) <= 1e-6 * max(1.0, abs(float(stock)))
    torch.testing.assert_close(g1, g2, atol=1e-6, rtol=1e-6)
    assert m1["clip_ratio"] == pytest.approx(m2["clip_ratio"])


def _batch(g, n_groups=2, group_size=4, vocab=5):
    """A SkyRL batch from its own preprocessing: prompts and responses of random lengths, outcome rewards."""
    prompts, responses, rewards, loss_masks, uids = [], [], [], [], []
    for k in range(n_groups):
        prompt = torch.randint(0, vocab, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
        for _ in range(group_size):
            n = int(torch.randint(2, 8, (1,), generator=g))
            responses.append(torch.randint(0, vocab, (n,), generator=g).tolist())
            prompts.append(prompt)
            r = float(torch.randint(0, 2, (1,), generator=g)) + 0.1 * float(torch.rand(1, generator=g))
            rewards.append([0.0] * (n - 1) + [r])
            loss_masks.append([1] * n)
            uids.append(f"p{k}")
    seq, attn, action_mask, rew, lmask, _, _ = convert_prompts_responses_to_batch_tensors(
        _Tok(), prompts, responses, rewards, loss_masks)
    data = TrainingInputBatch({"sequences": seq, "attention_mask": attn, "response_mask": action_mask,
                               "rewards": rew, "loss_mask": lmask, "values": None})
    data.metadata = {"uids": uids, "avg_response_length": 4.0, "pad_size": 0}
    return data, responses, uids


class _Tok:
    pad_token_id = 0
    eos_token_id = 1


def _trainer(cls):
    t = object.__new__(cls)
    t.cfg = SkyRLTrainConfig()
    t.cfg.trainer.algorithm.advantage_estimator = "grpo"
    t.all_metrics = {}
    return t


def test_advantage_step_gives_the_reference_conflict_weights():
    """GTPOTrainer.compute_advantages_and_returns (SkyRL's method, then GTPO's step) = SkyRL's GRPO
    advantage times the float64 reference's lambda, computed on the responses as lists (left-aligned)."""
    g = torch.Generator().manual_seed(11)
    data, responses, uids = _batch(g)
    stock = RayPPOTrainer.compute_advantages_and_returns(_trainer(RayPPOTrainer), copy.deepcopy(data))
    t = _trainer(gs.GTPOTrainer)
    t.gtpo_config = gs.DEFAULT_CONFIG
    out = t.compute_advantages_and_returns(data)
    B, R = out["advantages"].shape
    ids = torch.zeros(B, R, dtype=torch.long)
    m = torch.zeros(B, R, dtype=torch.bool)
    for i, r in enumerate(responses):
        ids[i, :len(r)] = torch.tensor(r)
        m[i, :len(r)] = True
    a_row = stock["advantages"].sum(1) / m.sum(1)  # SkyRL's GRPO value, one per row
    lam = torch.zeros(B, R, dtype=torch.float64)
    for k in sorted(set(uids)):
        rows = [i for i, u in enumerate(uids) if u == k]
        lam[rows] = ref.conflict_weights(ids[rows], m[rows], a_row[rows].double(), len(rows))[0]
    assert ((lam != 1) & m).any(), "no conflict token: the test would not see the weights"
    for i, r in enumerate(responses):
        n = len(r)
        want = lam[i, :n] * a_row[i].double()
        torch.testing.assert_close(out["advantages"][i, R - n:].double(), want, atol=1e-6, rtol=1e-6)
        assert (out["advantages"][i, :R - n] == 0).all()
    assert "gtpo/changed_frac" in t.all_metrics


def test_chain_equals_the_package_gtpo_loss():
    """SkyRL batch -> GTPOTrainer advantages -> SkyRL's token_mean reduction -> the `gtpo` loss through the
    registry = gtpo_loss_from_logps (conflict weights on, token-mean) on the same completions."""
    g = torch.Generator().manual_seed(5)
    data, responses, uids = _batch(g)
    t = _trainer(gs.GTPOTrainer)
    t.gtpo_config = gs.DEFAULT_CONFIG
    data = t.compute_advantages_and_returns(data)
    B, R = data["advantages"].shape
    mask = data["loss_mask"].double()
    adv = ppo_utils.apply_loss_reduction_to_advantages_minibatch(
        data["advantages"].double(), mask, "token_mean", micro_batch_size=B, max_seq_len=R)
    old = -torch.rand(B, R, generator=g, dtype=torch.float64) * 2
    logp = (old + 0.3 * torch.randn(B, R, generator=g, dtype=torch.float64)).requires_grad_(True)
    loss, _ = ppo_utils.PolicyLossRegistry.get("gtpo")(logp, old, adv, config=_algorithm("gtpo"), loss_mask=mask)
    (g1,) = torch.autograd.grad(loss, logp)
    # the package on left-aligned completions, conflict weights computed from the groups
    ids = torch.zeros(B, R, dtype=torch.long)
    m = torch.zeros(B, R, dtype=torch.bool)
    off = [R - len(r) for r in responses]
    for i, r in enumerate(responses):
        ids[i, :len(r)] = torch.tensor(r)
        m[i, :len(r)] = True
    stock = RayPPOTrainer.compute_advantages_and_returns(_trainer(RayPPOTrainer), _batch(torch.Generator()
                                                                                          .manual_seed(5))[0])
    a_row = (stock["advantages"].sum(1) / m.sum(1)).double()
    order = np.argsort(np.array(uids), kind="stable")
    assert (order == np.arange(B)).all()  # groups are consecutive rows of equal size
    leftp = torch.stack([torch.roll(logp[i], -off[i]) for i in range(B)])
    lefto = torch.stack([torch.roll(old[i], -off[i]) for i in range(B)])
    cfg = GTPOConfig.preset("gtpo", entropy_threshold=None, entropy_penalty=0.0, eps_high=0.28,
                            loss_agg="token-mean")
    want = gtpo_loss_from_logps(leftp, ids, a_row, m, old_logps=lefto, group_size=4, config=cfg).loss
    (g2,) = torch.autograd.grad(want, logp)
    assert g2.abs().sum() > 0
    assert abs(float(loss) - float(want)) <= 1e-6 * max(1.0, abs(float(want)))
    torch.testing.assert_close(g1, g2, atol=1e-6, rtol=1e-6)


def test_entropy_config_without_entropies_is_refused():
    g = torch.Generator().manual_seed(2)
    data, _, _ = _batch(g)
    t = _trainer(gs.GTPOTrainer)
    t.gtpo_config = GTPOConfig.preset("gtpo")
    with pytest.raises(KeyError, match="entropy"):
        t.compute_advantages_and_returns(data)


def test_a_clip_range_out_of_range_is_refused_by_skyrls_name():
    """eps_clip_low >= 1 is not a PPO clip range here (GTPOConfig: [0, 1)): refused naming SkyRL's setting."""
    g = torch.Generator().manual_seed(4)
    logp, old, adv, mask, _ = _inputs(g)
    with pytest.raises(ValueError, match=r"eps_clip_low \(GTPOConfig\.eps_low\) must be in \[0, 1\)"):
        gs.gtpo_policy_loss(logp, old, adv, _algorithm("gtpo", eps_clip_low=1.0), mask)
    with pytest.raises(ValueError, match=r"eps_clip_high \(GTPOConfig\.eps_high\) must be in \[0, 1\)"):
        gs.gtpo_policy_loss(logp, old, adv, _algorithm("gtpo", eps_clip_high=1.5), mask)
