"""The GTPO plugin through verl 0.9.1's own machinery (skipped without verl): the entry point in a fresh
process, verl's `ppo_loss` dispatching to the `gtpo` loss against `gtpo_loss_from_logps` (loss and
gradients), the `gtpo` trainer's advantage step on a shuffled, padded batch, the `trainer.v1.gtpo` config
section and examples/verl_gtpo.yaml. These run in CI's second environment (.ci/run): verl pins
transformers<5.11 and the trl extra >=5.24. (`gtpo_token_advantages` without verl: tests/test_verl.py.)"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from gtpo_kernels import GTPOConfig, gtpo_loss_from_logps, gtpo_token_advantages
from test_verl import _expected
# verl's loss modes against verl's own functions: collected here too, so that CI's verl environment
# (which runs this file) runs them
from test_verl_losses import (test_mode_equals_verl, test_modes_not_vacuous,  # noqa: F401
                              test_plugin_mode_with_gtpo_equals_the_preset_with_gtpo_on_top,
                              test_verl_gspo_against_the_gspo_preset, test_verl_sapo_against_the_sapo_preset)

# --------------------------------------------------------------------------------------------------
# through verl (skipped when verl is not installed; CI installs it in its second environment)
# --------------------------------------------------------------------------------------------------

def test_entry_point_registers_in_a_fresh_process():
    pytest.importorskip("verl")
    code = ("from verl.trainer.ppo.core_algos import get_policy_loss_fn\n"
            "import gtpo_kernels.integrations.verl as p\n"
            "assert get_policy_loss_fn('gtpo') is p.compute_policy_loss_gtpo\n"
            "from importlib.metadata import entry_points\n"
            "assert [e.value for e in entry_points(group='verl.plugins') if e.name == 'gtpo'] == "
            "['gtpo_kernels.integrations.verl']\n"
            "import sys\n"
            "from verl.trainer.ppo.v1 import get_trainer_cls\n"
            "assert get_trainer_cls('gtpo') is p.GTPOTrainer\n"
            "print('ok')\n")
    # first: verl alone registers it (no import of ours before `import verl` has run the plugins)
    first = ("import verl, sys\n"
             "assert 'gtpo_kernels.integrations.verl' in sys.modules, 'the verl.plugins entry point did not load'\n")
    env = dict(os.environ, VERL_USE_EXTERNAL_PLUGINS="auto")
    out = subprocess.run([sys.executable, "-c", first + code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def _verl():
    pytest.importorskip("verl")
    import gtpo_kernels.integrations.verl as plugin
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig, PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss
    return plugin, TensorDict, tu, ActorConfig, PolicyLossConfig, ppo_loss


def _rollout(seed, P=3, G=4, T=9, V=6):
    """A verl-like rollout: groups share prefixes/suffixes, ragged responses, rows shuffled."""
    gen = torch.Generator().manual_seed(seed)
    B = P * G
    tmpl = torch.randint(0, V, (P, T), generator=gen)
    ids = torch.randint(0, V, (B, T), generator=gen)
    lens = torch.randint(1, T + 1, (B,), generator=gen)
    lens[0] = T
    for i in range(B):
        k = int(torch.randint(0, T + 1, (1,), generator=gen))
        ids[i, :k] = tmpl[i // G, :k]
        s = min(int(torch.randint(0, 4, (1,), generator=gen)), int(lens[i]))
        if s:
            ids[i, lens[i] - s:lens[i]] = tmpl[i // G, T - s:]
    mask = (torch.arange(T)[None] < lens[:, None]).float()
    ids = ids * mask.long()
    adv = torch.randint(-1, 2, (B,), generator=gen).float() + 0.3 * torch.randn(B, generator=gen)
    H = torch.rand(B, T, generator=gen) * 1.2
    old = -torch.rand(B, T, generator=gen) * 3
    logp = old + 0.3 * torch.randn(B, T, generator=gen)
    group = torch.arange(B) // G
    perm = torch.randperm(B, generator=gen)
    return dict(ids=ids[perm], mask=mask[perm], adv=adv[perm], H=H[perm], old=old[perm], logp=logp[perm],
                group=group[perm], lens=lens[perm], prompt_lens=torch.randint(1, 5, (B,), generator=gen))


def _nested(rows):
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _verl_loss(r, lp, tok_adv, rows, mode, gbs, ntok, scale):
    """verl's ppo_loss on rows (a micro-batch) with verl's nested inputs and the global batch info."""
    plugin, TensorDict, tu, ActorConfig, PolicyLossConfig, ppo_loss = _verl()
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size=2, clip_ratio=0.2,
                      loss_agg_mode=mode, policy_loss=PolicyLossConfig(loss_mode="gtpo"), entropy_coeff=0.0,
                      use_kl_loss=False, loss_scale_factor=scale)
    L, p = r["lens"][rows], r["prompt_lens"][rows]
    full = [torch.cat([torch.zeros(int(p[k]) - 1), lp[i, :int(L[k])], torch.zeros(1)]) for k, i in enumerate(rows)]
    data = TensorDict({
        "prompts": _nested([torch.ones(int(p[k]), dtype=torch.long) for k in range(len(rows))]),
        "responses": _nested([r["ids"][i, :int(L[k])] for k, i in enumerate(rows)]),
        "response_mask": _nested([r["mask"][i, :int(L[k])] for k, i in enumerate(rows)]),
        "old_log_probs": _nested([r["old"][i, :int(L[k])] for k, i in enumerate(rows)]),
        "advantages": _nested([tok_adv[i, :int(L[k])] for k, i in enumerate(rows)]),
    }, batch_size=[len(rows)])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=ntok, global_batch_size=gbs)
    loss, metrics = ppo_loss(cfg, {"log_probs": _nested(full)}, data)
    return loss, metrics


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum",
                                  "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_verl_dispatch_equals_gtpo_loss_from_logps(mode, seed):
    """get_policy_loss_fn('gtpo') through verl's ppo_loss, summed over two micro-batches with verl's
    global batch info, on gtpo_token_advantages = gtpo_loss_from_logps on the whole batch: loss and
    gradient w.r.t. the log-probs."""
    _verl()
    r = _rollout(seed)
    B, T = r["ids"].shape
    cfg = GTPOConfig.preset("gtpo", loss_agg=mode, eps_low=0.2, eps_high=0.2, entropy_threshold=0.7)
    uid = np.array([f"uid{g}" for g in r["group"].tolist()], dtype=object)
    tok_adv = gtpo_token_advantages(r["adv"][:, None] * r["mask"], r["ids"], r["mask"], r["H"], uid, config=cfg)
    ntok = int(r["mask"].sum())
    T_max = int(r["lens"].max())

    lp_v = r["logp"].clone().requires_grad_(True)
    half = B // 2
    losses = [_verl_loss(r, lp_v, tok_adv, rows, mode, B, ntok, T_max)[0]
              for rows in (list(range(half)), list(range(half, B)))]
    loss_v = losses[0] + losses[1]
    loss_v.backward()

    # the same batch in contiguous groups for gtpo_loss_from_logps (group_size)
    order = torch.argsort(r["group"], stable=True)
    lp_g = r["logp"].clone().requires_grad_(True)
    out = gtpo_loss_from_logps(lp_g[order], r["ids"][order], r["adv"][order], r["mask"][order],
                               entropy=r["H"][order], group_size=4, old_logps=r["old"][order],
                               config=GTPOConfig.preset("gtpo", loss_agg=mode, entropy_threshold=0.7,
                                                        max_completion_length=T_max, dual_clip_c=3.0),
                               num_items_in_batch=ntok if mode == "token-mean" else None)
    out.loss.backward()
    torch.testing.assert_close(loss_v.detach(), out.loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp_v.grad * r["mask"], lp_g.grad * r["mask"], rtol=1e-5, atol=1e-7)
    assert float(out.metrics["conflict_frac"]) > 0 and 0 < float(out.metrics["filtered_frac"]) < 1  # not vacuous


def _dual_clip_batch(seed, B=6, T=7):
    """float64 log-probs, old log-probs far enough from them that ratios pass 3 (and fall below the clip),
    advantages of both signs per token (GTPO's parts off: plain advantages), ragged mask, rollout weights."""
    g = torch.Generator().manual_seed(seed)
    F = torch.float64
    lens = torch.randint(1, T + 1, (B,), generator=g)
    lens[0] = T
    mask = torch.arange(T)[None] < lens[:, None]
    logp = -torch.rand(B, T, generator=g, dtype=F) * 3 - 0.01
    old = logp - 1.2 * torch.randn(B, T, generator=g, dtype=F)
    adv = torch.randn(B, generator=g, dtype=F)[:, None].expand(B, T).clone()
    w = torch.rand(B, T, generator=g, dtype=F) * 1.5 + 0.25
    return logp, old, adv, mask, w


def _policy_loss(name, agg, actor, logp, old, adv, mask, w):
    """verl's registered policy loss `name` through get_policy_loss_fn: (loss, d loss / d log_prob, metrics)."""
    _, _, _, ActorConfig, PolicyLossConfig, _ = _verl()
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size=2, loss_agg_mode=agg,
                      policy_loss=PolicyLossConfig(loss_mode=name), use_kl_loss=False, **actor)
    cfg.global_batch_info.update(global_batch_size=logp.shape[0])
    x = logp.clone().requires_grad_()
    loss, metrics = get_policy_loss_fn(name)(old_log_prob=old, log_prob=x, advantages=adv, response_mask=mask,
                                             loss_agg_mode=agg, config=cfg, rollout_is_weights=w)
    loss.backward()
    return loss.detach(), x.grad, metrics


