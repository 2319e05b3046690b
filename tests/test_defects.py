"""Issue 16 item 1: each silently wrong answer, with a test that failed before its fix (float64 reference,
fresh random inputs; tolerances of spec 7)."""
import math

import pytest
import torch
from conftest import TOL, assert_grad_close, assert_value_close

import gtpo_reference as ref
from gtpo_kernels import (PRESETS, GTPOConfig, conflict_weights, gtpo_loss, gtpo_loss_from_logps,
                          linear_gtpo_loss, rollout_is_weights, token_logprobs)

pytestmark = pytest.mark.filterwarnings(  # random batches here may sit above the entropy threshold (tested apart)
    "ignore:gtpo_loss. the entropy filter dropped every completion:UserWarning")

F64 = torch.float64
BACKENDS = ["torch", "triton"]


def _logits(B, T, V, seed, dtype=torch.float32):
    return torch.randn(B, T, V, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype) * 2


# ---------------------------------------------------------------- 1. delta in (1, 1 + eps_high)
R = [0.5, 0.9, 1.05, 1.15, 1.3, 1.7]  # below the clip, inside, around delta, above 1 + eps_high


@pytest.mark.parametrize("delta", [None, 1.1, 1.5])
@pytest.mark.parametrize("clip", [True, False])
def test_ppo_delta_gradient_in_every_region(delta, clip):
    """d loss / d logp against autograd of -min(min(r, delta) A, clip(r, 0.8, 1.2) A) in float64, for every
    clip/delta/sign region, and gtpo_loss's gradient on the logits against gtpo_reference's."""
    g = torch.Generator().manual_seed(7)
    A = torch.tensor([1.0, -1.0] * len(R), dtype=F64) * (0.5 + torch.rand(2 * len(R), generator=g, dtype=F64))
    r = torch.tensor([x for x in R for _ in (0, 1)], dtype=F64)
    logp = -torch.rand(len(A), 1, generator=g, dtype=F64) - 0.5
    old = logp - torch.log(r)[:, None]
    cfg = GTPOConfig.preset("grpo", delta=delta, clip=clip)
    x = logp.clone().requires_grad_()
    out = gtpo_loss_from_logps(x, torch.zeros(len(A), 1, dtype=torch.long), A, old_logps=old, config=cfg)
    out.loss.backward()
    y = logp.clone().requires_grad_()
    rr = torch.exp(y - old)[:, 0]
    r1 = rr if delta is None else torch.minimum(rr, torch.tensor(delta, dtype=F64))
    want = torch.maximum(-r1 * A, -rr.clamp(0.8, 1.2) * A) if clip else -r1 * A
    want.mean().backward()
    assert y.grad.abs().sum() > 0
    assert_value_close("loss", out.loss.detach(), want.mean().detach(), 1e-12)
    assert_value_close("d loss / d logp", x.grad, y.grad, 1e-12)
    # the same batch on logits: gtpo_loss (torch, float64) against the float64 reference, clip_frac too
    z = torch.stack([logp[:, 0], torch.log1p(-logp[:, 0].exp())], -1)[:, None, :]
    zk, zr = z.clone().requires_grad_(), z.clone().requires_grad_()
    ok = gtpo_loss(zk, torch.zeros(len(A), 1, dtype=torch.long), A, old_logps=old, config=cfg, backend="torch")
    ok.loss.backward()
    rk = ref.gtpo_loss(zr, torch.zeros(len(A), 1, dtype=torch.long), A, old_logps=old, **cfg.__dict__)
    rk["loss"].backward()
    assert_grad_close("grad logits", zk.grad, zr.grad, TOL[F64]["grad"])
    assert_value_close("clip_frac", ok.metrics["clip_frac"], rk["metrics"]["clip_frac"], 1e-12)


# ---------------------------------------------------------------- 2, 3. rollout weights' shapes and modes
def _packed(B, lengths, V, seed):
    N = sum(lengths)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)))
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, V, generator=g) * 2, torch.randint(0, V, (N,), generator=g), cu


