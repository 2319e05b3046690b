"""The verl plugin over the sampler's distribution (spec 13), in verl 0.9.1's environment (skipped without
verl): the rollout's temperature / top_k / top_p mapped to the replay keywords; `kept_set_logprobs` (verl's
`logprobs_from_logits` over the kept sets) against the float64 reference; verl's own FSDP engine
(`FSDPEngineWithLMHead.prepare_model_outputs`, the code that turns the actor's logits into log-probs and
entropies for the old-policy, reference and update passes) replaying the sets for micro-batches that carry
the rules and untouched otherwise; the `gtpo` trainer putting the rules in each pass's batch; and the whole
chain (the engine's log-probs into verl's ppo_loss with the `gtpo` mode) equal to gtpo_loss on the logits
with the same keywords."""
from __future__ import annotations

import types

import pytest
import torch

F64 = torch.float64


def _verl():
    pytest.importorskip("verl")
    import gtpo_kernels.integrations.verl as plugin
    return plugin


def _rel(x, ref):
    x, ref = x.detach().double(), ref.detach().double()
    return float(((x - ref).abs() / ref.abs().clamp(min=1.0)).max())


# ------------------------------------------------------------------ the rollout's settings

def test_sampler_settings_from_verl_rollout():
    """verl's rollout section -> the replay keywords: verl's own defaults (rollout.yaml: top_k -1, top_p 1)
    are off; HF's top_k 0 too; bad values refused naming the field."""
    plugin = _verl()
    import os

    import verl
    from omegaconf import OmegaConf
    yaml = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer/config/rollout/rollout.yaml"))
    assert plugin.sampler_settings(yaml) == dict(temperature=1.0, top_k=None, top_p=None, min_p=None)
    got = plugin.sampler_settings(OmegaConf.create({"temperature": 0.7, "top_k": 20, "top_p": 0.9}))
    assert got == dict(temperature=0.7, top_k=20, top_p=0.9, min_p=None)
    assert plugin.sampler_settings(types.SimpleNamespace(temperature=1.0, top_k=0, top_p=0.95))["top_k"] is None
    for kw, match in [(dict(top_k=-2), "rollout.top_k"), (dict(top_k=2.5), "rollout.top_k"),
                      (dict(top_p=0.0), "rollout.top_p"), (dict(top_p=1.2), "rollout.top_p"),
                      (dict(top_k=float("inf")), "rollout.top_k"), (dict(top_k=float("nan")), "rollout.top_k"),
                      (dict(min_p=float("nan")), "rollout.min_p"),
                      (dict(temperature=0.0), "rollout.temperature"),
                      (dict(temperature=float("inf")), "rollout.temperature")]:
        with pytest.raises(ValueError, match=match):
            plugin.sampler_settings(OmegaConf.create({"temperature": 1.0, "top_k": -1, "top_p": 1.0, **kw}))


# ------------------------------------------------------------------ kept_set_logprobs

CASES = [dict(top_k=7), dict(top_p=0.8), dict(top_k=12, top_p=0.9), dict(top_k=20, min_p=0.3)]


