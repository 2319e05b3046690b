"""The GRPO family of spec 9 in the float64 reference against TRL 1.16's own GRPOTrainer code (its
_compute_loss run on a minimal stand-in for the trainer, its vLLM importance-sampling block run as written) for
every TRL loss_type, to 1e-10 in float64. Hand-computed examples of every piece:
tests/test_reference_family_examples.py."""
import collections
import dataclasses
import inspect
import math
import textwrap
import types

import pytest
import torch

import gtpo_reference as ref

F64 = torch.float64
GTPO_OFF = dict(use_conflict_mask=False, entropy_threshold=None, entropy_penalty=0.0)


def close(a, b, tol=1e-10):
    a, b = torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a, b, rtol=tol, atol=tol), (a, b)


# ------------------------------------------------------------------------ equality with TRL's code

@pytest.fixture(scope="module")
def trl():
    return pytest.importorskip("trl.trainer.grpo_trainer")


class _OneProcess:
    """The accelerator calls of _compute_loss / get_high_entropy_mask, in one process."""
    num_processes, sync_gradients = 1, True
    pad_across_processes = staticmethod(lambda x, dim=0, pad_index=0: x)
    gather = reduce = gather_for_metrics = staticmethod(lambda x, reduction=None: x)


def trl_stand_in(trl, loss_type, **args):
    """A minimal object to run GRPOTrainer._compute_loss on: TRL's methods, its config defaults, and a
    _get_per_token_logps_and_entropies that returns the log-probs and entropies of self.logits."""
    G = trl.GRPOTrainer
    cfg = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    cfg.update(steps_per_generation=1, **args)
    eps_high = cfg["epsilon_high"] if cfg["epsilon_high"] is not None else cfg["epsilon"]

    def logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kw):
        logp_all = torch.log_softmax(self.logits / self.temperature, dim=-1)
        ids = input_ids[:, -logits_to_keep:]
        H = -(logp_all.exp() * logp_all).sum(-1)
        return logp_all.gather(-1, ids[..., None])[..., 0], H, None

    attrs = {}
    for name in ("_compute_loss", "get_high_entropy_mask", "get_off_policy_mask", "get_gamma_weights"):
        attrs[name] = G.__dict__[name]                        # staticmethods stay static
    attrs["_get_per_token_logps_and_entropies"] = logps_and_entropies
    self = type("TRLStandIn", (), attrs)()
    self.__dict__.update(
        args=types.SimpleNamespace(**cfg), loss_type=loss_type, beta=cfg["beta"], epsilon_low=cfg["epsilon"],
        epsilon_high=eps_high, importance_sampling_level=cfg["importance_sampling_level"],
        off_policy_mask_threshold=cfg["off_policy_mask_threshold"],
        top_entropy_quantile=cfg["top_entropy_quantile"], use_vllm=True,
        vllm_importance_sampling_correction=cfg["vllm_importance_sampling_correction"],
        vllm_importance_sampling_mode=cfg["vllm_importance_sampling_mode"],
        vllm_importance_sampling_clip_min=cfg["vllm_importance_sampling_clip_min"],
        vllm_importance_sampling_clip_max=cfg["vllm_importance_sampling_clip_max"],
        max_completion_length=cfg["max_completion_length"], current_gradient_accumulation_steps=1,
        accelerator=_OneProcess(), model=types.SimpleNamespace(training=True), aux_loss_enabled=False,
        _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
        entropy_coef=cfg["entropy_coef"], use_adaptive_entropy=False,
        _entropy_bonus_enabled=cfg["entropy_coef"] != 0.0, temperature=cfg["temperature"])
    return self


def trl_rollout_ratio(trl, stand_in, old, roll, mask):
    """TRL's own vLLM importance-sampling block of _generate_and_score_completions, run as written."""
    lines = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions).splitlines()
    start = next(i for i, s in enumerate(lines) if "Compute the importance sampling ratio when using vLLM" in s)
    end = next(i for i in range(start, len(lines)) if "per-token log probabilities for the reference" in lines[i])
    block = textwrap.dedent("\n".join(lines[start + 1:end]))
    assert "vllm_importance_sampling_ratio = torch.exp(logps_diff)" in block, "TRL's block moved"
    ns = dict(self=stand_in, completion_mask=mask, tool_mask=None, old_per_token_logps=old,
              sampling_per_token_logps=roll)
    exec(block, {"torch": torch, "math": math}, ns)
    return ns["vllm_importance_sampling_ratio"]


