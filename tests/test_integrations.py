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
from gtpo_kernels.kernels import dispatch

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


@pytest.fixture
def head_spy(monkeypatch):
    """Counts the TRL adapter's calls of linear_gtpo_loss (fused head), gtpo_loss (logits head) and
    linear_token_logprobs (old-policy / reference passes), made in its head module."""
    from gtpo_kernels.integrations import trl_head as adapter
    calls = {"linear_gtpo_loss": 0, "gtpo_loss": 0, "linear_token_logprobs": 0, "schedules": []}

    def count(name):
        orig = getattr(adapter, name)

        def wrapped(*a, **k):
            calls[name] += 1
            out = orig(*a, **k)
            if name == "linear_gtpo_loss":
                calls["schedules"].append(int(out.metrics["grad_in_forward"].item()))
            return out
        monkeypatch.setattr(adapter, name, wrapped)
    for name in ("linear_gtpo_loss", "gtpo_loss", "linear_token_logprobs"):
        count(name)
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


# ---------------------------------------------------------------- TRL: every loss type against the stock trainer

# TRL's defaults for every option a case may change; each case starts from these
_TRL_BASE = dict(loss_type="grpo", importance_sampling_level="token", delta=None, beta=0.0, epsilon=0.2,
                 epsilon_high=0.25, use_bias_correction_kl=True, off_policy_mask_threshold=None,
                 top_entropy_quantile=1.0, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                 vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
                 entropy_coef=0.0)


