"""The TRL adapter on other model shapes and budgets: a soft-capped, tied-embedding Gemma 2, a mixture
of experts with its auxiliary loss under bf16 autocast, the head's scaling read from the model's config
as TRL reads it, and one step's resident peak with the fused head against the stock trainer's. Tiny
models on the CPU (trl_setup.py); skipped without TRL."""
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gtpo_kernels
from trl_setup import ROOT, _old_logps_both, _trl_setup, needs_trl, tiny_model, tiny_tokenizer
from trl_setup import _one_torch_thread, head_spy  # noqa: F401 (fixtures)


def tiny_gemma2(vocab_size, softcap, seed=0):
    """Gemma 2: tied embeddings, final logit softcapping (read from the config by both heads)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(seed)
    cfg = Gemma2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                       final_logit_softcapping=softcap, pad_token_id=0, bos_token_id=1, eos_token_id=1,
                       tie_word_embeddings=True)
    m = Gemma2ForCausalLM(cfg)
    with torch.no_grad():  # logits of a few units, so that a softcap of 1.5 bends them
        m.get_output_embeddings().weight.mul_(40.0)
    return m


@needs_trl
def test_trl_softcapped_tied_model_equals_stock(tmp_path, head_spy):
    """A Gemma-2-style model (tied input/output embeddings, final_logit_softcapping): the fused head
    reads the softcap from the config and the weight through the tied head, as TRL's head does; loss,
    gradients (the tied matrix gets both contributions) and the old-policy pass equal the stock trainer."""
    from trl import GRPOConfig, GRPOTrainer
    from gtpo_kernels.integrations.trl import GTPOTrainer, GTPOTrainerConfig, _head_scaling
    V = len(tiny_tokenizer())
    model = tiny_gemma2(V, softcap=1.5)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    common = dict(temperature=0.7, bf16=False)
    ours = _trl_setup(tmp_path, GTPOTrainer, GTPOTrainerConfig, model=copy.deepcopy(model), gtpo_loss=None, **common)
    stock = _trl_setup(tmp_path, GRPOTrainer, GRPOConfig, model=copy.deepcopy(model), loss_type="grpo", **common)
    g = torch.Generator().manual_seed(5)
    B, P, T = 6, 4, 7
    m = torch.ones(B, T, dtype=torch.long)
    m[1, 3:] = 0
    batch = dict(prompt_ids=torch.randint(3, V, (B, P), generator=g), prompt_mask=torch.ones(B, P, dtype=torch.long),
                 completion_ids=torch.randint(3, V, (B, T), generator=g) * m, completion_mask=m,
                 advantages=torch.randn(B, generator=g), num_items_in_batch=m.sum().float())
    (lp, _, _), (lp_t, _, _) = _old_logps_both(ours, batch, batch_size=None)
    torch.testing.assert_close(lp, lp_t, rtol=1e-5, atol=1e-5)
    batch["old_per_token_logps"] = lp + 0.3 * torch.randn(lp.shape, generator=g)
    res = []
    for tr in (ours, stock):
        tr.current_gradient_accumulation_steps = 1
        tr.model.train()
        tr.model.zero_grad(set_to_none=True)
        loss = tr._compute_loss(tr.model, batch)
        loss.backward()
        res.append((loss.detach(), [p.grad.clone() for p in tr.model.parameters()]))
    (lo, go), (ls, gs) = res
    assert head_spy["linear_gtpo_loss"] == 1
    assert abs((lo - ls).item()) < 1e-5 * abs(ls.item())
    for p, q in zip(go, gs):
        assert (p - q).norm() <= 1e-5 * q.norm().clamp(min=1e-30)
    # the softcap matters here: without it the log-probs move
    with torch.no_grad():
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        h = ours.model.model(input_ids=ids).last_hidden_state[:, P - 1:-1]
        raw, _ = gtpo_kernels.linear_token_logprobs(h, ours.model.lm_head.weight, batch["completion_ids"], 0.7, m)
    assert (raw - lp).abs().max() > 1e-2
    assert _head_scaling(ours.model.config) == (1.0, 1.5)


def _one_step(tmp_path, trainer_cls, args_cls, model, batch, **kw):
    """(loss, flat parameter gradient) of one _compute_loss forward + backward on a fresh trainer."""
    tr = _trl_setup(tmp_path, trainer_cls, args_cls, model=copy.deepcopy(model), **kw)
    tr.current_gradient_accumulation_steps = 1
    tr.model.train()
    tr.model.zero_grad(set_to_none=True)
    loss = tr._compute_loss(tr.model, batch)
    loss.backward()
    return loss.detach().double(), torch.cat([p.grad.flatten().double() for p in tr.model.parameters()]), tr


def _small_batch(V, seed=5, B=6, P=4, T=7):
    g = torch.Generator().manual_seed(seed)
    m = torch.ones(B, T, dtype=torch.long)
    m[1, 3:] = 0
    return dict(prompt_ids=torch.randint(3, V, (B, P), generator=g), prompt_mask=torch.ones(B, P, dtype=torch.long),
                completion_ids=torch.randint(3, V, (B, T), generator=g) * m, completion_mask=m,
                advantages=torch.randn(B, generator=g), num_items_in_batch=m.sum().float())


@needs_trl
def test_trl_moe_aux_loss_and_bf16_autocast(tmp_path):
    """A tiny Mixtral (router_aux_loss_coef): the fused head's backbone forward returns the router logits
    and the load-balancing loss is TRL's (loss, gradients, aux metric equal the stock trainer). Under
    bf16 autocast the head runs in bf16 like autocast's own LM head: the fused head equals the logits
    head and stays within bf16 error of the float32 gradient, as TRL's does."""
    from transformers import MixtralConfig, MixtralForCausalLM
    from trl import GRPOConfig, GRPOTrainer
    from gtpo_kernels.integrations.trl import GTPOTrainer, GTPOTrainerConfig
    V = len(tiny_tokenizer())
    torch.manual_seed(0)
    moe = MixtralForCausalLM(MixtralConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                           num_experts_per_tok=2, max_position_embeddings=64, pad_token_id=0,
                                           bos_token_id=1, eos_token_id=1, router_aux_loss_coef=0.02))
    batch = _small_batch(V)
    lo, go, ours = _one_step(tmp_path, GTPOTrainer, GTPOTrainerConfig, moe, batch, gtpo_loss=None, bf16=False)
    ls, gs, stock = _one_step(tmp_path, GRPOTrainer, GRPOConfig, moe, batch, loss_type="grpo", bf16=False)
    assert ours.aux_loss_enabled and ours._metrics["train"]["aux_loss"] == stock._metrics["train"]["aux_loss"]
    assert abs(lo - ls) < 1e-5 * abs(ls) and (go - gs).norm() < 1e-5 * gs.norm()
    dense = tiny_model(V)
    _, truth, _ = _one_step(tmp_path, GRPOTrainer, GRPOConfig, dense, batch, loss_type="grpo", bf16=False)
    _, g_trl, _ = _one_step(tmp_path, GRPOTrainer, GRPOConfig, dense, batch, loss_type="grpo", bf16=True)
    _, g_fused, _ = _one_step(tmp_path, GTPOTrainer, GTPOTrainerConfig, dense, batch, gtpo_loss=None, bf16=True)
    _, g_logits, _ = _one_step(tmp_path, GTPOTrainer, GTPOTrainerConfig, dense, batch, gtpo_loss=None, bf16=True,
                               gtpo_head="logits")
    err = {k: ((g - truth).norm() / truth.norm()).item() for k, g in
           (("trl", g_trl), ("fused", g_fused), ("logits", g_logits))}
    assert (g_fused - g_logits).norm() <= 1e-5 * g_logits.norm(), err
    assert 0 < err["fused"] < 1e-2 and err["trl"] < 1e-2, err