def _scaled_logits(seed, N=14, V=37, dtype=F64):
    """Fresh random logits already divided by a temperature, peaked rows included, and labels: mostly drawn
    from each row's softmax, two of them improbable (the rules leave them out: restored)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(N, V, generator=g, dtype=F64) * 2.0
    z[3] *= 6.0  # a sharply peaked row
    y = torch.multinomial(torch.softmax(z, -1), 1, generator=g)[:, 0]
    y[5], y[9] = z[5].argmin(), z[9].argmin()
    return z.to(dtype), y


@pytest.mark.parametrize("rules", CASES, ids=lambda r: "-".join(f"{k}{v}" for k, v in r.items()))
def test_kept_set_logprobs_against_the_reference(rules):
    """kept_set_logprobs = gtpo_reference.gtpo_sampling's replay in float64 (values and the gradient of a
    random combination of log-probs and entropies), float32 within 1e-5; and not log_softmax's."""
    plugin = _verl()
    from gtpo_reference import gtpo_sampling as rs
    for seed in range(3):
        z, y = _scaled_logits(seed)
        x = z.clone().requires_grad_()
        lp, ent = plugin.kept_set_logprobs(x, y, **rules)
        xr = z.clone().requires_grad_()
        lp_r, ent_r, met, _ = rs.replay_token_logprobs(xr[None], y[None], **rules)
        assert float(met["replay_restored_frac"]) > 0  # the improbable labels were added back
        assert _rel(lp, lp_r[0]) <= 1e-12 and _rel(ent, ent_r[0]) <= 1e-12
        g = torch.Generator().manual_seed(seed + 100)
        a, b = torch.randn(len(y), generator=g, dtype=F64), torch.randn(len(y), generator=g, dtype=F64)
        ((a * lp).sum() + (b * ent).sum()).backward()
        ((a * lp_r[0]).sum() + (b * ent_r[0]).sum()).backward()
        assert float((x.grad - xr.grad).abs().max()) <= 1e-10
        full = torch.log_softmax(z, -1).gather(-1, y[:, None])[:, 0]
        assert float((lp.detach() - full).abs().max()) > 1e-2
        lp32, ent32 = plugin.kept_set_logprobs(z.float(), y, **rules)
        assert _rel(lp32, lp_r[0].detach()) <= 1e-5 and _rel(ent32, ent_r[0].detach()) <= 1e-5
    # the entropy alone: the rules' set (no label)
    z, _ = _scaled_logits(7)
    ent = plugin.kept_set_entropy(z, chunk_size=2048, **rules)
    _, ent_r, _, _ = rs.replay_token_logprobs(z[None], z.argmax(-1)[None], **rules)
    assert _rel(ent, ent_r[0]) <= 1e-12


TIED = [dict(top_p=0.1), dict(top_p=0.6), dict(top_k=2), dict(top_k=3, top_p=0.3), dict(min_p=0.9, top_p=0.2)]


@pytest.mark.parametrize("rules", TIED, ids=lambda r: "-".join(f"{k}{v}" for k, v in r.items()))
def test_kept_set_entropy_of_rows_tied_at_the_maximum(rules):
    """kept_set_entropy when a row's maximum is tied: top-p drops the tied entries of lowest id first, so
    the lowest-id maximum need not be kept; the entropy is over the rules' set exactly (float64 reference:
    gtpo_sampling.kept_sets without labels; float64 within 1e-12 with its gradient, float32 within 1e-5)."""
    plugin = _verl()
    from gtpo_reference import gtpo_sampling as rs
    g = torch.Generator().manual_seed(3)
    z = (torch.randn(24, 11, generator=g, dtype=F64) * 2).round()  # integer logits: ties everywhere
    z[:, 4:7] = z.max(-1, keepdim=True).values + 1  # three maxima tied (ids 4, 5, 6), the argmax 4
    z[0] = torch.tensor([3.0, 3.0, 3.0, 0.0, -1.0] + [-4.0] * 6)
    z[1, 7] = z[1].max() + 2  # a row with one maximum
    token_ids, offsets, _ = rs.kept_sets(z, top_k=rules.get("top_k"), top_p=rules.get("top_p"),
                                         min_p=rules.get("min_p"))
    sets = [token_ids[int(offsets[r]):int(offsets[r + 1])] for r in range(len(z))]
    assert any(int(z[r].argmax()) not in s for r, s in enumerate(sets)) or "top_p" not in rules
    xr = z.clone().requires_grad_()
    _, ent_r = rs.replay_logprobs(xr, torch.stack([s[-1] for s in sets]), (token_ids, offsets))
    x = z.clone().requires_grad_()
    ent = plugin.kept_set_entropy(x, **rules)
    assert _rel(ent, ent_r) <= 1e-12, (ent.tolist(), ent_r.tolist())
    w = torch.randn(len(z), generator=g, dtype=F64)
    (w * ent).sum().backward()
    (w * ent_r).sum().backward()
    assert float((x.grad - xr.grad).abs().max()) <= 1e-10
    assert _rel(plugin.kept_set_entropy(z.float(), **rules), ent_r.detach()) <= 1e-5


# ------------------------------------------------------------------ verl's engine

