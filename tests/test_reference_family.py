"""The GRPO family of spec 9 in the float64 reference: hand-computed examples of every piece, and equality
with TRL 1.16's own GRPOTrainer code (its _compute_loss run on a minimal stand-in for the trainer, its
vLLM importance-sampling block run as written) for every TRL loss_type, to 1e-10 in float64."""
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


def logits_for(logps):
    """(B, T, 2) logits whose token 0 has exactly the log-prob logps[b, t] (ids are all 0)."""
    lp = torch.as_tensor(logps, dtype=F64)
    return torch.stack([lp, torch.log1p(-lp.exp())], dim=-1)


def run(logps, A, mask=None, **kw):
    """Reference on logits_for(logps), GTPO parts off unless overridden; returns (out, grad of loss)."""
    z = logits_for(logps).requires_grad_()
    ids = torch.zeros(z.shape[:2], dtype=torch.long)
    out = ref.gtpo_loss(z, ids, torch.tensor(A, dtype=F64), mask, **{**GTPO_OFF, **kw})
    out["loss"].sum().backward()
    return out, z.grad


# ------------------------------------------------------------------------ hand examples, per piece

def test_ppo_delta_two_sided_clip():
    lp = torch.tensor([[-0.5], [-0.5]], dtype=F64)
    old = lp - math.log(3.0)                                  # r = 3 for both
    out, g = run(lp, [1.0, -1.0], old_logps=old, delta=2.0, loss_agg="none")
    close(out["per_token_loss"], [[-1.2], [2.0]])             # -min(min(3,2) A, 1.2 A)
    assert torch.all(g == 0) and out["metrics"]["clip_frac"] == 1.0   # clip (A>0), delta (A<0)
    out, g = run(lp, [1.0, -1.0], old_logps=old, loss_agg="none")
    close(out["per_token_loss"], [[-1.2], [3.0]])
    assert out["metrics"]["clip_frac"] == 0.5 and g[1].abs().sum() > 0
    out, _ = run(lp, [-1.0, -1.0], old_logps=old, delta=2.0, clip=False, loss_agg="none")
    close(out["per_token_loss"], [[2.0], [2.0]])              # clip=False: -min(r, delta) A


def test_cispo_term_and_gradient():
    lp = torch.tensor([[-0.5]], dtype=F64)
    out, g = run(lp, [2.0], old_logps=lp - math.log(7.0), policy_loss="cispo", eps_high=5.0)
    close(out["loss"], -5.0 * 2.0 * -0.5)                     # -sg(min(r, 5)) A logp
    p = math.exp(-0.5)
    close(g[0, 0], [-10.0 * (1 - p), 10.0 * (1 - p)])         # d/dlogp = -10, dlogp/dz = onehot - p


def test_sapo_term():
    lp = torch.tensor([[-0.5], [-0.5]], dtype=F64)
    out, _ = run(lp, [1.0, -1.0], old_logps=lp - math.log(1.5), policy_loss="sapo", loss_agg="none")
    sig = lambda x: 1 / (1 + math.exp(-x))
    close(out["per_token_loss"], [[-4.0 * sig(0.5)], [4.0 / 1.05 * sig(1.05 * 0.5)]])


def test_vespo_phi_and_rollout_weights_folded_in():
    lp = torch.tensor([[-0.5, -1.0], [-0.5, -1.0]], dtype=F64)
    old = lp - torch.tensor([[0.1, 0.2]], dtype=F64)          # L = 0.3 for both
    phi_pos = math.exp(3.0 + 2.0 * 0.3 - 3.0 * math.exp(0.3))      # (k, lambda) = (2, 3) for A >= 0
    phi_neg = math.exp(2.0 + 3.0 * 0.3 - 2.0 * math.exp(0.3))      # (3, 2) for A < 0
    want = torch.stack([-phi_pos * lp[0], phi_neg * lp[1]])
    out, _ = run(lp, [1.0, -1.0], old_logps=old, policy_loss="vespo", loss_agg="none")
    close(out["per_token_loss"], want)
    # per-token weights 2 and 1/2: log sum 0, phi unchanged, and not multiplied again
    w = torch.tensor([[2.0, 0.5], [2.0, 0.5]], dtype=F64)
    out, _ = run(lp, [1.0, -1.0], old_logps=old, policy_loss="vespo", loss_agg="none", rollout_is_weights=w)
    close(out["per_token_loss"], want)
    # a per-completion weight enters log w once
    out, _ = run(lp[:1], [1.0], old_logps=old[:1], policy_loss="vespo", loss_agg="none",
                 rollout_is_weights=torch.tensor([2.0]))
    L = 0.3 + math.log(2.0)
    close(out["per_token_loss"], -math.exp(3.0 + 2.0 * L - 3.0 * math.exp(L)) * lp[:1])


