"""Shared set-up of the TRL adapter tests (test_trl_losses.py, test_trl_models.py, test_trl_multiprocess.py)
and the examples' tests: a tiny tokenizer and models built here (no hub), a trainer factory, spies on our
kernels and heads, the pair of trainers (ours, stock) on one off-policy batch, and TRL's options.

Everything runs on the CPU. The TRL tests need the optional extra (`pip install -e ".[trl]"`) and are
skipped without it; examples/train_loop.py needs transformers; the demo needs only torch.
"""
import copy
import importlib.util
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