B, T, V, MAXLEN = 6, 7, 11, 9
# TRL loss_type -> (TRL config, reference arguments)
TRL_LOSSES = {
    "grpo": ({}, dict(loss_agg="seq-mean-token-mean")),
    "bnpo": ({}, dict(loss_agg="token-mean")),
    "dr_grpo": ({}, dict(loss_agg="seq-mean-token-sum-norm", max_completion_length=MAXLEN)),
    "dapo": (dict(epsilon_high=0.28), dict(loss_agg="token-mean", eps_high=0.28, items=True)),
    "cispo": (dict(epsilon_high=5.0), dict(policy_loss="cispo", loss_agg="token-mean", eps_high=5.0,
                                           items=True)),
    "sapo": (dict(sapo_temperature_neg=1.25), dict(policy_loss="sapo", loss_agg="seq-mean-token-mean",
                                                   sapo_temperature_neg=1.25)),
    "gspo": (dict(importance_sampling_level="sequence"), dict(importance_sampling_level="sequence",
                                                             loss_agg="seq-mean-token-mean")),
    "luspo": (dict(importance_sampling_level="sequence"), dict(importance_sampling_level="sequence",
                                                              loss_agg="seq-mean-token-sum")),
    "vespo": ({}, dict(policy_loss="vespo", loss_agg="token-mean", items=True)),
}
MODES = {"vespo": "token_mask", "cispo": "token_truncate", "sapo": "sequence_truncate"}


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    z = 2 * torch.randn(B, T, V, dtype=F64, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.arange(T)[None] < torch.tensor([[7], [5], [1], [0], [6], [3]])).long()
    logp = torch.log_softmax(z, -1).gather(-1, ids[..., None])[..., 0]
    old = logp + 0.25 * torch.randn(B, T, dtype=F64, generator=g)
    roll = old + 0.3 * torch.randn(B, T, dtype=F64, generator=g)
    refl = logp + 0.2 * torch.randn(B, T, dtype=F64, generator=g)
    A = torch.tensor([1.0, -0.7, 0.0, 0.4, -1.3, 0.9], dtype=F64)
    return z, ids, mask, old, roll, refl, A


def compare(trl, loss_type, scenario, entropy_coef=0.0, tol=1e-10, sapo_neg=None):
    trl_cfg, ref_kw = TRL_LOSSES[loss_type]
    trl_cfg, ref_kw = dict(trl_cfg), dict(ref_kw)
    if sapo_neg is not None:
        trl_cfg["sapo_temperature_neg"] = ref_kw["sapo_temperature_neg"] = sapo_neg
    items = ref_kw.pop("items", False)
    z, ids, mask, old, roll, refl, A = batch()
    inputs = dict(prompt_ids=torch.zeros(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.long),
                  completion_ids=ids, completion_mask=mask, advantages=A,
                  num_items_in_batch=mask.sum().double())
    ref_kw.update(GTPO_OFF, entropy_coef=entropy_coef, old_logps=None if scenario == "on-policy" else old)
    if scenario != "on-policy":
        inputs["old_per_token_logps"] = old
    trl_cfg.update(max_completion_length=MAXLEN, entropy_coef=entropy_coef, use_bias_correction_kl=False,
                   vllm_importance_sampling_correction=False)
    if scenario == "all":
        mode = MODES.get(loss_type, "sequence_mask")
        hi = 1.7 if mode.startswith("sequence") else 1.5     # some weights clipped or masked on this batch
        clip = dict(vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=hi)
        # threshold -0.1 on this batch: completion 4 (A < 0) dropped, 1 (A < 0) and 0 (A > 0) kept
        trl_cfg.update(beta=0.05, use_bias_correction_kl=True, delta=1.3, off_policy_mask_threshold=-0.1,
                       top_entropy_quantile=0.6, vllm_importance_sampling_correction=True,
                       vllm_importance_sampling_mode=mode, **clip)
        w = ref.rollout_is_weights(old, roll, mask, mode, clip_min=0.5, clip_max=hi)
        ref_kw.update(beta=0.05, ref_logps=refl, use_bias_correction_kl=True, delta=1.3,
                      off_policy_mask_threshold=-0.1, top_entropy_quantile=0.6, rollout_logps=roll,
                      rollout_is_weights=w)
        inputs.update(ref_per_token_logps=refl, sampling_per_token_logps=roll)
    stand_in = trl_stand_in(trl, loss_type if loss_type != "gspo" else "grpo", **trl_cfg)
    if scenario == "all":
        inputs["importance_sampling_ratio"] = trl_rollout_ratio(trl, stand_in, old, roll, mask)
        close(w, inputs["importance_sampling_ratio"], tol=0)   # TRL's weights, exactly (and their shape)
        we = w.expand(B, T)[mask.bool()]
        assert ((we == 0) | (we == 0.5) | (we == hi)).any()
    stand_in.logits = z.clone().requires_grad_()
    trl_loss = stand_in._compute_loss(None, inputs)
    trl_loss.backward()
    zz = z.clone().requires_grad_()
    out = ref.gtpo_loss(zz, ids, A, mask, num_items_in_batch=mask.sum() if items else None, **ref_kw)
    out["loss"].backward()
    close(out["loss"], trl_loss.detach(), tol)
    assert (zz.grad - stand_in.logits.grad).norm() <= tol * zz.grad.norm()
    return out