def test_sequence_level_ratio_and_gradient_through_the_mean():
    lp = torch.tensor([[-0.5, -1.0, -2.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]])
    old = lp - torch.tensor([[0.05, 0.15, 5.0]], dtype=F64)   # the masked-out 5.0 is ignored
    out, g = run(lp, [1.0], mask, old_logps=old, importance_sampling_level="sequence")
    r = math.exp(0.1)                                          # exp(mean of the counted log-ratios)
    close(out["loss"], -r)
    p = lp.exp()[0]
    dlogp = torch.tensor([-r / 2, -r / 2, 0.0], dtype=F64)     # d(-r)/dlogp_t = -r m_t / n
    close(g[0], torch.stack([dlogp * (1 - p), -dlogp * (1 - p)], dim=-1))
    # token level differs: per-token ratios exp(0.05), exp(0.15)
    out_tok, _ = run(lp, [1.0], mask, old_logps=old)
    close(out_tok["loss"], -(math.exp(0.05) + math.exp(0.15)) / 2)


def test_sequence_level_gradient_matches_finite_difference():
    torch.manual_seed(3)
    z = torch.randn(2, 4, 5, dtype=F64)
    ids, mask = torch.randint(0, 5, (2, 4)), torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    old = torch.log_softmax(z, -1).gather(-1, ids[..., None])[..., 0] + 0.1 * torch.randn(2, 4, dtype=F64)
    kw = dict(GTPO_OFF, old_logps=old, importance_sampling_level="sequence", eps_low=0.5, eps_high=0.5,
              beta=0.1, ref_logps=old - 0.2, use_bias_correction_kl=True)
    A = torch.tensor([1.0, -0.5], dtype=F64)
    zz = z.clone().requires_grad_()
    ref.gtpo_loss(zz, ids, A, mask, **kw)["loss"].backward()
    f = lambda x: ref.gtpo_loss(x, ids, A, mask, **kw)["loss"].item()
    fd = torch.zeros_like(z)
    for idx in torch.cartesian_prod(*(torch.arange(s) for s in z.shape)).tolist():
        e = torch.zeros_like(z)
        e[tuple(idx)] = 1e-6
        fd[tuple(idx)] = (f(z + e) - f(z - e)) / 2e-6
    close(zz.grad, fd, tol=1e-7)


def test_bias_corrected_kl():
    lp = torch.tensor([[-0.5]], dtype=F64)
    r, d, beta = 1.1, 0.3, 0.5
    k3 = math.exp(d) - d - 1
    kw = dict(old_logps=lp - math.log(r), beta=beta, ref_logps=lp + d)
    out, g = run(lp, [1.0], **kw, use_bias_correction_kl=True)
    close(out["loss"], -r + beta * r * k3)
    dtok = -r + beta * (r * k3 + r * (1 - math.exp(d)))      # d/dlogp of -r A + beta r k3
    close(g[0, 0, 0], dtok * (1 - math.exp(-0.5)))
    out, _ = run(lp, [1.0], **kw)
    close(out["loss"], -r + beta * k3)


def test_off_policy_mask():
    lp = torch.full((3, 2), -1.0, dtype=F64)
    roll = lp + torch.tensor([[0.5, 0.5], [0.1, float("nan")], [0.5, 0.5]], dtype=F64)
    kw = dict(old_logps=lp, beta=0.5, ref_logps=lp + 0.3, off_policy_mask_threshold=0.1, loss_agg="none")
    out, _ = run(lp, [-1.0, -1.0, 1.0], rollout_logps=roll, **kw)
    kl = 0.5 * (math.exp(0.3) - 1.3)
    # row 0: A < 0 and mean KL 0.5 > 0.1: policy term dropped, KL kept; row 1: NaN counts as 0 ->
    # mean 0.05 kept; row 2: A >= 0 kept
    close(out["per_token_loss"], [[kl, kl], [1 + kl, 1 + kl], [-1 + kl, -1 + kl]])
    # without rollout_logps the mask reads old_logps (here = logp: every completion kept)
    out, _ = run(lp, [-1.0, -1.0, 1.0], **kw)
    close(out["per_token_loss"][0], [1 + kl, 1 + kl])


