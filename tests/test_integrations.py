"""gtpo_loss in training loops: the TRL adapter, examples/train_loop.py and the toy RL demo.

Everything runs on the CPU with tiny randomly initialised models and a tokenizer built here (no hub).
The TRL tests need the optional extra (`pip install gtpo-kernels[trl]`) and are skipped without it;
train_loop needs transformers; the demo needs only torch (matplotlib for its PNG).
"""
import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gtpo_kernels
from gtpo_kernels import dispatch

ROOT = Path(__file__).resolve().parents[1]
HAVE_TRL = importlib.util.find_spec("trl") is not None
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_trl = pytest.mark.skipif(not HAVE_TRL, reason="TRL is not installed: pip install 'gtpo-kernels[trl]' "
                                                    "(the TRL adapter tests need it)")
needs_transformers = pytest.mark.skipif(not HAVE_TRANSFORMERS,
                                        reason="transformers is not installed (examples/train_loop.py needs it)")


# ---------------------------------------------------------------- tiny model and tokenizer (no downloads)

CHARS = list("0123456789+=<>/abcdefghijklmnopqrstuvwxyz ")


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for c in CHARS:
        vocab.setdefault(c, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_model(vocab_size, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=0, bos_token_id=1, eos_token_id=1, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def reward_count_digits(completions, **kwargs):
    """A rule-based reward with spread inside groups: the number of digits in the completion."""
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def _trl_setup(tmp_path, trainer_cls, args_cls, seed=0, model=None, **args_kw):
    from datasets import Dataset
    tok = tiny_tokenizer()
    model = tiny_model(len(tok), seed) if model is None else model
    ds = Dataset.from_dict({"prompt": ["1+2=", "3+4=", "5+1=", "2+2=", "7+1=", "4+4="]})
    kw = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
              max_completion_length=8, max_steps=3, logging_steps=1, report_to=[], use_cpu=True,
              save_strategy="no", learning_rate=1e-3, seed=seed, temperature=1.0)
    kw.update(args_kw)
    args = args_cls(**kw)
    return trainer_cls(model=model, reward_funcs=reward_count_digits, args=args, train_dataset=ds,
                       processing_class=tok)


@pytest.fixture
def kernel_spy(monkeypatch):
    """Counts calls of the fused vocabulary forward (our kernel) and of any log_softmax."""
    calls = {"vocab_fwd": 0, "log_softmax_in_loss": 0}
    orig = dispatch.vocab_fwd

    def spy(*a, **k):
        calls["vocab_fwd"] += 1
        return orig(*a, **k)
    monkeypatch.setattr(dispatch, "vocab_fwd", spy)
    return calls


# ---------------------------------------------------------------- TRL

@needs_trl
def test_trl_trainer_trains_with_our_kernel(tmp_path, kernel_spy, monkeypatch):
    from gtpo_kernels.integrations.trl import GTPOTrainer, GTPOTrainerConfig
    # gradient accumulation 2 with one generation per 2 micro-batches: the weights are computed on the
    # whole generation batch, then shuffled and split by TRL
    tr = _trl_setup(tmp_path, GTPOTrainer, GTPOTrainerConfig, per_device_train_batch_size=4,
                    gradient_accumulation_steps=2, gtpo_loss="gtpo",
                    gtpo_kwargs={"entropy_threshold": 5.0})  # tiny random model: entropy ~3.4 nats

    # no log_softmax anywhere inside our loss computation
    inside = {"on": False}
    orig_ls = torch.Tensor.log_softmax
    orig_fls = torch.nn.functional.log_softmax

    def no_ls(fn):
        def wrapped(*a, **k):
            if inside["on"]:
                kernel_spy["log_softmax_in_loss"] += 1
            return fn(*a, **k)
        return wrapped
    monkeypatch.setattr(torch.Tensor, "log_softmax", no_ls(orig_ls))
    monkeypatch.setattr(torch.nn.functional, "log_softmax", no_ls(orig_fls))
    monkeypatch.setattr(torch, "log_softmax", no_ls(torch.log_softmax))
    orig_cl = tr._compute_loss

    def compute_loss_watched(model, inputs):
        assert "gtpo_lam" in inputs and inputs["gtpo_lam"].shape == inputs["completion_ids"].shape
        inside["on"] = True
        try:
            return orig_cl(model, inputs)
        finally:
            inside["on"] = False
    monkeypatch.setattr(tr, "_compute_loss", compute_loss_watched)

    before = [p.detach().clone() for p in tr.model.parameters()]
    tr.train()
    assert tr._gtpo_calls == 6  # 3 optimizer steps x 2 micro-batches
    assert kernel_spy["vocab_fwd"] >= tr._gtpo_calls
    assert kernel_spy["log_softmax_in_loss"] == 0
    logs = [h for h in tr.state.log_history if "gtpo/conflict_frac" in h]
    assert len(logs) == 3
    for h in logs:
        for key in ("entropy", "gtpo/clip_frac", "gtpo/filtered_frac", "gtpo/conflict_frac", "gtpo/mean_entropy"):
            assert key in h and h[key] == h[key], key  # present, not NaN
        assert 0.0 <= h["gtpo/conflict_frac"] <= 1.0 and h["entropy"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, tr.model.parameters())), "no parameter moved"