def _configure(tr, vllm_is=False, **opts):
    """Sets TRL options on a built trainer: its args and the attributes GRPOTrainer copies them into."""
    from gtpo_kernels.integrations.trl import GTPOTrainer
    a = tr.args
    for k, v in {**_TRL_BASE, **opts}.items():
        setattr(a, k, v)
    tr.loss_type, tr.beta = a.loss_type, a.beta
    tr.importance_sampling_level = a.importance_sampling_level
    tr.off_policy_mask_threshold, tr.top_entropy_quantile = a.off_policy_mask_threshold, a.top_entropy_quantile
    tr.epsilon_low = a.epsilon
    tr.epsilon_high = a.epsilon_high if a.epsilon_high is not None else a.epsilon
    tr.use_vllm = tr.vllm_importance_sampling_correction = vllm_is
    if isinstance(tr, GTPOTrainer):
        a.gtpo_loss = None  # TRL's loss type with the GTPO parts off
        tr._gtpo_setup()


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The tiny models' ops are microseconds of work: with the cores shared, torch's intra-op threads only
    contend (20x slower on a loaded 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def trl_pair(tmp_path_factory):
    """One tiny model in two trainers (ours, stock) and one off-policy batch with every input a TRL
    option reads: old, reference and vLLM sampling log-probs (one NaN, as vLLM gives for an unscored
    token), built once for the module."""
    from trl import GRPOConfig, GRPOTrainer
    from gtpo_kernels.integrations.trl import GTPOTrainer, GTPOTrainerConfig
    tmp = tmp_path_factory.mktemp("trl_pair")
    model = tiny_model(len(tiny_tokenizer()), seed=1)
    common = dict(temperature=0.7, epsilon=0.2, epsilon_high=0.25, bf16=False)  # float32: exact comparison
    ours = _trl_setup(tmp, GTPOTrainer, GTPOTrainerConfig, model=copy.deepcopy(model), gtpo_loss=None, **common)
    stock = _trl_setup(tmp, GRPOTrainer, GRPOConfig, model=copy.deepcopy(model), loss_type="grpo", **common)
    prompts = [{"prompt": p} for p in ["1+2=", "3+4="] for _ in range(4)]
    torch.manual_seed(0)
    ours.model.train()
    batch = ours._generate_and_score_completions(prompts)
    assert batch["advantages"].abs().sum() > 0, "degenerate batch: every advantage is 0"
    T = batch["completion_ids"].size(1)
    # a random model rarely stops: cut three completions short (pad after the end, as TRL masks past EOS)
    m = batch["completion_mask"].clone()
    for row, n in ((1, 3), (4, 5), (6, 1)):
        m[row, n:] = 0
        batch["completion_ids"][row, n:] = 0
    batch["completion_mask"] = m
    batch["num_items_in_batch"] = m.sum().to(batch["num_items_in_batch"].dtype)
    # group-normalised advantages make most losses a near-cancelling sum (|loss| ~ 1e-4 against terms of
    # ~0.1, so float32 rounding alone is 1e-5 of it); an offset keeps both signs and a loss of order 1
    batch["advantages"] = batch["advantages"] + 0.25
    assert (batch["advantages"] > 0).any() and (batch["advantages"] < 0).any()
    with torch.no_grad():
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        am = torch.cat([batch["prompt_mask"], m], 1)
        logits = ours.model(input_ids=ids, attention_mask=am, logits_to_keep=T + 1).logits
        lp, _ = gtpo_kernels.token_logprobs(logits, batch["completion_ids"], 0.7, m, logits_start=0)
    g = torch.Generator().manual_seed(3)
    # off-policy: old log-probs moved away from the current ones so that ratios clip
    batch["old_per_token_logps"] = lp + 0.4 * torch.randn(lp.shape, generator=g)
    batch["ref_per_token_logps"] = lp + 0.3 * torch.randn(lp.shape, generator=g)
    sampling = batch["old_per_token_logps"] + 0.3 * torch.randn(lp.shape, generator=g)
    sampling[0, 1] = float("nan")
    batch["sampling_per_token_logps"] = sampling
    return dict(ours=ours, stock=stock, batch=batch)


def _is_ratio(batch, mode, clip_min=None, clip_max=3.0):
    """TRL's importance_sampling_ratio for a vLLM mode: (B, T) per token, (B, 1) per sequence."""
    w = gtpo_kernels.rollout_is_weights(batch["old_per_token_logps"], batch["sampling_per_token_logps"],
                                        batch["completion_mask"], mode, clip_min, clip_max)
    return w[:, :1].contiguous() if mode.startswith("sequence") else w


# (id, TRL options, vLLM IS mode or None); an option case also checks that the option changed the loss
TRL_CASES = [
    ("grpo", {}, None),
    ("bnpo", dict(loss_type="bnpo"), None),
    ("dr_grpo", dict(loss_type="dr_grpo"), None),
    ("dapo", dict(loss_type="dapo"), None),
    ("cispo", dict(loss_type="cispo", epsilon_high=1.3), None),  # a bound the perturbed ratios exceed
    ("sapo", dict(loss_type="sapo", sapo_temperature_pos=1.3, sapo_temperature_neg=0.8), None),
    ("luspo", dict(loss_type="luspo", importance_sampling_level="sequence"), None),
    ("luspo-token", dict(loss_type="luspo"), None),
    ("vespo", dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_neg=2.5), None),
    ("gspo", dict(importance_sampling_level="sequence"), None),
    ("grpo-delta", dict(delta=1.3), None),
    ("dapo-delta", dict(loss_type="dapo", delta=1.3), None),
    ("grpo-kl-bias", dict(beta=0.1, use_bias_correction_kl=True), None),
    ("dapo-kl", dict(loss_type="dapo", beta=0.1, use_bias_correction_kl=False), None),
    ("gspo-kl-bias", dict(importance_sampling_level="sequence", beta=0.1), None),
    ("grpo-offpolicy-mask", dict(off_policy_mask_threshold=0.0), None),
    ("dapo-offpolicy-mask-vllm", dict(loss_type="dapo", off_policy_mask_threshold=0.0), "token_truncate"),
    ("grpo-top-entropy", dict(top_entropy_quantile=0.3), None),
    ("luspo-top-entropy", dict(loss_type="luspo", importance_sampling_level="sequence",
                               top_entropy_quantile=0.5), None),
    ("grpo-vllm-token-truncate", {}, "token_truncate"),
    ("dapo-vllm-token-mask", dict(loss_type="dapo"), "token_mask"),
    ("bnpo-vllm-sequence-truncate", dict(loss_type="bnpo"), "sequence_truncate"),
    ("sapo-vllm-sequence-mask", dict(loss_type="sapo"), "sequence_mask"),
    ("vespo-vllm-token-truncate", dict(loss_type="vespo"), "token_truncate"),
    ("cispo-kl-bias-vllm", dict(loss_type="cispo", epsilon_high=1.3, beta=0.1), "token_truncate"),
]