def test_packed_per_completion_weights_need_b1():
    """Packed, per-token weights are (N,) and per-completion ones (B, 1): (B,) (which is (N,) when
    N == B) is refused with the (B, 1) hint on every entry point; (B, 1) equals the padded form's (B,)
    and (B, 1)."""
    B, V, lengths = 4, 9, [2, 1, 3, 1]
    x, ids, cu = _packed(B, lengths, V, 0)
    N = sum(lengths)
    adv = torch.tensor([1.0, -0.5, 0.3, -1.0])
    w = torch.tensor([0.5, 1.5, 2.0, 0.25])
    kw = dict(config="grpo", cu_seqlens=cu)
    hidden, weight = torch.randn(N, 5), torch.randn(V, 5)
    for call in (lambda w: gtpo_loss(x, ids, adv, rollout_is_weights=w, **kw),
                 lambda w: gtpo_loss_from_logps(-torch.rand(N), ids, adv, rollout_is_weights=w, **kw),
                 lambda w: linear_gtpo_loss(hidden, weight, ids, adv, rollout_is_weights=w, **kw)):
        with pytest.raises(ValueError, match=r"rollout_is_weights .*\(4, 1\)"):
            call(w)
        call(w[:, None])  # accepted
    packed = gtpo_loss(x, ids, adv, rollout_is_weights=w[:, None], **kw).loss
    T = max(lengths)
    xp, idp, mp = torch.zeros(B, T, V), torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T)
    for i, (a, L) in enumerate(zip(cu[:-1].tolist(), lengths)):
        xp[i, :L], idp[i, :L], mp[i, :L] = x[a:a + L], ids[a:a + L], 1
    for wp in (w, w[:, None]):
        padded = gtpo_loss(xp, idp, adv, mp, config="grpo", rollout_is_weights=wp).loss
        assert_value_close("packed = padded", packed, padded, 1e-6)
    assert abs(float(packed - gtpo_loss(x, ids, adv, **kw).loss)) > 1e-3  # the weights count


@pytest.mark.parametrize("mode", ["sequence_truncate", "sequence_mask"])
def test_sequence_mode_weights_enter_vespo_once(mode):
    """rollout_is_weights(mode='sequence_*') is (B, 1): VESPO folds log w once per completion, as the
    reference (spec 9); read per token it would count log w T times."""
    B, T, V = 4, 5, 11
    g = torch.Generator().manual_seed(3)
    z = _logits(B, T, V, 4, F64)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    old = -torch.rand(B, T, generator=g, dtype=F64) * 3
    roll = old + 0.2 * torch.randn(B, T, generator=g, dtype=F64)
    w = rollout_is_weights(old, roll, mask, mode, clip_min=0.2, clip_max=2.5)
    assert w.shape == (B, 1) and ref.rollout_is_weights(old, roll, mask, mode, 0.2, 2.5).shape == (B, 1)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=F64)
    cfg = GTPOConfig.preset("vespo")
    out = gtpo_loss(z, ids, adv, mask, old_logps=old, rollout_is_weights=w, config=cfg, backend="torch")
    r = ref.gtpo_loss(z, ids, adv, mask, old_logps=old, rollout_is_weights=w, **cfg.__dict__)
    assert_value_close("vespo loss", out.loss, r["loss"], 1e-12)
    per_token = gtpo_loss(z, ids, adv, mask, old_logps=old, rollout_is_weights=w.expand(B, T), config=cfg,
                          backend="torch")
    assert abs(float(per_token.loss - out.loss)) > 1e-6  # the test would see log w read T times


# ---------------------------------------------------------------- 4. sapo in float64
def test_sapo_float64_matches_reference():
    B, T, V = 4, 6, 13
    g = torch.Generator().manual_seed(5)
    z = _logits(B, T, V, 6, F64)
    ids = torch.randint(0, V, (B, T), generator=g)
    old = ref.token_logprobs(z, ids)[0] + 0.3 * torch.randn(B, T, generator=g, dtype=F64)
    adv = torch.tensor([1.0, -1.0, 0.7, -0.3], dtype=F64)
    cfg = GTPOConfig.preset("sapo", sapo_temperature_pos=1.3, sapo_temperature_neg=1.05)
    zk, zr = z.clone().requires_grad_(), z.clone().requires_grad_()
    out = gtpo_loss(zk, ids, adv, old_logps=old, config=cfg, backend="torch")
    out.loss.backward()
    r = ref.gtpo_loss(zr, ids, adv, old_logps=old, **cfg.__dict__)
    r["loss"].backward()
    assert_value_close("sapo loss", out.loss.detach(), r["loss"].detach(), 1e-12)
    assert_value_close("per-token", out.per_token_loss, r["per_token_loss"], 1e-12)
    assert_grad_close("grad", zk.grad, zr.grad, 1e-12)