@pytest.mark.parametrize("agg", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                                 "seq-mean-token-mean"])
@pytest.mark.parametrize("c", [None, 1.7])
def test_gtpo_mode_dual_clip_equals_verl_vanilla(agg, c):
    """policy_loss.loss_mode=gtpo honours the actor's clip_ratio_c as verl's vanilla does (its default 3.0
    when not set): with GTPO's parts off (plain advantages) the two registered functions agree in value,
    gradient and clip metrics on float64 inputs where the dual clip binds (without it the loss differs)."""
    _verl()
    worst = 0.0
    for seed in range(3):
        logp, old, adv, mask, w = _dual_clip_batch(seed)
        actor = dict(clip_ratio=0.2, clip_ratio_low=0.15, clip_ratio_high=0.28)
        if c is not None:
            actor["clip_ratio_c"] = c
        bound = 3.0 if c is None else c
        ratio = torch.exp(logp - old)
        assert ((ratio > bound) & (adv < 0) & mask).any(), "the dual clip does not bind: the case tests nothing"
        for weights in (None, w):
            lv, gv, mv = _policy_loss("vanilla", agg, actor, logp, old, adv, mask, weights)
            lg, gg, mg = _policy_loss("gtpo", agg, actor, logp, old, adv, mask, weights)
            d = max(float((lg - lv).abs() / lv.abs().clamp(min=1)), float((gg - gv)[mask].abs().max()))
            worst = max(worst, d)
            assert d <= 1e-6, (seed, d)
            for k in ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"):
                assert abs(mg[k] - mv[k]) <= 1e-6, k
            assert mg["actor/pg_clipfrac_lower"] > 0
            # without the dual clip (a bound no ratio reaches) the loss is another: the test can fail
            lo, _, _ = _policy_loss("gtpo", agg, {**actor, "clip_ratio_c": 1e9}, logp, old, adv, mask, weights)
            assert float((lo - lv).abs()) > 1e-3
    assert worst <= 1e-6
    print(f"gtpo vs vanilla, {agg}, clip_ratio_c={c}: worst difference {worst:.1e}")