def _trl_losses(pair, opts, vllm_mode, accum, spg, train=True):
    """(our loss, stock loss, our grads, stock grads) on the shared batch."""
    batch = dict(pair["batch"])
    if vllm_mode is not None:
        batch["importance_sampling_ratio"] = _is_ratio(batch, vllm_mode, *((0.5, 1.5) if "mask" in vllm_mode
                                                                           else (None, 1.5)))
    out = []
    for tr in (pair["ours"], pair["stock"]):
        _configure(tr, vllm_is=vllm_mode is not None, **opts)
        tr.args.steps_per_generation = spg
        tr.current_gradient_accumulation_steps = accum
        tr.model.train(train)
        tr.model.zero_grad(set_to_none=True)
        loss = tr._compute_loss(tr.model, batch)
        loss.backward()
        out.append((loss.detach(), [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                                    for p in tr.model.parameters()]))
        tr.model.train()
    return out[0][0], out[1][0], out[0][1], out[1][1]


@needs_trl
@pytest.mark.parametrize("case,opts,vllm_mode", TRL_CASES, ids=[c[0] for c in TRL_CASES])
def test_trl_loss_types_equal_stock_loss(trl_pair, kernel_spy, head_spy, case, opts, vllm_mode):
    """gtpo_loss=None + TRL's loss_type (and options) gives the stock GRPOTrainer's loss and parameter
    gradients on the same off-policy batch (temperature 0.7, float32), with gradient accumulation 2 and
    steps_per_generation 4 so that every normalizer's factors matter. The adapter's default head: the
    backbone's hidden states and the LM head's weight into linear_gtpo_loss (no logits)."""
    calls0 = kernel_spy["vocab_fwd"]
    ours, stock, g_ours, g_stock = _trl_losses(trl_pair, opts, vllm_mode, accum=2, spg=4)
    assert kernel_spy["vocab_fwd"] > calls0, "gtpo_loss's vocabulary kernel did not run"
    assert trl_pair["ours"]._gtpo_calls > 0
    assert head_spy["linear_gtpo_loss"] == 1 and head_spy["gtpo_loss"] == 0, head_spy
    assert abs(stock.item()) > 1e-4
    loss_rel = abs(ours.double() - stock.double()).item() / abs(stock.item())
    grad_rel = 0.0
    for (name, _), p, q in zip(trl_pair["stock"].model.named_parameters(), g_ours, g_stock):
        if q.norm() > 0 or p.norm() > 0:
            grad_rel = max(grad_rel, ((p - q).norm() / q.norm().clamp(min=1e-30)).item())
    print(f"\nTRL {case:32s} loss {stock.item():+.6f}  loss rel err {loss_rel:.2e}  grad rel err {grad_rel:.2e}")
    assert loss_rel < 1e-5, (ours.item(), stock.item())
    assert grad_rel < 1e-5, grad_rel
    # our metrics went through TRL's metric store, with TRL's entropy
    torch.testing.assert_close(torch.tensor(trl_pair["ours"]._metrics["train"]["entropy"][-1]),
                               torch.tensor(trl_pair["stock"]._metrics["train"]["entropy"][-1]),
                               rtol=1e-5, atol=1e-6)
    base = {k: v for k, v in opts.items() if k in ("loss_type", "epsilon_high")}
    if opts != base or vllm_mode is not None:  # the option under test changed the stock loss
        _, without, _, _ = _trl_losses(trl_pair, base, None, accum=2, spg=4)
        assert abs((without - stock).item()) > 1e-6 * abs(stock.item()), f"{case}: the option did not matter"


@needs_trl
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_trl_eval_mode_normalizers(trl_pair, loss_type):
    """In eval TRL drops the accumulation factors; so do we."""
    ours, stock, _, _ = _trl_losses(trl_pair, dict(loss_type=loss_type), None, accum=3, spg=6, train=False)
    torch.testing.assert_close(ours, stock, rtol=1e-5, atol=1e-7)