def test_top_entropy_quantile_masks_policy_term_and_entropy_bonus():
    p = torch.tensor([[0.5, 0.4, 0.3, 0.2, 0.1]], dtype=F64)
    H = -(p * p.log() + (1 - p) * (1 - p).log())              # decreasing entropies
    kw = dict(entropy_coef=0.1, loss_agg="none")
    out, _ = run(p.log(), [1.0], top_entropy_quantile=0.4, **kw)
    # the 0.6 quantile sits between the 3rd and 4th smallest: the two largest entropies are kept
    keep = torch.tensor([[1.0, 1.0, 0, 0, 0]], dtype=F64)
    close(out["per_token_loss"], keep * (-1.0 - 0.1 * H))
    out, _ = run(p.log(), [1.0], top_entropy_quantile=1.0, **kw)
    close(out["per_token_loss"], -1.0 - 0.1 * H)


def test_rollout_weights_multiply_the_policy_term_only():
    lp = torch.tensor([[-0.5, -1.0]], dtype=F64)
    kw = dict(beta=0.5, ref_logps=lp + 0.3, loss_agg="none")
    kl = 0.5 * (math.exp(0.3) - 1.3)
    out, _ = run(lp, [1.0], rollout_is_weights=torch.tensor([[2.0, 0.5]]), **kw)
    close(out["per_token_loss"], [[-2.0 + kl, -0.5 + kl]])
    for w in (torch.tensor([3.0]), torch.tensor([[3.0]])):
        out, _ = run(lp, [1.0], rollout_is_weights=w, **kw)
        close(out["per_token_loss"], [[-3.0 + kl, -3.0 + kl]])


def test_gtpo_parts_compose_with_other_policy_terms():
    lp = torch.tensor([[-0.5, -1.0]], dtype=F64)
    lam = torch.tensor([[2.0, 0.0]], dtype=F64)
    out, _ = run(lp, [1.0], lam=lam, n_conf=torch.ones(1), old_logps=lp - math.log(7.0),
                 policy_loss="cispo", eps_high=5.0, entropy_penalty=0.1, loss_agg="none")
    Ahat = 1.0 - 0.1 * out["seq_entropy"][0]                  # shaping acts on Ahat
    close(out["per_token_loss"], lam * (-5.0 * Ahat * lp))    # lambda multiplies the cispo term


def test_rollout_is_weights_modes():
    ln = math.log
    old = torch.zeros(2, 3, dtype=F64)
    roll = -torch.tensor([[ln(2), ln(4), float("nan")], [ln(0.25), 0.0, float("-inf")]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])               # the masked-out -inf is ignored
    W = lambda mode, **kw: ref.rollout_is_weights(old, roll, mask, mode, **kw)
    close(W("token_truncate"), [[2, 3, 1], [0.25, 1, 1]])     # NaN difference -> ratio 1
    close(W("token_truncate", clip_min=0.5), [[2, 3, 1], [0.5, 1, 1]])
    close(W("token_mask"), [[2, 0, 1], [0.25, 1, 1]])
    close(W("token_mask", clip_min=0.5), [[2, 0, 1], [0, 1, 1]])
    close(W("sequence_truncate"), [[3], [0.25]])              # exp(ln 8) -> 3; one per completion
    close(W("sequence_mask"), [[0], [0.25]])
    close(W("sequence_mask", clip_min=0.5, clip_max=10.0), [[8], [0]])
    assert W("token_mask").dtype == F64 and W("sequence_mask").shape == (2, 1)


def test_refusals():
    lp = torch.tensor([[-0.5]], dtype=F64)
    bad = [(dict(policy_loss="reinforce"), "policy_loss"), (dict(importance_sampling_level="seq"),
           "importance_sampling_level"), (dict(delta=1.0), "delta"), (dict(top_entropy_quantile=0.0),
           "top_entropy_quantile"), (dict(top_entropy_quantile=1.5), "top_entropy_quantile"),
           (dict(rollout_is_weights=torch.ones(1, 2)), "rollout_is_weights"),
           (dict(rollout_is_weights=-torch.ones(1, 1)), "rollout_is_weights"),
           (dict(rollout_logps=torch.ones(2, 1)), "rollout_logps")]
    bad += [(dict(policy_loss=p, importance_sampling_level="sequence"), "importance_sampling_level")
            for p in ("cispo", "sapo", "vespo")]
    for kw, name in bad:
        with pytest.raises(ValueError, match=name):
            run(lp, [1.0], **kw)
    with pytest.raises(ValueError, match="mode"):
        ref.rollout_is_weights(lp, lp, None, "token_clip")
    with pytest.raises(ValueError, match="clip_min"):
        ref.rollout_is_weights(lp, lp, None, "token_truncate", clip_min=None, clip_max=None)


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
