"""GTPO with AReaL's own code (skipped without AReaL; CI installs it `--no-deps` with what the tested
modules import, in an environment of its own: AReaL pins torch<2.11). On a packed micro-batch in AReaL's
layout (log-probs of input_ids rolled by one, rolled loss_mask, cu_seqlens), `make_loss_fn`'s loss equals
AReaL's stock `grpo_loss_fn` (float32: AReaL's stats tracker refuses float64; value and gradient) with GTPO's options off; with them on, the
conflict weights computed at advantage time travel in the data (`gtpo_lam`) and the entropies AReaL
passes reach the filter: equal to gtpo_loss_from_logps on the same completions. The loss functions are
called as AReaL's engine calls them, `loss_fn(logprobs, entropy, mb_input)`, and through AReaL's own
dispatch: its FSDPEngine.train_batch on a tiny Qwen2 on CPU (AReaL's CPU platform, gloo, world size 1),
the gradients of the model's parameters equal to those of its stock grpo_loss_fn (those tests need peft
and accelerate, which areal.engine.fsdp_engine imports, and skip without them)."""
from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("areal.trainer.ppo.actor")

from areal.trainer.ppo.actor import grpo_loss_fn  # noqa: E402
from gtpo_kernels import GTPOConfig, gtpo_loss_from_logps  # noqa: E402
from gtpo_kernels.integrations import areal as ga  # noqa: E402


def _batch(g, n_groups=2, group_size=3, V=4):
    """Padded rows prompt + completion (AReaL's rollout layout), advantages one value per row at the
    rolled loss_mask, then the packed micro-batch (1-D, cu_seqlens) of the same rows."""
    B = n_groups * group_size
    P = [int(torch.randint(2, 4, (1,), generator=g)) for _ in range(B)]
    C = [int(torch.randint(2, 6, (1,), generator=g)) for _ in range(B)]
    T = max(p + c for p, c in zip(P, C))
    ids = torch.zeros(B, T, dtype=torch.long)
    lm = torch.zeros(B, T)
    for i in range(B):
        ids[i, :P[i] + C[i]] = torch.randint(0, V, (P[i] + C[i],), generator=g)
        lm[i, P[i]:P[i] + C[i]] = 1
    lm = torch.roll(lm, -1, dims=-1)  # as AReaL's advantage step rolls it
    adv = torch.randn(B, generator=g, dtype=torch.float64)[:, None] * lm.double()
    data = {"input_ids": ids, "loss_mask": lm, "advantages": adv}
    return data, P, C


def _pack(data, P, C, g, dt=torch.float64):
    lens = [p + c for p, c in zip(P, C)]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    mb = {k: torch.cat([v[i, :n] for i, n in enumerate(lens)]) for k, v in data.items()}
    mb["cu_seqlens"] = cu
    N = int(cu[-1])
    mb["advantages"] = mb["advantages"].to(dt)
    mb["logprobs"] = -torch.rand(N, generator=g, dtype=dt) * 2
    mb["prox_logp"] = mb["logprobs"].clone()
    logp = (mb["logprobs"] + 0.4 * torch.randn(N, generator=g, dtype=dt)).requires_grad_(True)
    ent = torch.rand(N, generator=g, dtype=dt) * 2
    return mb, logp, ent


def test_loss_fn_equals_arealss_grpo_loss_fn():
    g = torch.Generator().manual_seed(6)
    data, P, C = _batch(g)
    mb, logp, ent = _pack(data, P, C, g, torch.float32)  # AReaL's stats tracker takes float32 only
    loss_fn, weight_fn = ga.make_loss_fn(eps_clip=0.2, eps_clip_higher=0.28, config="grpo")
    ours = loss_fn(logp, ent, mb)
    (g1,) = torch.autograd.grad(ours, logp)
    stock_fn = functools.partial(grpo_loss_fn, eps_clip=0.2, eps_clip_higher=0.28, c_clip=None)
    stock = stock_fn(logp, ent, dict(mb, loss_mask=mb["loss_mask"].bool()))
    (g2,) = torch.autograd.grad(stock, logp)
    assert g2.abs().sum() > 0
    assert abs(float(ours) - float(stock)) <= 1e-6 * max(1.0, abs(float(stock)))
    torch.testing.assert_close(g1, g2, atol=1e-6, rtol=1e-5)
    assert int(weight_fn(mb)) == int(mb["loss_mask"].count_nonzero())  # AReaL's own weight for token-mean