@needs_trl
@pytest.mark.parametrize("case", ["grpo", "dapo-kl", "luspo-top-entropy", "vespo-vllm-token-truncate"])
def test_trl_logits_head_equals_stock_loss(trl_pair, head_spy, case):
    """gtpo_head='logits' (the debugging path: the model's logits and gtpo_loss) and the fused head in
    tiles of 2 tokens (gtpo_memory_budget) give the same loss and gradients as the stock trainer; the
    fused head's two schedules both run."""
    _, opts, vllm_mode = next(c for c in TRL_CASES if c[0] == case)
    ours_tr = trl_pair["ours"]
    fused = _trl_losses(trl_pair, opts, vllm_mode, accum=2, spg=4)
    V = ours_tr.model.config.vocab_size
    ours_tr.args.gtpo_memory_budget = 2 * 2 * V * 4  # 2 float32 tokens (and their gradient) per tile
    try:
        tiled = _trl_losses(trl_pair, opts, vllm_mode, accum=2, spg=4)
        ours_tr.args.gtpo_head = "logits"
        logits = _trl_losses(trl_pair, opts, vllm_mode, accum=2, spg=4)
    finally:
        ours_tr.args.gtpo_head, ours_tr.args.gtpo_memory_budget = "fused", None
        _configure(ours_tr)
    assert head_spy["linear_gtpo_loss"] == 2 and head_spy["gtpo_loss"] == 1, head_spy
    # the 3-GEMM schedule where each tile's coefficients are local (whole completions in a tile for
    # vespo's per-completion weight), the recompute one otherwise
    local = case not in ("luspo-top-entropy", "vespo-vllm-token-truncate")
    assert head_spy["schedules"] == [0 if case == "luspo-top-entropy" else 1, 1 if local else 0]
    for ours, stock, g_ours, g_stock in (fused, tiled, logits):
        assert abs(ours.double() - stock.double()).item() < 1e-5 * abs(stock.item())
        for p, q in zip(g_ours, g_stock):
            assert (p - q).norm() <= 1e-5 * q.norm().clamp(min=1e-30)
    with pytest.raises(ValueError, match="gtpo_head"):
        ours_tr.args.gtpo_head = "chunked"
        try:
            ours_tr._gtpo_setup()
        finally:
            ours_tr.args.gtpo_head = "fused"
    ours_tr._gtpo_setup()


def _old_logps_both(tr, batch, batch_size):
    """(ours, TRL's) old-policy log-probs and entropies: the adapter's override and TRL's own method
    (TRL's fused head) on the same model, no gradient, as in _generate_and_score_completions."""
    from trl import GRPOTrainer
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    am = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    T = batch["completion_ids"].size(1)
    with torch.no_grad():
        ours = tr._get_per_token_logps_and_entropies(tr.model, ids, am, T, batch_size=batch_size,
                                                     compute_entropy=True)
        stock = GRPOTrainer._get_per_token_logps_and_entropies(tr, tr.model, ids, am, T, batch_size=batch_size,
                                                               compute_entropy=True)
    return ours, stock


@needs_trl
def test_trl_old_and_ref_passes_use_linear_token_logprobs(trl_pair, head_spy):
    """The old-policy and reference passes (TRL's _get_per_token_logps_and_entropies, no gradient) run
    through linear_token_logprobs, chunked over rows as TRL does, and equal TRL's own fused head."""
    tr = trl_pair["ours"]
    calls0 = tr._gtpo_logprob_calls
    (lp, ent, aux), (lp_t, ent_t, _) = _old_logps_both(tr, trl_pair["batch"], batch_size=3)
    assert tr._gtpo_logprob_calls - calls0 == 3 and head_spy["linear_token_logprobs"] == 3  # rows 8 = 3 + 3 + 2
    assert aux is None and lp.shape == lp_t.shape == trl_pair["batch"]["completion_ids"].shape
    torch.testing.assert_close(lp, lp_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_t, rtol=1e-5, atol=1e-5)
    # with a gradient (not a TRL pass) the method is TRL's own
    ids = torch.cat([trl_pair["batch"]["prompt_ids"], trl_pair["batch"]["completion_ids"]], 1)
    am = torch.ones_like(ids)
    tr._get_per_token_logps_and_entropies(tr.model, ids, am, 4)
    assert head_spy["linear_token_logprobs"] == 3


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
from test_integrations import _trl_setup
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
    print(f"\nTRL step peak (MB above the state before it): fused {mb['fused']:.1f}, logits {mb['logits']:.1f}, "
          f"TRL stock {mb['stock']:.1f}; logits {res['fused']['logits_bytes'] / 1e6:.1f}")
    assert res["fused"]["peak"] <= res["stock"]["peak"], mb
    assert res["fused"]["peak"] < res["logits"]["peak"], mb


