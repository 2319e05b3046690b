"""GTPO through OpenRLHF's own code (skipped without OpenRLHF; CI installs it `--no-deps` in an
environment of its own: its full dependency set needs CUDA). `install()` rebinds the actor's
`PolicyLoss`; OpenRLHF's `ActorPPOTrainer.training_step` (its actor's loss call, with the global batch
info) then gives the same loss and gradient as the stock PolicyLoss (float64, token- and
sequence-mean); GTPOExperienceMaker's advantage step (OpenRLHF's group_norm, then GTPO) gives the float64
reference's conflict weights, groups from each sample's `index`. (flash_attn, CUDA-only, and the vLLM
import of `openrlhf.trainer.ray`'s __init__ are stubbed: the tested modules do not use them.)"""
from __future__ import annotations

import importlib.machinery
import os
import sys
import types
from types import SimpleNamespace as NS

import pytest
import torch

pytest.importorskip("openrlhf")


def _stubs():
    """flash_attn (CUDA-only) and openrlhf.trainer.ray's package __init__ (imports vLLM), as empty modules."""
    names = {"flash_attn": {}, "flash_attn.bert_padding": dict.fromkeys(["index_first_axis", "pad_input",
                                                                         "rearrange", "unpad_input"]),
             "flash_attn.utils": {}, "flash_attn.utils.distributed": {"all_gather": None}}
    for n, attrs in names.items():
        if n not in sys.modules:
            m = types.ModuleType(n)
            m.__path__ = []
            m.__dict__.update(attrs)
            m.__spec__ = importlib.machinery.ModuleSpec(n, None, is_package=True)
            sys.modules[n] = m
    import openrlhf.trainer as t
    if "openrlhf.trainer.ray" not in sys.modules:
        m = types.ModuleType("openrlhf.trainer.ray")
        m.__path__ = [os.path.join(os.path.dirname(t.__file__), "ray")]
        sys.modules["openrlhf.trainer.ray"] = m


_stubs()
import gtpo_reference as ref  # noqa: E402
from gtpo_kernels.integrations import openrlhf as go  # noqa: E402
from openrlhf.models.loss import PolicyLoss  # noqa: E402
from openrlhf.trainer.ppo_utils import experience_maker  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402
from openrlhf.trainer.ray import ppo_actor  # noqa: E402


class _Actor(torch.nn.Module):
    """Stands for OpenRLHF's Actor: action log-probs = base + theta (theta: the trained parameter)."""

    def __init__(self, base):
        super().__init__()
        self.base = base
        self.theta = torch.nn.Parameter(torch.zeros_like(base))

    def forward(self, sequences, action_mask, **kw):
        return self.base + self.theta, NS(aux_loss=None, entropy=None)


def _training_step(loss_fn, exp, info, base):
    actor = _Actor(base)
    strategy = NS(ring_attn_group=None, backward=lambda loss, model, opt: loss.backward(),
                  optimizer_step=lambda *a, **k: None, get_grad_norm=lambda m: 0.0)
    args = NS(actor=NS(entropy_coef=None, aux_loss_coef=0.0), algo=NS(kl=NS(use_loss=False)),
              train=NS(dynamic_batch_enable=False))
    me = NS(actor=actor, strategy=strategy, args=args, actor_loss_fn=loss_fn, ema_model=None, aux_loss=False,
            actor_optim=None, actor_scheduler=NS(get_last_lr=lambda: [0.0]), replay_buffer=None)
    out = ppo_actor.ActorPPOTrainer.training_step(me, exp, kl_ctl=0.0, step=0, loss_batch_info=info)
    return out["metrics"]["policy_loss"], actor.theta.grad