@pytest.mark.parametrize("c_clip", [3.0, 1.5])
def test_dual_clip_equals_areals(c_clip):
    """make_loss_fn(c_clip=) = AReaL's grpo_loss_fn with the same c_clip, with ratios where it binds."""
    g = torch.Generator().manual_seed(int(c_clip * 10))
    data, P, C = _batch(g)
    mb, logp, ent = _pack(data, P, C, g, torch.float32)
    with torch.no_grad():  # negative advantages and ratios far above c_clip on the first tokens
        mb["advantages"] = -mb["advantages"].abs() - 0.5  # per completion still: one value each
        logp[:40] = mb["prox_logp"][:40] + 2.0
    loss_fn, _ = ga.make_loss_fn(eps_clip=0.2, eps_clip_higher=0.28, config="grpo", c_clip=c_clip)
    ours = loss_fn(logp, ent, mb)
    (g1,) = torch.autograd.grad(ours, logp)
    stock = functools.partial(grpo_loss_fn, eps_clip=0.2, eps_clip_higher=0.28, c_clip=c_clip)(
        logp, ent, dict(mb, loss_mask=mb["loss_mask"].bool()))
    (g2,) = torch.autograd.grad(stock, logp)
    plain = functools.partial(grpo_loss_fn, eps_clip=0.2, eps_clip_higher=0.28, c_clip=None)(
        logp, ent, dict(mb, loss_mask=mb["loss_mask"].bool()))
    assert abs(float(plain) - float(stock)) > 1e-3  # the dual clip binds
    assert abs(float(ours) - float(stock)) <= 1e-6 * max(1.0, abs(float(stock)))
    torch.testing.assert_close(g1, g2, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="c_clip must be a number > 1"):
        ga.make_loss_fn(c_clip=0.5)
    with pytest.raises(ValueError, match=r"eps_clip_higher \(or eps_clip\) \(GTPOConfig\.eps_high\) must be in"):
        ga.make_loss_fn(eps_clip=0.2, eps_clip_higher=1.5)  # the PPO clip's range: named by AReaL's setting


def test_conflict_weights_and_entropies_reach_the_loss():
    g = torch.Generator().manual_seed(9)
    data, P, C = _batch(g)
    ga.add_conflict_weights(data, group_size=3, config="gtpo")
    mb, logp, ent = _pack(data, P, C, g)
    cfg = GTPOConfig.preset("gtpo", entropy_threshold=1.0, eps_high=0.28)
    loss_fn, _ = ga.make_loss_fn(eps_clip=0.2, eps_clip_higher=0.28, config=cfg)
    ours = loss_fn(logp, ent, mb)
    (g1,) = torch.autograd.grad(ours, logp)
    # the same completions, left-aligned (B, Cmax), conflict weights computed by the package from the groups
    B, Cm = len(C), max(C)
    ids = torch.zeros(B, Cm, dtype=torch.long)
    m = torch.zeros(B, Cm, dtype=torch.bool)
    lp = torch.zeros(B, Cm, dtype=torch.float64)
    old = torch.zeros(B, Cm, dtype=torch.float64)
    H = torch.zeros(B, Cm, dtype=torch.float64)
    starts = mb["cu_seqlens"][:-1].tolist()
    rows = []
    for i in range(B):
        s = starts[i] + P[i] - 1  # position predicting the first completion token
        sl = slice(s, s + C[i])
        ids[i, :C[i]] = data["input_ids"][i, P[i]:P[i] + C[i]]
        m[i, :C[i]] = True
        old[i, :C[i]], H[i, :C[i]] = mb["prox_logp"][sl], ent[sl]
        rows.append(sl)
    lp = torch.stack([torch.cat([logp[sl], logp.new_zeros(Cm - C[i])]) for i, sl in enumerate(rows)])
    adv = data["advantages"].sum(1) / data["loss_mask"].sum(1).double()
    want = gtpo_loss_from_logps(lp, ids, adv, m, entropy=H, old_logps=old, group_size=3,
                                config=cfg.replace(eps_low=0.2, loss_agg="token-mean"))
    (g2,) = torch.autograd.grad(want.loss, logp)
    lam = data["gtpo_lam"]
    assert ((lam != 1) & data["loss_mask"].bool()).any(), "no conflict token: the test would not see the weights"
    hbar = torch.stack([H[i, :C[i]].mean() for i in range(B)])
    assert (hbar > 1.0).any() and (hbar < 1.0).any(), "the entropy filter must keep some completions, drop others"
    assert g2.abs().sum() > 0
    assert abs(float(ours) - float(want.loss)) <= 1e-6 * max(1.0, abs(float(want.loss)))
    torch.testing.assert_close(g1, g2, atol=1e-6, rtol=1e-6)