def _gtpo_on_top_against_reference(tr, batch, G=4):
    """The adapter's conflict weights on `batch` (a positive and a negative completion of each group made
    to share their first two tokens) against the float64 reference per group, then its loss with them
    against the reference GTPO loss on the model's logits (one micro-batch, no accumulation)."""
    import dataclasses

    import gtpo_reference as ref
    from gtpo_kernels.integrations.trl_config import _loss_mask
    cfg, batch = tr.gtpo_config, dict(batch)
    ids, adv = batch["completion_ids"].clone(), batch["advantages"]
    for g in range(ids.size(0) // G):
        rows = range(g * G, (g + 1) * G)
        pos, neg = next(i for i in rows if adv[i] > 0), next(i for i in rows if adv[i] < 0)
        ids[neg, :2] = ids[pos, :2]
    batch["completion_ids"] = ids
    m = _loss_mask(batch) != 0
    lam, n_conf = tr._gtpo_conflict_weights(batch, G)
    lam_r, n_r = ref.conflict_weights(ids, m, adv, G, cfg.conflict_pos_weight, cfg.conflict_neg_weight)
    assert {0.5, 0.25} & set(lam_r[m].tolist()), lam_r  # conflict tokens of negative completions: w_neg
    assert torch.equal(lam.double()[m], lam_r[m]) and torch.equal(n_conf.double(), n_r)
    tr.args.steps_per_generation = tr.current_gradient_accumulation_steps = 1
    tr.model.train()
    losses = []
    for w in ((lam, n_conf), (torch.ones_like(lam), torch.ones_like(n_conf))):
        batch["gtpo_lam"], batch["gtpo_n_conf"] = w
        with torch.no_grad():
            losses.append(float(tr._compute_loss(tr.model, batch)))
    with torch.no_grad():
        T = ids.size(1)
        logits = tr.model(input_ids=torch.cat([batch["prompt_ids"], ids], 1), logits_to_keep=T + 1,
                          attention_mask=torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)).logits
    r = float(ref.gtpo_loss(logits.double(), ids, adv, m, group_size=G, old_logps=batch["old_per_token_logps"],
                            num_items_in_batch=batch["num_items_in_batch"], **dataclasses.asdict(cfg))["loss"])
    assert abs(losses[0] - r) <= 1e-5 * max(1.0, abs(r)), (losses, r)
    assert abs(losses[1] - r) > 1e-3 * abs(r), (losses, r)  # the weights change the loss


@needs_trl
def test_trl_clip_metric_and_gtpo_on_top(trl_pair):
    """gtpo_loss='gtpo' on a TRL loss type: the loss type's policy term with the conflict weights on
    (the weights the adapter computes at advantage time equal the float64 reference's, and the loss
    with them the reference GTPO loss; a w_neg of 0.5 from gtpo_kwargs shows the config reaches
    them); clip metrics are logged."""
    from gtpo_kernels.integrations.trl import gtpo_config_from_args
    ours = trl_pair["ours"]
    _trl_losses(trl_pair, {}, None, accum=1, spg=1)
    assert ours._metrics["train"]["gtpo/clip_frac"][-1] > 0  # the perturbed ratios did clip
    _configure(ours, loss_type="cispo", epsilon_high=5.0)
    ours.args.gtpo_loss = "gtpo"
    try:
        cfg = gtpo_config_from_args(ours.args)
        assert (cfg.policy_loss, cfg.loss_agg, cfg.eps_high, cfg.use_conflict_mask) == ("cispo", "token-mean", 5.0,
                                                                                        True)
        assert cfg.entropy_threshold == pytest.approx(0.6931471805599453) and cfg.entropy_penalty == 0.1
        # no entropy filter: the tiny model's entropy (~3.4 nats) would drop every completion (loss 0)
        ours.args.gtpo_kwargs = {"conflict_neg_weight": 0.5, "entropy_threshold": None}
        ours._gtpo_setup()
        _gtpo_on_top_against_reference(ours, trl_pair["batch"])
    finally:
        ours.args.gtpo_kwargs = None
        _configure(ours)


