"""The family part of the option space against TRL 1.16's own code: one hypothesis strategy draws TRL's loss
type (all nine), KL with and without bias correction, delta, both clip bounds, the off-policy mask, the
entropy quantile and every vLLM importance-sampling mode together; TRL's `_compute_loss` on a stand-in
trainer and our `gtpo_loss_from_logps` get the same log-probs, and their losses and gradients must agree
(spec 7 tolerances). Skipped without TRL."""
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from conftest import TOL, assert_grad_close, assert_value_close, examples
from gtpo_kernels import GTPOConfig, gtpo_loss_from_logps, rollout_is_weights


TRL_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "gspo", "luspo", "vespo")


@st.composite
def trl_joints(draw):
    """A TRL loss type with its options drawn together (GTPO's parts off): KL with and without bias
    correction, delta, both clip bounds, off-policy mask, entropy quantile, every rollout-weight mode,
    the entropy bonus where TRL's equals spec 9's (token-mean types), on- and off-policy."""
    t = draw(st.sampled_from(TRL_TYPES))
    ppo = t not in ("cispo", "sapo", "vespo")
    o = dict(seed=draw(st.integers(0, 2**31 - 1)), type=t, B=draw(st.integers(1, 5)), T=draw(st.integers(1, 5)),
             off_policy=draw(st.booleans()), beta=draw(st.sampled_from([0.0, 0.05])), bias_kl=draw(st.booleans()),
             delta=draw(st.sampled_from([None, 1.1, 1.5])) if ppo else None,
             eps_low=draw(st.sampled_from([0.2, 0.1])),
             eps_high=draw(st.sampled_from([2.0, 5.0] if t == "cispo" else [0.2, 0.28])),
             threshold=draw(st.sampled_from([None, -0.1, 0.02, 0.5])), rho=draw(st.sampled_from([1.0, 0.3, 0.6])),
             mode=draw(st.sampled_from([None, "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])),
             clip_min=draw(st.sampled_from([None, 0.5])), clip_max=draw(st.sampled_from([1.5, 3.0])),
             coef=draw(st.sampled_from([0.0, 0.03])) if t in ("bnpo", "dapo", "cispo", "vespo") else 0.0,
             sapo_neg=draw(st.sampled_from([1.25, 1.5])))  # exact in float32 (TRL's where on floats)
    if o["coef"]:  # TRL's bonus is the mean of H over the entropy-masked tokens; spec 9 aggregates -coef * H
        o["rho"] = 1.0
    return o


@settings(max_examples=examples(30))
@given(o=trl_joints())
def test_family_equals_trl_compute_loss(o):
    """gtpo_loss_from_logps (float64) against TRL's GRPOTrainer._compute_loss on the same log-probs and
    entropies: the loss and its gradient with respect to both."""
    trl = pytest.importorskip("trl.trainer.grpo_trainer")
    from test_reference_family import TRL_LOSSES, trl_rollout_ratio, trl_stand_in
    event(f"trl loss_type={o['type']}")
    g = torch.Generator().manual_seed(o["seed"])
    B, T, f64 = o["B"], o["T"], torch.float64
    lp_all = torch.log_softmax(2 * torch.randn(B, T, 7, generator=g, dtype=f64), -1)
    ids = torch.randint(0, 7, (B, T), generator=g)
    lp, H = lp_all.gather(-1, ids[..., None])[..., 0], -(lp_all.exp() * lp_all).sum(-1)
    H = H.float().double()  # TRL takes the entropy quantile on a float32 copy: the same values here
    mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).long()
    noise = lambda s: s * torch.randn(B, T, generator=g, dtype=f64)  # noqa: E731
    old, refl = lp + noise(0.25), lp + noise(0.2)
    roll = old + noise(0.3)
    A = torch.randn(B, generator=g, dtype=f64)
    trl_cfg, ref_kw = (dict(x) for x in TRL_LOSSES[o["type"]])
    items = ref_kw.pop("items", False)
    sapo = dict(sapo_temperature_neg=o["sapo_neg"]) if o["type"] == "sapo" else {}
    trl_cfg.update(epsilon=o["eps_low"], epsilon_high=o["eps_high"], beta=o["beta"], delta=o["delta"],
                   use_bias_correction_kl=o["bias_kl"], off_policy_mask_threshold=o["threshold"],
                   top_entropy_quantile=o["rho"], entropy_coef=o["coef"], max_completion_length=9,
                   vllm_importance_sampling_correction=o["mode"] is not None, **sapo)
    if o["mode"]:
        trl_cfg.update(vllm_importance_sampling_mode=o["mode"], vllm_importance_sampling_clip_min=o["clip_min"],
                       vllm_importance_sampling_clip_max=o["clip_max"])
    s = trl_stand_in(trl, "grpo" if o["type"] == "gspo" else o["type"], **trl_cfg)
    type(s)._get_per_token_logps_and_entropies = lambda self, *a, **k: (self.lp, self.H, None)
    inputs = dict(prompt_ids=torch.zeros(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.long),
                  completion_ids=ids, completion_mask=mask, advantages=A, num_items_in_batch=mask.sum().double(),
                  ref_per_token_logps=refl, sampling_per_token_logps=roll)
    if o["off_policy"]:
        inputs["old_per_token_logps"] = old
    w = None
    if o["mode"]:
        inputs["importance_sampling_ratio"] = trl_rollout_ratio(trl, s, old, roll, mask)
        w = rollout_is_weights(old, roll, mask, o["mode"], clip_min=o["clip_min"], clip_max=o["clip_max"])
    s.lp, s.H = lp.clone().requires_grad_(), H.clone().requires_grad_()
    want = s._compute_loss(None, inputs)
    want.backward()
    ref_kw.update(sapo, use_conflict_mask=False, entropy_threshold=None, entropy_penalty=0.0, eps_low=o["eps_low"],
                  eps_high=o["eps_high"], beta=o["beta"], delta=o["delta"], use_bias_correction_kl=o["bias_kl"],
                  off_policy_mask_threshold=o["threshold"], top_entropy_quantile=o["rho"], entropy_coef=o["coef"],
                  max_completion_length=9)
    cfg = GTPOConfig(**ref_kw)
    x, h = lp.clone().requires_grad_(), H.clone().requires_grad_()
    got = gtpo_loss_from_logps(x, ids, A, mask, entropy=h, old_logps=old if o["off_policy"] else None,
                               ref_logps=refl, config=cfg, num_items_in_batch=mask.sum() if items else None,
                               rollout_is_weights=w, rollout_logps=roll)
    got.loss.backward()
    tol = TOL[f64]
    assert_value_close("loss against TRL", got.loss.detach(), want.detach(), tol["loss"])
    assert_grad_close("d loss / d logps against TRL", x.grad, s.lp.grad, tol["grad"])
    if o["coef"]:
        assert_grad_close("d loss / d entropy against TRL", h.grad, s.H.grad, tol["grad"])