@pytest.mark.parametrize("agg,far", [("token-mean", False), ("seq-mean-token-mean", False), ("token-mean", True)])
def test_training_step_equals_the_stock_policy_loss(agg, far):
    """far: tokens with |log r| > 20, which OpenRLHF's PolicyLoss clamps to [-20, 20] before exp (no
    gradient through the clamp), and so does GTPOPolicyLoss."""
    g = torch.Generator().manual_seed(4 if agg == "token-mean" else 5)
    B, A, P = 6, 7, 3
    old = -torch.rand(B, A, generator=g, dtype=torch.float64) * 3
    base = old + 0.4 * torch.randn(B, A, generator=g, dtype=torch.float64)
    adv = torch.randn(B, A, generator=g, dtype=torch.float64)
    mask = torch.rand(B, A, generator=g) < 0.8
    if far:
        base[0, :3], adv[0, :3], mask[0, :3] = old[0, :3] + 25.0, -1.0, True  # r = e^25, unclipped where A < 0
        base[1, :2], adv[1, :2], mask[1, :2] = old[1, :2] - 23.0, 1.0, True
    exp = Experience(sequences=torch.randint(0, 9, (B, P + A), generator=g), action_mask=mask,
                     attention_mask=torch.ones(B, P + A, dtype=torch.long), action_log_probs=old, advantages=adv,
                     rollout_log_probs=None, info={})
    info = dict(dp_size=2, batch_num_tokens=float(mask.sum()) + 5.0, global_batch_size=B + 2.0)
    kw = dict(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=None, token_level_loss=agg == "token-mean",
              policy_loss_type="ppo")
    stock = _training_step(PolicyLoss(**kw), exp, info, base)
    saved = ppo_actor.PolicyLoss
    try:
        go.install(experience_maker=False)  # the trainer module imports vLLM's engine
        assert ppo_actor.PolicyLoss is go.GTPOPolicyLoss
        ours = _training_step(ppo_actor.PolicyLoss(**kw), exp, info, base)  # built as the actor builds it
    finally:
        ppo_actor.PolicyLoss = saved
    assert stock[1].abs().sum() > 0
    assert abs(float(ours[0]) - float(stock[0])) <= 1e-6 * max(1.0, abs(float(stock[0])))
    torch.testing.assert_close(ours[1], stock[1], atol=1e-6, rtol=1e-6)


def test_advantage_step_gives_the_reference_conflict_weights():
    """GTPOExperienceMaker.compute_advantages_and_returns: OpenRLHF's group_norm, then GTPO's weights for
    groups of n_samples_per_prompt by `index`, experiences of different widths, rows in shuffled order."""
    g = torch.Generator().manual_seed(8)
    n, n_prompts, V, P = 4, 2, 4, 3
    B = n * n_prompts
    lens = torch.randint(2, 7, (B,), generator=g)
    ids = torch.randint(0, V, (B, 6), generator=g)
    rewards = torch.randint(0, 2, (B,), generator=g).double() + 0.1 * torch.rand(B, generator=g, dtype=torch.float64)
    perm = torch.randperm(B, generator=g).tolist()
    exps = []
    for part in (perm[:5], perm[5:]):
        A = int(lens[part].max())
        mask = torch.arange(A)[None, :] < lens[part][:, None]
        seq = torch.cat([torch.randint(0, V, (len(part), P), generator=g), ids[part, :A]], dim=1)
        exps.append(Experience(sequences=seq, action_mask=mask, attention_mask=torch.ones_like(seq),
                               rewards=rewards[part].clone(), kl=torch.zeros(len(part), A, dtype=torch.float64),
                               index=list(part), info={}))
    args = NS(algo=NS(advantage=NS(estimator="group_norm", gamma=1.0)), rollout=NS(n_samples_per_prompt=n),
              reward=NS(clip_range=None, overlong_buffer_len=None, stop_properly_penalty_coef=None))
    maker = object.__new__(go._experience_maker_class())
    maker.strategy, maker.advantage_estimator, maker.kl_ctl = NS(args=args), "group_norm", NS(value=0.0)
    maker.compute_advantages_and_returns(exps)
    r = rewards.reshape(n_prompts, n)
    a = ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-9)).reshape(-1)
    m = torch.arange(6)[None, :] < lens[:, None]
    lam = torch.cat([ref.conflict_weights(ids[k * n:(k + 1) * n], m[k * n:(k + 1) * n], a[k * n:(k + 1) * n],
                                          n)[0] for k in range(n_prompts)])
    assert ((lam != 1) & m).any(), "no conflict token: the test would not see the weights"
    for e in exps:
        for row, i in enumerate(e.index):
            L = int(lens[i])
            torch.testing.assert_close(e.advantages[row, :L].double(), lam[i, :L] * a[i], atol=1e-6, rtol=1e-6)
            assert (e.advantages[row, L:] == 0).all()


def test_a_clip_range_out_of_range_is_refused_by_openrlhfs_name():
    """clip_eps_low >= 1 is not a PPO clip range here (GTPOConfig: [0, 1)): refused, when the actor builds
    the loss, naming OpenRLHF's setting."""
    with pytest.raises(ValueError, match=r"clip_eps_low \(GTPOConfig\.eps_low\) must be in \[0, 1\)"):
        go.GTPOPolicyLoss(clip_eps_low=1.0, clip_eps_high=0.28, policy_loss_type="ppo")