def test_gtpo_mode_refuses_a_dual_clip_at_most_one():
    _verl()
    logp, old, adv, mask, w = _dual_clip_batch(0)
    with pytest.raises(ValueError, match="clip_ratio_c must be a number > 1"):
        _policy_loss("gtpo", "token-mean", dict(clip_ratio=0.2, clip_ratio_c=1.0), logp, old, adv, mask, None)


class _FakeTQ:
    """An in-memory stand-in for TransferQueue's kv_batch_get / kv_batch_put (keys -> fields)."""

    def __init__(self, td, keys):
        self.td, self.keys = td, list(keys)

    def kv_batch_get(self, keys, partition_id, select_fields):
        idx = [self.keys.index(k) for k in keys]
        assert idx == list(range(len(self.keys)))
        return self.td.select(*select_fields)

    def kv_batch_put(self, keys, partition_id, fields):
        for k, v in fields.items():
            self.td[k] = v
        return "put"


def test_trainer_advantage_step_shuffled_padded(monkeypatch):
    """The gtpo trainer's _compute_advantage after verl's own (stubbed: it wrote GRPO-style (B, T)
    advantages): shuffled rows plus verl's all-masked padding rows, nested as TransferQueue holds
    them -> equals the padded-form reference (contiguous groups, float64)."""
    plugin, TensorDict, tu, *_ = _verl()
    if plugin.GTPOTrainer is None:
        pytest.skip("verl's v1 trainer (TransferQueue) is not importable")
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1 import PPOTrainerSync

    r = _rollout(3)
    B, T = r["ids"].shape
    n_pad = 2  # verl's padding rows: response_len 1, masked out, their own uid
    ids = torch.cat([r["ids"], torch.full((n_pad, T), 3)])
    mask = torch.cat([r["mask"], torch.zeros(n_pad, T)])
    lens = torch.cat([r["lens"], torch.ones(n_pad, dtype=torch.long)])
    adv = torch.cat([r["adv"], torch.zeros(n_pad)])
    H = torch.cat([r["H"], torch.rand(n_pad, T)])
    uids = [f"uid{g}" for g in r["group"].tolist()] + ["pad123"] * n_pad
    verl_adv = adv[:, None] * mask
    nested = lambda x: _nested([x[i, :int(lens[i])] for i in range(B + n_pad)])  # noqa: E731
    td = TensorDict({"responses": nested(ids), "response_mask": nested(mask), "advantages": nested(verl_adv),
                     "entropy": nested(H)}, batch_size=[B + n_pad])
    tu.assign_non_tensor(td, uid=uids)
    keys = [f"{u}_0_{i}" for i, u in enumerate(uids)]
    fake = _FakeTQ(td, keys)
    monkeypatch.setattr(plugin, "tq", fake)
    monkeypatch.setattr(PPOTrainerSync, "_compute_advantage", lambda self, batch, metrics: batch)
    trainer = object.__new__(plugin.GTPOTrainer)
    trainer.config = OmegaConf.create({"trainer": {"v1": {"trainer_mode": "gtpo",
                                                           "gtpo": {"preset": "gtpo", "entropy_threshold": 0.7}}}})

    class Batch:
        partition_id = "train"

        def __init__(self):
            self.keys = keys

        def __len__(self):
            return len(self.keys)

    metrics = {}
    assert trainer._compute_advantage(Batch(), metrics) == "put"
    got = td["advantages"].to_padded_tensor(0.0)
    Tm = got.shape[1]
    cfg = GTPOConfig.preset("gtpo", entropy_threshold=0.7)
    groups = [[i for i, u in enumerate(uids) if u == g] for g in dict.fromkeys(uids)]
    want = _expected(adv, ids, mask, H, groups, cfg)[:, :Tm]
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert not got[B:].any()
    assert "gtpo/changed_frac" in metrics
    assert not any(k.startswith("rollout_corr/") for k in metrics)  # the rollout kept no log-probs


