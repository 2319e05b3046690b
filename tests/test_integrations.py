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
        lp, _ = gtpo_kernels.token_logprobs(logits, batch["completion_ids"], 0.7, m)
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
def test_trl_loss_types_equal_stock_loss(trl_pair, kernel_spy, case, opts, vllm_mode):
    """gtpo_loss=None + TRL's loss_type (and options) gives the stock GRPOTrainer's loss and parameter
    gradients on the same off-policy batch (temperature 0.7, float32), with gradient accumulation 2 and
    steps_per_generation 4 so that every normalizer's factors matter."""
    calls0 = kernel_spy["vocab_fwd"]
    ours, stock, g_ours, g_stock = _trl_losses(trl_pair, opts, vllm_mode, accum=2, spg=4)
    assert kernel_spy["vocab_fwd"] > calls0, "gtpo_loss's vocabulary kernel did not run"
    assert trl_pair["ours"]._gtpo_calls > 0
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
def test_trl_clip_metric_and_gtpo_on_top(trl_pair):
    """gtpo_loss='gtpo' on a TRL loss type: the loss type's policy term with the conflict weights on;
    clip metrics are logged."""
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
    finally:
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