# ---------------------------------------------------------------- 5. empty batches with a quantile
def _empty_calls(V=7):
    """(name, call(cfg) -> (out, leaves)) for every entry point and every empty form."""
    def padded(T, mask=None):
        def call(cfg, backend="torch"):
            x = _logits(2, T, V, 1).requires_grad_()
            return gtpo_loss(x, torch.zeros(2, T, dtype=torch.long), torch.tensor([1.0, -1.0]), mask,
                             group_size=2, config=cfg, backend=backend), [x]
        return call

    def packed(cfg, backend="torch"):
        x = torch.randn(0, V, requires_grad=True)
        return gtpo_loss(x, torch.zeros(0, dtype=torch.long), torch.tensor([1.0]), group_size=1, config=cfg,
                         cu_seqlens=torch.tensor([0, 0]), backend=backend), [x]

    def logps(cfg, backend=None):
        lp, ent = (-torch.rand(2, 3)).requires_grad_(), torch.rand(2, 3).requires_grad_()
        return gtpo_loss_from_logps(lp, torch.zeros(2, 3, dtype=torch.long), torch.tensor([1.0, -1.0]),
                                    torch.zeros(2, 3), entropy=ent, group_size=2, config=cfg), [lp, ent]

    def linear(cfg, backend=None):
        h, w = torch.randn(2, 0, 5, requires_grad=True), torch.randn(V, 5, requires_grad=True)
        return linear_gtpo_loss(h, w, torch.zeros(2, 0, dtype=torch.long), torch.tensor([1.0, -1.0]),
                                group_size=2, config=cfg), [h, w]
    return [("padded T=0", padded(0)), ("all masked", padded(3, torch.zeros(2, 3))), ("packed [0, 0]", packed),
            ("from logps, all masked", logps), ("linear T=0", linear)]


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name,call", _empty_calls())
def test_empty_batch_with_entropy_quantile(preset, name, call):
    """Spec 4: no counted token gives loss 0 and zero gradients, never NaN, whatever the preset."""
    cfg = GTPOConfig.preset(preset, top_entropy_quantile=0.5, entropy_coef=0.01,
                            **({"dro_beta": 0.1} if preset == "dro" else {}))  # dro requires it
    out, leaves = call(cfg)
    out.loss.sum().backward()
    assert torch.equal(out.loss.detach(), torch.zeros_like(out.loss)), (name, out.loss)
    for t in leaves:
        assert t.grad is None or (torch.isfinite(t.grad).all() and (t.grad == 0).all()), name


# ---------------------------------------------------------------- 6. conflict ids outside [0, 2**31)
@pytest.mark.parametrize("bad_id", [-1, 2**31, -(2**40)])
def test_conflict_ids_outside_31_bits(bad_id):
    ids = torch.tensor([[0, 5, 6], [0, 5, 7], [3, 4, 4], [3, 9, 9]])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    bad = ids.clone()
    bad[0, 0] = bad_id  # -1 would be read as 0 (a conflict with row 1) without the check
    for call in (lambda v: conflict_weights(bad, None, adv, 2, validate=v),
                 lambda v: gtpo_loss_from_logps(-torch.rand(4, 3), bad, adv, entropy=torch.rand(4, 3),
                                                group_size=2, validate=v)):
        with pytest.raises(ValueError, match="completion_ids"):
            call(True)
    lam, n_conf = conflict_weights(bad, None, adv, 2, validate=False)
    assert torch.isnan(lam[0]).all() and torch.isnan(n_conf[0])
    assert torch.isfinite(lam[1:]).all() and torch.isfinite(n_conf[1:]).all()
    lam_ok, _ = conflict_weights(ids, None, adv, 2)
    assert torch.equal(lam[2:], lam_ok[2:])
    masked = torch.ones(4, 3)
    masked[0, 0] = 0  # masked out: any id is fine
    conflict_weights(bad, masked, adv, 2)
    out = gtpo_loss_from_logps(-torch.rand(4, 3), bad, adv, entropy=torch.rand(4, 3), group_size=2, validate=False)
    assert torch.isnan(out.loss)


# ---------------------------------------------------------------- 7. non-finite O(B) / O(N) inputs
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("arg", ["advantages", "old_logps", "ref_logps", "rollout_is_weights"])
def test_non_finite_inputs(arg, value):
    B, T, V = 2, 3, 5
    x = _logits(B, T, V, 2)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    kw = dict(advantages=torch.tensor([1.0, -1.0]), old_logps=-torch.rand(B, T), ref_logps=-torch.rand(B, T),
              rollout_is_weights=torch.rand(B, T) + 0.5, config=GTPOConfig.preset("grpo", beta=0.1), group_size=2)
    kw[arg] = kw[arg].clone()
    if arg != "advantages":
        kw[arg][0, 2] = value  # masked out: ignored
        gtpo_loss(x, ids, completion_mask=mask, **kw)
    kw[arg].reshape(-1)[1] = value  # counted
    for call in (lambda v: gtpo_loss(x, ids, completion_mask=mask, validate=v, **kw),
                 lambda v: gtpo_loss_from_logps(-torch.rand(B, T), ids, completion_mask=mask, validate=v, **kw)):
        with pytest.raises(ValueError, match=arg):
            call(True)
        assert torch.isnan(call(False).loss)  # unvalidated: NaN, never a finite number