# ---- through AReaL's own dispatch: FSDPEngine.train_batch on a tiny Qwen2, CPU, gloo, world size 1 ----
# AReaL's CPU platform (areal/infra/platforms/cpu.py: device "cpu", backend "gloo") runs its FSDP2 engine
# unchanged; the settings: attn_impl="sdpa" (no flash-attn), dtype float32, lr 0 and no clipping (the
# gradients are compared after its optimizer step). Micro-batching, packing, the loss-weight normalization,
# the log-prob/entropy gather and the loss_fn call are AReaL's (FSDPEngine.train_batch ->
# _compute_logprobs_and_loss). With sdpa a packed micro-batch's rows attend across their boundaries
# (AReaL hands HF an attention_mask of None, cu_seqlens being flash-attn's): the same forward for both
# losses, and n_mbs=6 puts one row in each micro-batch.

@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    pytest.importorskip("peft")  # areal.engine.fsdp_engine imports peft (and peft accelerate) at the top
    pytest.importorskip("accelerate")
    import os
    import socket

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from areal.api.cli_args import OptimizerConfig, TrainEngineConfig
    from areal.api.io_struct import FinetuneSpec
    from areal.engine.fsdp_engine import FSDPEngine

    if torch.cuda.is_available():
        pytest.skip("the CPU platform is AReaL's choice only where no CUDA device is seen")
    d = str(tmp_path_factory.mktemp("tiny_qwen2"))
    V = 16
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=False)).save_pretrained(d)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t1", pad_token="t0").save_pretrained(d)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.MonkeyPatch.context() as mp:
        for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(port)).items():
            mp.setenv(k, v)
        eng = FSDPEngine(TrainEngineConfig(
            experiment_name="gtpo", trial_name="test", path=d, attn_impl="sdpa", dtype="float32",
            optimizer=OptimizerConfig(lr=0.0, weight_decay=0.0, gradient_clipping=1e30), backend="fsdp:d1"))
        eng.create_process_group()
        eng.initialize(None, FinetuneSpec(total_train_epochs=1, dataset_size=6, train_batch_size=6))
        yield eng, V
        eng.destroy()


def _engine_batch(eng, V, g, B=6, shared_start=False):
    """AReaL's padded batch after its advantage step: input_ids, attention_mask, the rolled loss_mask and
    advantages, and old = proximal log-probs near the engine's own (so that some ratios clip)."""
    P = [int(torch.randint(2, 4, (1,), generator=g)) for _ in range(B)]
    C = [int(torch.randint(2, 6, (1,), generator=g)) for _ in range(B)]
    T = max(p + c for p, c in zip(P, C))
    ids = torch.zeros(B, T, dtype=torch.long)
    am = torch.zeros(B, T, dtype=torch.bool)
    lm = torch.zeros(B, T, dtype=torch.int32)
    for i in range(B):
        ids[i, :P[i] + C[i]] = torch.randint(2, V, (P[i] + C[i],), generator=g)
        am[i, :P[i] + C[i]] = True
        lm[i, P[i]:P[i] + C[i]] = 1
        if shared_start:  # every completion opens with the same token: conflicts where a group's signs differ
            ids[i, P[i]] = 2
    lm = torch.roll(lm, -1, dims=-1)
    adv = (torch.randn(B, generator=g)[:, None] * lm).float()
    data = dict(input_ids=ids, attention_mask=am, loss_mask=lm, advantages=adv)
    cur = eng.forward_batch(data)  # AReaL's own log-probs, (B, T), rolled
    old = ((cur + 0.3 * torch.randn(cur.shape, generator=g)) * am).float()
    data.update(logprobs=old, prox_logp=old.clone())
    return data