@pytest.mark.parametrize("scenario", ["on-policy", "off-policy", "all"])
@pytest.mark.parametrize("loss_type", list(TRL_LOSSES))
def test_equals_trl_compute_loss(trl, loss_type, scenario):
    out = compare(trl, loss_type, scenario)
    if loss_type in ("grpo", "dapo") and scenario != "on-policy":
        assert out["metrics"]["clip_frac"] > 0                # the clip (and delta) are exercised


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo", "cispo", "vespo"])
def test_entropy_bonus_equals_trl_for_token_mean(trl, loss_type):
    compare(trl, loss_type, "off-policy", entropy_coef=0.03)


def test_trl_differences(trl):
    # TRL's entropy bonus is the token mean of H whatever the aggregation; spec 9 aggregates -coef * H
    with pytest.raises(AssertionError):
        compare(trl, "grpo", "off-policy", entropy_coef=0.03)
    # TRL's SAPO temperatures are float32 (torch.where on Python floats): 1.05 agrees to ~1e-7 only
    compare(trl, "sapo", "off-policy", sapo_neg=1.05, tol=1e-6)
    with pytest.raises(AssertionError):
        compare(trl, "sapo", "off-policy", sapo_neg=1.05)
    # the defaults of the new arguments are TRL's (but use_bias_correction_kl: TRL True, here False)
    cfg = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    sig = inspect.signature(ref.gtpo_loss).parameters
    for k in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos",
              "vespo_k_neg", "vespo_lambda_neg", "delta", "off_policy_mask_threshold", "top_entropy_quantile"):
        assert sig[k].default == cfg[k], k
    assert cfg["use_bias_correction_kl"] is True and sig["use_bias_correction_kl"].default is False
    rsig = inspect.signature(ref.rollout_is_weights).parameters
    assert rsig["clip_max"].default == cfg["vllm_importance_sampling_clip_max"]
    assert rsig["clip_min"].default == cfg["vllm_importance_sampling_clip_min"]


def test_top_entropy_mask_equals_trl(trl):
    from gtpo_reference import gtpo_family
    z, ids, mask, *_ = batch()
    lp = torch.log_softmax(z, -1)
    H = -(lp.exp() * lp).sum(-1)
    stand_in = trl_stand_in(trl, "grpo")
    for rho in (0.2, 0.5, 0.6, 0.9):
        want = trl.GRPOTrainer.get_high_entropy_mask(stand_in, H, mask, 1 - rho)
        assert torch.equal(gtpo_family.top_entropy_mask(H, mask.bool(), rho), want)