def test_trainer_logs_the_rollout_mismatch(monkeypatch):
    """With `calculate_log_probs` on, the advantage step logs spec 14's mismatch of the old-policy pass
    against the rollout's log-probs (nested, with verl's padding rows and a NaN), equal to the float64
    reference over the counted tokens."""
    plugin, TensorDict, tu, *_ = _verl()
    if plugin.GTPOTrainer is None:
        pytest.skip("verl's v1 trainer (TransferQueue) is not importable")
    import gtpo_reference.gtpo_family as fam
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1 import PPOTrainerSync

    r = _rollout(5)
    B, T = r["ids"].shape
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(B, T, generator=g) * 3
    roll = old + 0.2 * torch.randn(B, T, generator=g)
    roll[0, 0] = float("nan")
    nested = lambda x: _nested([x[i, :int(r["lens"][i])] for i in range(B)])  # noqa: E731
    td = TensorDict({"responses": nested(r["ids"]), "response_mask": nested(r["mask"]),
                     "advantages": nested(r["adv"][:, None] * r["mask"]), "old_log_probs": nested(old),
                     "rollout_log_probs": nested(roll)}, batch_size=[B])
    uids = [f"uid{k}" for k in r["group"].tolist()]
    tu.assign_non_tensor(td, uid=uids)
    keys = [f"{u}_0_{i}" for i, u in enumerate(uids)]
    monkeypatch.setattr(plugin, "tq", _FakeTQ(td, keys))
    monkeypatch.setattr(PPOTrainerSync, "_compute_advantage", lambda self, batch, metrics: batch)
    trainer = object.__new__(plugin.GTPOTrainer)
    trainer.config = OmegaConf.create({"trainer": {"v1": {"trainer_mode": "gtpo", "gtpo": {"preset": "grpo"}}},
                                       "actor_rollout_ref": {"rollout": {"calculate_log_probs": True}}})

    class Batch:
        partition_id = "train"

        def __init__(self):
            self.keys = keys

        def __len__(self):
            return B

    metrics = {}
    trainer._compute_advantage(Batch(), metrics)
    m = torch.zeros(B, T, dtype=torch.bool)
    for i in range(B):
        m[i, :int(r["lens"][i])] = r["mask"][i, :int(r["lens"][i])] != 0
    want = fam.rollout_mismatch(old.double(), roll.double(), m)
    assert 0 < want["rollout_nan_frac"] < 1 and want["rollout_k3"] > 0
    for k, v in want.items():
        assert metrics[f"rollout_corr/{k}"] == pytest.approx(float(v), rel=1e-5), k