def _train(eng, data, loss_fn, weight_fn):
    seen = []

    def recorded(logprobs, entropy, mb_input, **kw):  # records what AReaL passes and what the loss returns
        out = loss_fn(logprobs, entropy, mb_input, **kw)
        seen.append((float(out.detach()), set(mb_input)))
        return out

    eng.export_stats()  # AReaL's stats tracker, emptied (its trainer exports once a step)
    stats = eng.train_batch({k: v.clone() for k, v in data.items()}, loss_fn=recorded, loss_weight_fn=weight_fn)
    stats["tracked"] = eng.export_stats()
    grads = {n: p.grad.full_tensor().clone() for n, p in eng.model.named_parameters()}
    return stats, seen, grads


@pytest.mark.parametrize("n_mbs", [2, 6])
def test_train_batch_equals_areals_grpo(engine, n_mbs):
    """engine.train_batch(loss_fn=make_loss_fn(...)) = engine.train_batch(loss_fn=grpo_loss_fn, AReaL's
    actor's loss_weight_fn): the gradient of every parameter, the losses of the micro-batches, the stats."""
    from areal.api.cli_args import MicroBatchSpec

    eng, V = engine
    eng.config.mb_spec = MicroBatchSpec(n_mbs=n_mbs)
    data = _engine_batch(eng, V, torch.Generator().manual_seed(n_mbs))
    lf, wf = ga.make_loss_fn(eps_clip=0.2, eps_clip_higher=0.28, config="grpo")
    s1, seen1, g1 = _train(eng, data, lf, wf)
    stock = functools.partial(grpo_loss_fn, eps_clip=0.2, eps_clip_higher=0.28, c_clip=None)
    s2, seen2, g2 = _train(eng, data, stock, lambda x: x["loss_mask"].count_nonzero())  # AReaL's actor's
    assert s1["num_micro_batches"] == s2["num_micro_batches"] == len(seen1) == len(seen2) > 1
    assert all("cu_seqlens" in keys for _, keys in seen1)  # AReaL's packed micro-batches
    for (a, _), (b, _) in zip(seen1, seen2):
        assert abs(a - b) <= 1e-6 * max(1.0, abs(b))
    assert s2["grad_norm"] > 0
    # AReaL's stats tracker: grpo_loss_fn logs actor_loss, clip_ratio, importance_weight, ...; make_loss_fn
    # logs nothing there (not compared); what train_batch returns is compared
    assert "actor_loss/avg" in s2.pop("tracked") and s1.pop("tracked") == {}
    for k in s2:
        assert abs(s1[k] - s2[k]) <= 1e-6 * max(1.0, abs(s2[k])), k
    for n in g2:
        assert g2[n].norm() > 0, n
        assert float((g1[n] - g2[n]).norm() / g2[n].norm()) <= 1e-6, n


def test_train_batch_carries_gtpo_lam(engine):
    """With GTPO on, AReaL's packing carries data['gtpo_lam'] to the loss, and the gradient differs from GRPO's."""
    from areal.api.cli_args import MicroBatchSpec

    eng, V = engine
    eng.config.mb_spec = MicroBatchSpec(n_mbs=2)
    data = _engine_batch(eng, V, torch.Generator().manual_seed(11), shared_start=True)
    ga.add_conflict_weights(data, group_size=3, config="gtpo")
    assert ((data["gtpo_lam"] != 1) & data["loss_mask"].bool()).any()
    lf, wf = ga.make_loss_fn(eps_clip=0.2, eps_clip_higher=0.28, config="gtpo")
    _, seen, g1 = _train(eng, data, lf, wf)
    assert all("gtpo_lam" in keys for _, keys in seen)
    lf0, wf0 = ga.make_loss_fn(eps_clip=0.2, eps_clip_higher=0.28, config="grpo")
    _, _, g0 = _train(eng, data, lf0, wf0)
    assert all(torch.isfinite(g).all() for g in g1.values())
    assert max(float((g1[n] - g0[n]).norm() / g0[n].norm()) for n in g0) > 1e-3