@needs_trl
def test_trl_grpo_preset_equals_stock_loss(tmp_path, kernel_spy):
    """gtpo_loss='grpo' gives TRL's loss_type='grpo' loss and gradient on the same batch (off-policy
    old log-probs and temperature 0.7, so the clip and the temperature both matter)."""
    from trl import GRPOConfig, GRPOTrainer
    from gtpo_kernels.integrations.trl import GTPOTrainer, GTPOTrainerConfig
    tok = tiny_tokenizer()
    model = tiny_model(len(tok), seed=1)
    common = dict(temperature=0.7, epsilon=0.2, epsilon_high=0.25, bf16=False)  # float32: exact comparison
    ours = _trl_setup(tmp_path, GTPOTrainer, GTPOTrainerConfig, model=copy.deepcopy(model),
                      gtpo_loss="grpo", **common)
    stock = _trl_setup(tmp_path, GRPOTrainer, GRPOConfig, model=copy.deepcopy(model), loss_type="grpo", **common)
    for tr in (ours, stock):
        tr.model.train()
        tr.current_gradient_accumulation_steps = 1

    prompts = [{"prompt": p} for p in ["1+2=", "3+4="] for _ in range(4)]
    torch.manual_seed(0)
    batch = ours._generate_and_score_completions(prompts)
    assert batch["advantages"].abs().sum() > 0, "degenerate batch: every advantage is 0"
    # an off-policy batch: old log-probs moved away from the current ones so that some ratios clip
    T = batch["completion_ids"].size(1)
    with torch.no_grad():
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        am = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        logits = ours.model(input_ids=ids, attention_mask=am, logits_to_keep=T + 1).logits
        lp, _ = gtpo_kernels.token_logprobs(logits, batch["completion_ids"], 0.7, batch["completion_mask"])
    g = torch.Generator().manual_seed(3)
    batch["old_per_token_logps"] = lp + 0.4 * torch.randn(lp.shape, generator=g)

    calls0 = kernel_spy["vocab_fwd"]
    loss_ours = ours._compute_loss(ours.model, batch)
    assert kernel_spy["vocab_fwd"] > calls0, "gtpo_loss's vocabulary kernel did not run"
    loss_stock = stock._compute_loss(stock.model, batch)
    loss_ours.backward()
    loss_stock.backward()
    assert abs(loss_ours.item()) > 1e-4
    torch.testing.assert_close(loss_ours, loss_stock, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(ours.model.named_parameters(), stock.model.parameters()):
        rel = ((p.grad - q.grad).norm() / q.grad.norm().clamp(min=1e-30)).item()
        assert rel < 1e-4, (name, rel)
    # our metrics went through TRL's metric store
    assert ours._metrics["train"]["gtpo/clip_frac"][-1] > 0  # the perturbed ratios did clip
    torch.testing.assert_close(torch.tensor(ours._metrics["train"]["entropy"][-1]),
                               torch.tensor(stock._metrics["train"]["entropy"][-1]), rtol=1e-4, atol=1e-5)


@needs_trl
def test_trl_config_mapping_and_refusals(tmp_path):
    from trl import GRPOConfig
    from gtpo_kernels.integrations.trl import GTPOTrainer, GTPOTrainerConfig, gtpo_config_from_args
    args = GTPOTrainerConfig(output_dir=str(tmp_path), temperature=0.8, epsilon=0.1, epsilon_high=0.3,
                             max_completion_length=16, gtpo_loss="gtpo-official",
                             gtpo_kwargs='{"conflict_pos_weight": 1.5}', report_to=[], use_cpu=True)
    cfg = gtpo_config_from_args(args)
    assert (cfg.temperature, cfg.eps_low, cfg.eps_high, cfg.max_completion_length) == (0.8, 0.1, 0.3, 16)
    assert cfg.loss_agg == "gtpo-official" and cfg.conflict_pos_weight == 1.5 and cfg.entropy_threshold == 0.7
    assert gtpo_config_from_args(GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True)).use_conflict_mask
    with pytest.raises(ValueError, match="temperature"):
        gtpo_config_from_args(GTPOTrainerConfig(output_dir=str(tmp_path), gtpo_kwargs={"temperature": 2.0},
                                                report_to=[], use_cpu=True))
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        _trl_setup(tmp_path, GTPOTrainer, GTPOTrainerConfig, top_entropy_quantile=0.2)


# ---------------------------------------------------------------- examples/train_loop.py

@needs_transformers
def test_train_loop_example_runs(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "train_loop.py"), "--steps", "3",
                        "--prompts", "2", "--group-size", "4", "--max-new-tokens", "6"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("step ")]
    assert len(lines) == 3, r.stdout
    assert "conflict" in lines[0] and "loss" in lines[0]


# ---------------------------------------------------------------- the demo (examples/toy_rl.py)

def test_demo_runs_small(tmp_path):
    out = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "gtpo_kernels.demo", "--steps", "4", "--warmup-steps", "20", "--seeds", "0",
                        "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    curves = json.loads((out / "toy_rl.json").read_text())
    for arm in ("gtpo", "grpo"):
        c = curves["arms"][arm]
        for key in ("reward", "format_acc", "answer_acc", "conflict_frac", "mean_entropy"):
            assert len(c[key]) == 4, (arm, key)
    assert curves["arms"]["grpo"]["filtered_frac"] == [0.0] * 4  # the grpo preset has no entropy filter
    assert curves["arms"]["gtpo"]["conflict_frac"][0] > 0  # the tags are shared: conflict tokens exist
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "toy_rl.png").stat().st_size > 1000