# ---------------------------------------------------------------- 8. logits_start=None
def test_logits_start_default_needs_one_row_per_token():
    B, P, T, V = 2, 4, 3, 6
    z = _logits(B, P + T, V, 8)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    adv = torch.tensor([1.0, -1.0])
    with pytest.raises(ValueError, match=f"logits_start={P - 1}"):
        gtpo_loss(z, ids, adv, group_size=2)
    with pytest.raises(ValueError, match=f"logits_start={P - 1}"):
        token_logprobs(z, ids)
    with pytest.raises(ValueError, match="logits_start"):
        gtpo_loss(z.reshape(-1, V)[:B * T + 2], ids.reshape(-1), adv, group_size=2,
                  cu_seqlens=torch.tensor([0, T, 2 * T]))
    full = gtpo_loss(z, ids, adv, group_size=2, logits_start=P - 1)
    sliced = gtpo_loss(z[:, P - 1:P - 1 + T].contiguous(), ids, adv, group_size=2)
    assert_value_close("loss", full.loss, sliced.loss, 1e-6)
    assert torch.equal(token_logprobs(z, ids, logits_start=P - 1)[0], token_logprobs(z[:, P - 1:P - 1 + T], ids)[0])


# ---------------------------------------------------------------- 9. num_items_in_batch
def test_num_items_one_rule():
    B, T, V = 2, 3, 5
    x = _logits(B, T, V, 3)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))
    kw = dict(advantages=torch.tensor([1.0, -0.5]), config="dapo", old_logps=-torch.rand(B, T))
    for bad in (0.0, -1.0, float("nan"), torch.tensor(0.0), torch.tensor(-2.0), torch.tensor(float("inf"))):
        with pytest.raises(ValueError, match="num_items_in_batch"):
            gtpo_loss(x, ids, num_items_in_batch=bad, **kw)
        if isinstance(bad, torch.Tensor):
            assert torch.isnan(gtpo_loss(x, ids, num_items_in_batch=bad, validate=False, **kw).loss)
    whole = gtpo_loss(x, ids, num_items_in_batch=1.0, **kw).loss
    for half in (0.5, torch.tensor(0.5)):  # fractional: a global count over the world size; not clamped
        assert_value_close("num_items 0.5", gtpo_loss(x, ids, num_items_in_batch=half, **kw).loss, 2 * whole,
                           1e-6)


# ---------------------------------------------------------------- 10. malformed cu_seqlens unvalidated
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cu", [[1, 2, 4], [0, 3, 2, 4], [0, 2, 3], [0, 2, 9], [0, -3, 4]])
def test_malformed_cu_seqlens_gives_nan(backend, cu):
    """validate=False: no out-of-bounds access, and NaN loss, gradient and outputs (a device-side flag)."""
    x, ids, _ = _packed(len(cu) - 1, [4], 6, 9)
    cu = torch.tensor(cu)
    B = len(cu) - 1
    adv = torch.linspace(-1, 1, B)
    with pytest.raises(ValueError, match="cu_seqlens"):
        gtpo_loss(x, ids, adv, group_size=1, cu_seqlens=cu, backend=backend)
    xg = x.clone().requires_grad_()
    out = gtpo_loss(xg, ids, adv, group_size=1, cu_seqlens=cu, validate=False, backend=backend)
    out.loss.backward()
    assert torch.isnan(out.loss) and torch.isnan(out.logps).all() and torch.isnan(xg.grad).any()
    assert all(bool(torch.isnan(v)) for v in out.metrics.values()), out.metrics  # (no completion is known)
    assert torch.isnan(token_logprobs(x, ids, cu_seqlens=cu, validate=False, backend=backend)[0]).all()
    assert torch.isnan(gtpo_loss_from_logps(-torch.rand(4), ids, adv, entropy=torch.rand(4), group_size=1,
                                            cu_seqlens=cu, validate=False).loss)
    assert torch.isnan(conflict_weights(ids, None, adv, 1, cu_seqlens=cu, validate=False, backend=backend)[0]).all()
    assert math.isnan(float(linear_gtpo_loss(torch.randn(4, 3), torch.randn(6, 3), ids, adv, group_size=1,
                                             cu_seqlens=cu, validate=False).loss))