def test_trl_head_scaling_reads_configs_as_trl():
    from types import SimpleNamespace as C
    pytest.importorskip("trl")
    from gtpo_kernels.integrations.trl import _head_scaling
    assert _head_scaling(C()) == (1.0, None)
    assert _head_scaling(C(logit_scale=0.0625)) == (0.0625, None)  # Cohere
    assert _head_scaling(C(logit_scale=None, output_multiplier=2.0)) == (2.0, None)
    assert _head_scaling(C(lm_head_multiplier=0.5)) == (0.5, None)  # Falcon-H1
    assert _head_scaling(C(logits_scaling=8.0, model_type="granite")) == (0.125, None)
    assert _head_scaling(C(logits_scaling=8.0, model_type="hyperclovax")) == (8.0, None)
    assert _head_scaling(C(final_logit_softcapping=30.0)) == (1.0, 30.0)


# one training step's loss forward + backward on a tiny model whose logits dominate (V = 32000, D = 32):
# the resident peak above the state before the step, for each head and TRL's stock trainer
_TRL_MEM_SCRIPT = r"""
import gc, json, pathlib, sys, tempfile
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)
from transformers import LlamaConfig, LlamaForCausalLM
from trl import GRPOConfig, GRPOTrainer
from gtpo_kernels.integrations.trl import GTPOTrainer, GTPOTrainerConfig
from trl_setup import _trl_setup
V, D, B, P, T = 32000, 32, 8, 8, 64
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
        bos_token_id=1, eos_token_id=1, tie_word_embeddings=False))
def batch(b, p, t):
    g = torch.Generator().manual_seed(1)
    return dict(prompt_ids=torch.randint(3, V, (b, p), generator=g), prompt_mask=torch.ones(b, p, dtype=torch.long),
                completion_ids=torch.randint(3, V, (b, t), generator=g),
                completion_mask=torch.ones(b, t, dtype=torch.long), advantages=torch.randn(b, generator=g),
                num_items_in_batch=torch.tensor(float(b * t)))
def status(key):  # bytes, from the kB lines of /proc/self/status
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
tmp = pathlib.Path(tempfile.mkdtemp())
common = dict(bf16=False, max_completion_length=T, temperature=1.0)
for kind in sys.argv[2:]:
    if kind == "stock":
        tr = _trl_setup(tmp, GRPOTrainer, GRPOConfig, model=model(), loss_type="grpo", **common)
    else:
        tr = _trl_setup(tmp, GTPOTrainer, GTPOTrainerConfig, model=model(), gtpo_loss=None, gtpo_head=kind, **common)
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1
    def step(bt):
        tr.model.zero_grad(set_to_none=True)
        tr._compute_loss(tr.model, bt).backward()
    step(batch(2, 3, 4))  # every code path loaded
    big = batch(B, P, T)
    tr.model.zero_grad(set_to_none=True)
    gc.collect()
    open("/proc/self/clear_refs", "w").write("5")  # reset the resident high-water mark (VmHWM) to now
    before = status("VmRSS:")
    step(big)
    print(json.dumps({"kind": kind, "peak": status("VmHWM:") - before, "logits_bytes": B * T * V * 4}))
    del tr
    gc.collect()
"""