@needs_trl
def test_trl_config_mapping_and_refusals(tmp_path, trl_pair):
    from trl import GRPOConfig
    from gtpo_kernels.integrations.trl import GTPOTrainerConfig, gtpo_config_from_args

    def args(**kw):
        return GTPOTrainerConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)

    cfg = gtpo_config_from_args(args(temperature=0.8, epsilon=0.1, epsilon_high=0.3, max_completion_length=16,
                                     gtpo_loss="gtpo-official", gtpo_kwargs='{"conflict_pos_weight": 1.5}'))
    assert (cfg.temperature, cfg.eps_low, cfg.eps_high, cfg.max_completion_length) == (0.8, 0.1, 0.3, 16)
    assert cfg.loss_agg == "gtpo-official" and cfg.conflict_pos_weight == 1.5 and cfg.entropy_threshold == 0.7
    # the default: loss_type='grpo' + GTPO's parts = the gtpo preset
    default = gtpo_config_from_args(args())
    assert default.replace(max_completion_length=None) == gtpo_kernels.GTPOConfig.preset("gtpo").replace(
        use_bias_correction_kl=True)
    # a plain GRPOConfig: TRL's default loss_type ('dapo') with GTPO's parts on top
    plain = gtpo_config_from_args(GRPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True))
    assert plain.use_conflict_mask and plain.loss_agg == "token-mean"
    # every option maps onto its GTPOConfig field
    cfg = gtpo_config_from_args(args(loss_type="luspo", gtpo_loss="luspo", importance_sampling_level="sequence",
                                     delta=1.5, beta=0.05, use_bias_correction_kl=False,
                                     off_policy_mask_threshold=0.3, top_entropy_quantile=0.4,
                                     sapo_temperature_pos=0.9, vespo_k_neg=2.5))
    assert (cfg.policy_loss, cfg.loss_agg, cfg.importance_sampling_level, cfg.use_conflict_mask) == \
        ("ppo", "seq-mean-token-sum", "sequence", False)
    assert (cfg.delta, cfg.beta, cfg.use_bias_correction_kl, cfg.off_policy_mask_threshold,
            cfg.top_entropy_quantile, cfg.sapo_temperature_pos, cfg.vespo_k_neg) == (1.5, 0.05, False, 0.3, 0.4,
                                                                                     0.9, 2.5)
    for kw, match in [(dict(gtpo_kwargs={"temperature": 2.0}), "temperature"),
                      (dict(gtpo_kwargs={"delta": 2.0}), "`delta`"),
                      (dict(gtpo_kwargs={"loss_agg": "token-mean"}), "loss_type"),
                      (dict(gtpo_loss="dapo"), "set loss_type='dapo'"),
                      (dict(gtpo_loss="gspo"), "importance_sampling_level='sequence'"),
                      (dict(gtpo_loss="gtpo-official", loss_type="dapo"), "loss_type='grpo'"),
                      (dict(loss_type="sapo", importance_sampling_level="sequence"), "sequence"),
                      (dict(loss_type="nope"), "loss_type")]:
        with pytest.raises(ValueError, match=match):
            gtpo_config_from_args(args(**kw))
    # TRL's own entropy bonus stays refused
    ours = trl_pair["ours"]
    ours.args.entropy_coef = 0.01
    try:
        with pytest.raises(ValueError, match="entropy_coef"):
            ours._gtpo_setup()
    finally:
        _configure(ours)


# ---------------------------------------------------------------- TRL with several processes: conflict weights

# TRL gives process r the rows r * B .. (r + 1) * B of the generation batch, padded to that process's
# longest completion: 3 groups of 4 over 2 processes of 6 rows (group 1, rows 4..7, straddles them),
# process 0 padded to T = 7, process 1 to T = 5
_DP_G, _DP_B, _DP_T = 4, 6, (7, 5)