def _engine():
    """verl 0.9.1's FSDPEngineWithLMHead without a model: the attributes prepare_model_outputs reads."""
    plugin = _verl()
    if not plugin.ENGINE_REPLAY:
        pytest.skip("the plugin did not patch verl's engine (not verl 0.9.1's FSDP engine)")
    import verl.utils.torch_functional as verl_F
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    eng = object.__new__(FSDPEngineWithLMHead)
    eng.engine_config = types.SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False)
    eng.compute_entropy_from_logits = verl_F.entropy_from_logits
    eng.use_ulysses_sp = False
    return plugin, eng


def _packed_micro_batch(seed, lens=(6, 9, 4), V=33, tau=0.7, rules=None, **flags):
    """A micro-batch as verl's engine holds it (remove-padding: the sequences packed, nested input_ids) with
    the model's logits (1, total, V) and the inputs prepare_model_inputs hands on (rolled labels, per-token
    temperature)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, V, (n,), generator=g) for n in lens]
    input_ids = torch.nested.as_nested_tensor(seqs, layout=torch.jagged)
    mb = TensorDict({"input_ids": input_ids}, batch_size=[len(lens)])
    tu.assign_non_tensor(mb, calculate_entropy=True, **flags)
    if rules:
        tu.assign_non_tensor(mb, **rules)
    flat = torch.cat(seqs)
    rolled = torch.roll(flat, shifts=-1)
    logits = torch.randn(1, flat.numel(), V, generator=g) * 2.5
    args = {"input_ids_rmpad_rolled": rolled, "temperature_rmpad": torch.full((flat.numel(),), tau), "pad_size": 0,
            "temperature_is_one": False}
    return mb, logits, args, rolled


@pytest.mark.parametrize("rules", CASES, ids=lambda r: "-".join(f"{k}{v}" for k, v in r.items()))
def test_verl_engine_replays_micro_batches_that_carry_the_rules(rules):
    """FSDPEngineWithLMHead.prepare_model_outputs (verl's code, the plugin's patch around it): a micro-batch
    with the rules gets log-probs and entropies over the kept sets of its temperature-scaled logits (float64
    reference, gradients through them); one without gets verl's full-vocabulary values, bit for bit."""
    plugin, eng = _engine()
    import verl.utils.torch_functional as verl_F
    from gtpo_reference import gtpo_sampling as rs
    keys = {plugin.REPLAY_KEYS[k]: v for k, v in rules.items()}
    tau = 0.7
    for seed in range(2):
        mb, logits, args, rolled = _packed_micro_batch(seed, tau=tau, rules=keys)
        x = logits.clone().requires_grad_()
        out = eng.prepare_model_outputs(types.SimpleNamespace(logits=x), args, mb, None)
        lp, ent = out["log_probs"].values(), out["entropy"].values()
        s = logits[0].double() / tau
        lp_r, _, _, _ = rs.replay_token_logprobs(s[None], rolled[None], **rules)
        _, ent_r, _, _ = rs.replay_token_logprobs(s[None], s.argmax(-1)[None], **rules)
        assert _rel(lp, lp_r[0]) <= 1e-5 and _rel(ent, ent_r[0]) <= 1e-5
        full = torch.log_softmax(s, -1).gather(-1, rolled[:, None])[:, 0]
        assert float((lp.detach().double() - full).abs().max()) > 1e-2
        lp.sum().backward()
        assert x.grad is not None and float(x.grad.abs().sum()) > 0
        assert int((x.grad[0] != 0).sum(-1).max()) < logits.shape[-1]  # 0 outside the sets
        # the same micro-batch without the rules: verl's own computation, untouched
        mb0, logits0, args0, rolled0 = _packed_micro_batch(seed, tau=tau)
        out0 = eng.prepare_model_outputs(types.SimpleNamespace(logits=logits0), args0, mb0, None)
        sc = logits0[0] / torch.full((1,), tau)[:, None]
        assert torch.equal(out0["log_probs"].values(), verl_F.logprobs_from_logits(sc, rolled0))
        assert torch.equal(out0["entropy"].values(), verl_F.entropy_from_logits(sc))
    assert eng.compute_entropy_from_logits is verl_F.entropy_from_logits  # restored after each call