@needs_trl
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_trl_fused_head_peak_memory_at_most_stock():
    """One training step (the loss's forward and backward) on a tiny Llama with V = 32000, D = 32,
    8 completions of 64 tokens (logits: 65.5 MB in float32): the resident peak with the fused head is at
    most TRL's stock GRPOTrainer's (its own chunked LM head) and below our logits head's."""
    # a fixed mmap threshold: glibc returns every freed large buffer at once, so the resident peak
    # measures live memory rather than the allocator's reuse pattern
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576")
    r = subprocess.run([sys.executable, "-c", _TRL_MEM_SCRIPT, str(ROOT / "tests"), "stock", "fused", "logits"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    res = {d["kind"]: d for d in (json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{"))}
    mb = {k: v["peak"] / 1e6 for k, v in res.items()}
    print(f"\none training step's resident peak (loss forward + backward), in MB above the memory before the step: "
          f"GTPOTrainer with the fused head {mb['fused']:.1f}; GTPOTrainer on the model's logits {mb['logits']:.1f}; "
          f"TRL's stock GRPOTrainer (its own chunked head) {mb['stock']:.1f}. For scale, the logits tensor "
          f"(8 x 64 x 32000 float32) is {res['fused']['logits_bytes'] / 1e6:.1f} MB")
    assert res["fused"]["peak"] <= res["stock"]["peak"], mb
    assert res["fused"]["peak"] < res["logits"]["peak"], mb