def _dp_batch():
    """The whole batch (12 completions, padded to 7) as TRL's keys, and the GTPOConfig."""
    g = torch.Generator().manual_seed(0)
    B, T = 2 * _DP_B, max(_DP_T)
    lens = torch.cat([torch.randint(1, T_r + 1, (_DP_B,), generator=g) for T_r in _DP_T])
    lens[0], lens[_DP_B] = _DP_T  # each process's longest completion sets its padding
    mask = (torch.arange(T) < lens[:, None]).long()
    ids = torch.randint(3, 7, (B, T), generator=g) * mask  # a small vocabulary: many shared tokens; pad 0
    tool_mask = torch.ones(B, T, dtype=torch.long)
    tool_mask[5, 0] = tool_mask[6, 1] = 0  # tool-output tokens of the straddling group (not counted)
    adv = torch.tensor([1., -1., .5, 0., 1., -1., -.5, 2., -1., 1., -2., .5])
    cfg = gtpo_kernels.GTPOConfig.preset("gtpo", conflict_neg_weight=0.5)
    return {"completion_ids": ids, "completion_mask": mask, "tool_mask": tool_mask, "advantages": adv}, cfg


def _dp_conflict_worker(rank, init_file, out_dir):
    """One process: the adapter's _gtpo_conflict_weights on a stand-in trainer with this process's slice."""
    import traceback
    from types import MethodType, SimpleNamespace

    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        from gtpo_kernels.integrations.trl import GTPOTrainer
        batch, cfg = _dp_batch()
        rows, T = slice(rank * _DP_B, (rank + 1) * _DP_B), _DP_T[rank]
        local = {k: (v[rows, :T] if v.dim() == 2 else v[rows]) for k, v in batch.items()}
        stand_in = SimpleNamespace(accelerator=SimpleNamespace(num_processes=2, process_index=rank), gtpo_config=cfg)
        lam, n_conf = MethodType(GTPOTrainer._gtpo_conflict_weights, stand_in)(local, _DP_G)
        res = {"lam": lam, "n_conf": n_conf}
    except Exception:
        res = {"exception": traceback.format_exc()}
    torch.save(res, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


@needs_trl
def test_trl_conflict_weights_across_two_processes(tmp_path):
    """With 2 processes (gloo) the adapter's conflict weights, through conflict_weights(process_group=...),
    equal one process's on the whole batch, row for row, with a group straddling the processes and each
    process padded to its own T."""
    import torch.multiprocessing as mp

    from gtpo_kernels.integrations import trl  # noqa: F401  (imported here, the forked processes inherit it)
    # fork, not spawn: a spawned process spends seconds importing TRL; the workers run one thread each
    # (as DataLoader's forked workers) and no process group exists before the fork
    mp.start_processes(_dp_conflict_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")
    batch, cfg = _dp_batch()
    mask = batch["completion_mask"] * batch["tool_mask"]
    lam_ref, n_ref = gtpo_kernels.conflict_weights(batch["completion_ids"], mask, batch["advantages"], _DP_G,
                                                   config=cfg)
    for rank in range(2):
        res = torch.load(tmp_path / f"{rank}.pt")
        assert "exception" not in res, f"rank {rank}:\n{res.get('exception')}"
        rows, T = slice(rank * _DP_B, (rank + 1) * _DP_B), _DP_T[rank]
        assert res["lam"].shape == (_DP_B, T) and res["n_conf"].shape == (_DP_B,)
        assert torch.equal(res["lam"], lam_ref[rows, :T]), rank
        assert torch.equal(res["n_conf"], n_ref[rows]), rank
    # the straddling group's weights need both processes' rows: its halves alone give other weights
    halves = gtpo_kernels.conflict_weights(batch["completion_ids"][4:8], mask[4:8], batch["advantages"][4:8], 2,
                                           config=cfg)[0]
    assert not torch.equal(halves, lam_ref[4:8])
    assert len(set(lam_ref[mask.bool()].tolist())) == 3  # weights 2.0 and 0.5 on conflict tokens, 1.0 elsewhere


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
    demo = Path(__file__).resolve().parents[1] / "examples" / "toy_rl.py"
    r = subprocess.run([sys.executable, str(demo), "--steps", "4", "--warmup-steps", "20", "--seeds", "0",
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