def test_verl_engine_refuses_paths_it_does_not_replay():
    plugin, eng = _engine()
    keys = {"gtpo_top_k": 5}
    mb, logits, args, _ = _packed_micro_batch(0, rules=keys, use_fused_kernels=True)
    with pytest.raises(NotImplementedError, match="use_fused_kernels=False"):
        eng.prepare_model_outputs(types.SimpleNamespace(logits=logits), args, mb, None)
    mb, logits, args, _ = _packed_micro_batch(0, rules=keys, use_remove_padding=False)
    with pytest.raises(NotImplementedError, match="use_remove_padding=True"):
        eng.prepare_model_outputs(types.SimpleNamespace(logits=logits), args, mb, None)


# ------------------------------------------------------------------ the gtpo trainer

def _trainer(rollout, gtpo=None):
    plugin = _verl()
    if plugin.GTPOTrainer is None:
        pytest.skip("verl's v1 trainer (TransferQueue) is not importable")
    from omegaconf import OmegaConf
    trainer = object.__new__(plugin.GTPOTrainer)
    v1 = {"trainer_mode": "gtpo"} if gtpo is None else {"trainer_mode": "gtpo", "gtpo": gtpo}
    trainer.config = OmegaConf.create({"trainer": {"v1": v1}, "actor_rollout_ref": {"rollout": rollout}})
    return plugin, trainer


def test_gtpo_trainer_puts_the_rules_in_each_log_prob_pass(monkeypatch):
    """The gtpo trainer's old-policy, reference and update passes carry the rollout's rules in the batch's
    extra_info (which verl hands every micro-batch); not when the rollout does not truncate or with
    replay_sampler=false; refused when this verl's engine cannot replay them."""
    _verl()
    from verl.trainer.ppo.v1 import PPOTrainerSync
    seen = {}
    for name in ("_compute_old_log_prob", "_compute_ref_log_prob", "_update_actor"):
        monkeypatch.setattr(PPOTrainerSync, name,
                            lambda self, batch, metrics, _n=name: seen.__setitem__(_n, dict(batch.extra_info)) or batch)

    class Batch:
        def __init__(self):
            self.extra_info = {"temperature": 0.7}

    rollout = {"temperature": 0.7, "top_k": 20, "top_p": 0.9}
    plugin, tr = _trainer(rollout, {"preset": "gtpo", "entropy_threshold": 0.7})
    for name in seen or ("_compute_old_log_prob", "_compute_ref_log_prob", "_update_actor"):
        getattr(tr, name)(Batch(), {})
    assert set(seen) == {"_compute_old_log_prob", "_compute_ref_log_prob", "_update_actor"}
    for info in seen.values():
        assert info == {"temperature": 0.7, "gtpo_top_k": 20, "gtpo_top_p": 0.9}
    assert plugin.gtpo_config_from(tr.config.trainer.v1.gtpo).entropy_threshold == 0.7
    for rollout, gtpo in (({"temperature": 0.7, "top_k": -1, "top_p": 1.0}, None),
                          (rollout, {"replay_sampler": False})):
        seen.clear()
        _, tr = _trainer(rollout, gtpo)
        tr._compute_old_log_prob(Batch(), {})
        assert seen["_compute_old_log_prob"] == {"temperature": 0.7}
    _, tr = _trainer(rollout, {"replay_sampler": "yes"})
    with pytest.raises(ValueError, match="replay_sampler must be true or false"):
        tr._compute_old_log_prob(Batch(), {})
    _, tr = _trainer(rollout)
    tr.config.actor_rollout_ref.actor = {"strategy": "megatron"}  # an engine the plugin does not patch
    with pytest.raises(RuntimeError, match=r"strategy \['fsdp', 'megatron'\]"):
        tr._compute_ref_log_prob(Batch(), {})
    monkeypatch.setattr(plugin, "ENGINE_REPLAY", False)
    _, tr = _trainer(rollout)
    with pytest.raises(RuntimeError, match="replay_sampler=false"):
        tr._update_actor(Batch(), {})


# ------------------------------------------------------------------ the chain: engine -> ppo_loss