def test_gtpo_config_from_section():
    plugin = _verl()[0]
    from omegaconf import OmegaConf
    assert plugin.gtpo_config_from(None) == GTPOConfig.preset("gtpo")
    assert plugin.gtpo_config_from(OmegaConf.create({"preset": "gtpo-official", "entropy_threshold": 0.5})) == \
        GTPOConfig.preset("gtpo-official", entropy_threshold=0.5)
    with pytest.raises(TypeError, match="unknown field"):
        plugin.gtpo_config_from({"preset": "gtpo", "bogus": 1})
    assert math.isclose(plugin.gtpo_config_from("gtpo-official").entropy_threshold, 0.7)


def test_example_config_composes_with_verl_defaults():
    """examples/verl_gtpo.yaml composes over verl's own ppo_trainer config and selects the plugin."""
    plugin = _verl()[0]
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    with initialize_config_dir(config_dir=examples, version_base=None):
        cfg = compose(config_name="verl_gtpo", overrides=["+trainer.v1.gtpo.initial_entropy=1.0"])
    assert cfg.trainer.use_v1 and cfg.trainer.v1.trainer_mode == plugin.TRAINER_MODE
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.policy_loss.loss_mode == plugin.LOSS_MODE and actor.loss_agg_mode == "seq-mean-token-mean"
    assert plugin.gtpo_config_from(cfg.trainer.v1.gtpo) == GTPOConfig.preset("gtpo", initial_entropy=1.0)