def test_engine_log_probs_through_verl_ppo_loss_equal_gtpo_loss_with_the_rules():
    """The update pass end to end on one micro-batch: verl's engine (patched) turns the logits into log-probs
    over the kept sets, verl's ppo_loss with loss_mode=gtpo (old log-probs from the same engine on perturbed
    logits: an old policy) -> loss and the gradient w.r.t. the logits = gtpo_loss on the logits with the
    same temperature and top_k / top_p (the vanilla preset's clip and dual clip, verl's token-mean), and not
    the whole vocabulary's."""
    plugin, eng = _engine()
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig, PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss

    import gtpo_kernels
    rules, tau = dict(top_k=12, top_p=0.9), 0.7
    keys = {plugin.REPLAY_KEYS[k]: v for k, v in rules.items()}
    prompt_lens, resp_lens = (3, 2, 4), (6, 4, 5)
    lens = tuple(p + r for p, r in zip(prompt_lens, resp_lens))
    mb, logits, args, rolled = _packed_micro_batch(5, lens=lens, tau=tau, rules=keys)
    logits = logits.double()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        old_out = eng.prepare_model_outputs(types.SimpleNamespace(logits=logits + 0.3 * torch.randn(
            logits.shape, generator=g, dtype=F64)), args, mb, None)
    x = logits.clone().requires_grad_()
    out = eng.prepare_model_outputs(types.SimpleNamespace(logits=x), args, mb, None)
    # verl's data: per sequence the response tokens' log-probs are positions p-1 .. p+r-2 (rolled labels)
    B = len(lens)
    offs = [sum(lens[:i]) for i in range(B)]
    resp = [rolled[o + p - 1:o + p - 1 + r] for o, p, r in zip(offs, prompt_lens, resp_lens)]
    old = [old_out["log_probs"].values()[o + p - 1:o + p - 1 + r] for o, p, r in zip(offs, prompt_lens, resp_lens)]
    adv = torch.randn(B, generator=g, dtype=F64)
    nest = lambda rows: torch.nested.as_nested_tensor(rows, layout=torch.jagged)  # noqa: E731
    data = TensorDict({"prompts": nest([torch.ones(p, dtype=torch.long) for p in prompt_lens]),
                       "responses": nest(resp), "response_mask": nest([torch.ones(r) for r in resp_lens]),
                       "old_log_probs": nest(old),
                       "advantages": nest([adv[i].expand(r) for i, r in enumerate(resp_lens)])},
                      batch_size=[B])
    ntok = sum(resp_lens)
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=ntok, global_batch_size=B)
    cfg = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size=2, clip_ratio=0.2, loss_agg_mode="token-mean",
                      policy_loss=PolicyLossConfig(loss_mode="gtpo"), entropy_coeff=0.0, use_kl_loss=False)
    loss_v, _ = ppo_loss(cfg, {"log_probs": out["log_probs"]}, data)
    loss_v.backward()
    # gtpo_loss on the same logits: rows of the response tokens, (B, T) padded
    T = max(resp_lens)
    V = logits.shape[-1]
    lg = torch.zeros(B, T, V, dtype=F64)
    ids = torch.zeros(B, T, dtype=torch.long)
    old_p = torch.zeros(B, T, dtype=F64)
    m = torch.zeros(B, T)
    for i, (o, p, r) in enumerate(zip(offs, prompt_lens, resp_lens)):
        lg[i, :r], ids[i, :r], old_p[i, :r], m[i, :r] = logits[0, o + p - 1:o + p - 1 + r], resp[i], old[i], 1
    y = lg.clone().requires_grad_()
    kw = dict(old_logps=old_p, config=gtpo_kernels.GTPOConfig.preset("vanilla", eps_low=0.2, eps_high=0.2,
                                                                     dual_clip_c=3.0, loss_agg="token-mean"),
              temperature=tau)
    want = gtpo_kernels.gtpo_loss(y, ids, adv, m, **kw, **rules)
    want.loss.backward()
    assert _rel(loss_v.detach(), want.loss.detach()) <= 1e-6
    gx = torch.stack([x.grad[0, o + p - 1:o + p - 1 + r].new_zeros(T, V).index_copy(
        0, torch.arange(r), x.grad[0, o + p - 1:o + p - 1 + r]) for o, p, r in zip(offs, prompt_lens, resp_lens)])
    assert float((gx - y.grad).abs().max()) <= 1e-6 * max(1.0, float(y.grad.abs().max()))
    full = gtpo_kernels.gtpo_loss(lg, ids, adv, m, **kw)
    assert abs(float(full.loss.detach()) - float(want.loss.detach())) > 1e-3
