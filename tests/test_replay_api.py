"""The sampler's kept sets in the public calls on logits (spec 13): token_logprobs and gtpo_loss with a
recorded `sampling_mask` or with `top_k` / `top_p` / `min_p`, on the Triton (interpreted) and torch
and reference backends, padded and packed, with a number or per-token temperature. Oracles, float64: the reference's
replay (gtpo_reference.gtpo_sampling) for the values, and the reference loss on logits whose entries
outside each kept set are -inf (the same distribution) for the loss and its gradient. Tolerances: spec 7."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gtpo_reference as ref
from conftest import assert_grad_close, assert_value_close, examples
from gtpo_kernels import GTPOConfig, gtpo_loss, token_logprobs
from gtpo_reference import gtpo_sampling as rs

BACKENDS = ["triton", "torch", "reference"]


def _batch(seed, B=4, T=5, V=48):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=g) * 2.5
    z[..., :3] += 4.0  # a peaked head, as a policy's
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True
    adv = torch.randn(B, generator=g)
    tau = torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5
    return z, ids, mask, adv, tau


def _keep(sm, mask, V):
    """(B, T, V) bool: each counted token's kept set (packed order = row-major over counted positions)."""
    token_ids, offsets = sm
    keep = torch.zeros(*mask.shape, V, dtype=torch.bool)
    pos = mask.nonzero()
    for j, (i, t) in enumerate(pos.tolist()):
        keep[i, t, token_ids[offsets[j]:offsets[j + 1]]] = True
    keep[~mask] = True  # uncounted rows: anything (ignored)
    return keep


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(5))  # (CI time: Triton's interpreter runs the rules' kernel; nightly 50)
@given(seed=st.integers(0, 2**20), rule=st.sampled_from([dict(top_k=6), dict(top_p=0.8), dict(min_p=0.05),
                                                          dict(top_k=10, top_p=0.9, min_p=0.02)]),
       per_token=st.booleans())
def test_token_logprobs_replay_matches_reference(backend, seed, rule, per_token):
    z, ids, mask, _, tau = _batch(seed)
    t = tau.float() if per_token else 0.8
    lp, ent = token_logprobs(z, ids, t, mask, backend=backend, **rule)
    rlp, rent, _, sm = rs.replay_token_logprobs(z.double(), ids, mask, temperature=tau if per_token else 0.8,
                                                **rule)
    assert_value_close("logps (rebuilt sets)", lp, rlp, 1e-5)
    assert_value_close("entropy (rebuilt sets)", ent, rent, 1e-5)
    lp2, ent2 = token_logprobs(z, ids, t, mask, sampling_mask=sm, backend=backend)
    assert_value_close("logps (recorded sets)", lp2, rlp, 1e-5)
    assert_value_close("entropy (recorded sets)", ent2, rent, 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset", ["gtpo", "grpo", "dapo"])
@pytest.mark.parametrize("seed", [0, 1])
def test_gtpo_loss_over_recorded_sets_matches_reference(backend, preset, seed):
    z, ids, mask, adv, tau = _batch(seed)
    cfg = GTPOConfig.preset(preset, entropy_threshold=None) if preset == "gtpo" else GTPOConfig.preset(preset)
    _, _, _, sm = rs.replay_token_logprobs(z.double(), ids, mask, temperature=tau, top_k=8, top_p=0.9)
    g = torch.Generator().manual_seed(seed + 100)
    rlp, _, _, _ = rs.replay_token_logprobs(z.double(), ids, mask, temperature=tau, sampling_mask=sm)
    old = torch.where(mask, rlp + 0.1 * torch.randn(rlp.shape, generator=g, dtype=torch.float64), 0.0).float()
    x = z.clone().requires_grad_()
    out = gtpo_loss(x, ids, adv, mask, group_size=2, old_logps=old, config=cfg, temperature=tau.float(),
                    sampling_mask=sm, backend=backend)
    out.loss.backward()
    zr = z.double().requires_grad_()
    zk = torch.where(_keep(sm, mask, z.shape[-1]), zr, float("-inf")) / tau[..., None]
    r = ref.gtpo_loss(zk, ids, adv, mask, group_size=2, old_logps=old.double(), **(cfg.__dict__ | {"temperature": 1.0}))
    r["loss"].backward()
    assert_value_close("loss", out.loss.detach(), r["loss"].detach(), 1e-5)
    assert_value_close("logps", out.logps, r["logps"], 1e-5)
    assert_value_close("entropy", out.entropy, r["entropy"], 1e-5)
    assert (zr.grad != 0).any()
    assert_grad_close("grad logits", x.grad, zr.grad, 1e-5)
    outside = ~_keep(sm, mask, z.shape[-1]) & mask[..., None]
    assert (x.grad[outside] == 0).all()  # exactly 0 outside the kept sets
    assert float(out.metrics["mean_kept_size"]) == pytest.approx((sm[1][-1] / mask.sum()).item())


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_replay_equals_padded(backend):
    z, ids, mask, adv, tau = _batch(7, T=4)
    mask[:] = True
    B, T, V = z.shape
    cu = torch.arange(0, B * T + 1, T, dtype=torch.int32)
    kw = dict(group_size=2, config="grpo", top_k=7, top_p=0.85, backend=backend)
    zp = z.clone().requires_grad_()
    pad = gtpo_loss(zp, ids, adv, temperature=tau.float(), **kw)
    zk = z.reshape(B * T, V).clone().requires_grad_()
    pk = gtpo_loss(zk, ids.reshape(-1), adv, cu_seqlens=cu, max_seqlen=T, temperature=tau.float().reshape(-1), **kw)
    zr = z.double().requires_grad_()
    r = gtpo_loss(zr, ids, adv.double(), temperature=tau.double(), **dict(kw, backend="reference"))
    for out, x, name in ((pad, zp, "padded"), (pk, zk, "packed")):
        out.loss.backward()
        assert_value_close(f"{name} loss", out.loss, r.loss, 1e-5)
        assert_value_close(f"{name} logps", out.logps.reshape(-1), r.logps.reshape(-1), 1e-5)
        for k in ("mean_kept_size", "replay_restored_frac"):
            assert_value_close(f"{name} {k}", out.metrics[k], r.metrics[k], 1e-6)
    r.loss.backward()
    assert zr.grad.abs().sum() > 0
    assert_grad_close("padded grad", zp.grad, zr.grad, 1e-5)
    assert_grad_close("packed grad", zk.grad.reshape(B, T, V), zr.grad, 1e-5)
    # and the two layouts agree with each other
    assert_value_close("loss", pk.loss, pad.loss, 1e-6)
    assert_value_close("logps", pk.logps, pad.logps.reshape(-1), 1e-6)


def test_replay_refusals_and_nan():
    z, ids, mask, adv, tau = _batch(3)
    _, _, _, sm = rs.replay_token_logprobs(z.double(), ids, mask, top_k=5)
    with pytest.raises(ValueError, match="sampling_mask is given together with top_k"):
        gtpo_loss(z, ids, adv, mask, group_size=2, sampling_mask=sm, top_k=5, backend="torch")
    with pytest.raises(ValueError, match="inplace=True is not taken with sampling_mask"):
        gtpo_loss(z.clone().requires_grad_(), ids, adv, mask, group_size=2, top_p=0.9, inplace=True, backend="torch")
    with pytest.raises(ValueError, match="top_p must be in \\(0, 1\\]"):
        token_logprobs(z, ids, 1.0, mask, top_p=1.5, backend="torch")
    token_ids, offsets = sm
    first = ids[mask][0]
    bad = (torch.where(token_ids == first, (first + 1) % z.shape[-1], token_ids), offsets)  # y leaves its set
    bad_ok = torch.unique_consecutive(bad[0][offsets[0]:offsets[1]]).numel() == offsets[1] - offsets[0]
    if bad_ok:
        with pytest.raises(ValueError, match="sampling_mask: the kept set of counted token"):
            token_logprobs(z, ids, 1.0, mask, sampling_mask=bad, backend="torch")
    wrong = (token_ids, offsets[:-1])
    with pytest.raises(ValueError, match="sampling_mask.offsets must have shape"):
        token_logprobs(z, ids, 1.0, mask, sampling_mask=wrong, backend="torch")
    lp, _ = token_logprobs(z, ids, 1.0, mask, sampling_mask=wrong, backend="torch", validate=False)
    assert torch.isnan(lp[mask]).all()  # a wrong number of sets: every counted token NaN


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan"), float("inf"), 1e-40])
def test_unvalidated_bad_temperature_over_recorded_sets_is_nan(backend, bad):
    """Unvalidated, a temperature that is not finite and > 0 (or whose inverse is not finite) on one
    completion and on one token gives NaN logp and entropy at exactly those counted tokens over recorded
    sets (spec 13), never a finite number (the replay kernel's clamp of log p once turned a NaN 1 / tau into
    entropy 0); the other tokens equal the reference's replay with valid temperatures."""
    z, ids, mask, _, tau = _batch(11)
    _, _, _, sm = rs.replay_token_logprobs(z.double(), ids, mask, top_k=7)
    t = tau.float()
    t[2, :] = bad  # a whole completion
    t[0, 3] = bad  # one token
    poisoned = torch.zeros_like(mask)
    poisoned[2, :], poisoned[0, 3] = True, True
    ok_tau = torch.where(poisoned, torch.ones_like(tau), tau)
    rlp, rent, _, _ = rs.replay_token_logprobs(z.double(), ids, mask, temperature=ok_tau, sampling_mask=sm)
    whole = torch.zeros_like(mask)
    whole[2, :] = True
    rlp_c, rent_c, _, _ = rs.replay_token_logprobs(z.double(), ids, mask, temperature=torch.where(
        whole, torch.ones_like(tau), tau[:, 1:2].expand_as(tau)), sampling_mask=sm)
    for tt, nan_at, rl, re in ((t, poisoned & mask, rlp, rent), (t[:, 1].clone(), whole & mask, rlp_c, rent_c)):
        lp, ent = token_logprobs(z, ids, tt, mask, sampling_mask=sm, backend=backend, validate=False)
        assert torch.isnan(lp[nan_at]).all() and torch.isnan(ent[nan_at]).all(), (lp, ent)
        keep = mask & ~nan_at
        assert_value_close("logps (valid tokens)", lp[keep], rl[keep], 1e-5)
        assert_value_close("entropy (valid tokens)", ent[keep], re[keep], 1e-5)

@pytest.mark.parametrize("entry", ["logits", "head"])
@pytest.mark.parametrize("sets", ["recorded", "top_k"])
def test_unvalidated_bad_temperature_in_the_loss_alike_on_both_backends(sets, entry):
    """gtpo_loss (and linear_gtpo_loss) over kept sets, validate=False, a temperature per completion invalid on
    one completion: the torch backend gives what the Triton path gives, over recorded sets and sets rebuilt by
    rules alike: NaN at that completion's tokens (log-probs, entropies, per-token loss, gradient rows) and in the
    loss, the other completions' outputs finite and equal (the eager path made every output NaN: it read the
    rebuild's own NaN entropy as a caller's invalid input; over recorded sets both did, their kernels poisoning
    the whole batch for a flagged token, where spec 13 makes the affected token's outputs NaN)."""
    from gtpo_kernels import linear_gtpo_loss
    z, ids, mask, adv, tau = _batch(13)
    _, _, _, sm = rs.replay_token_logprobs(z.double(), ids, mask, top_k=7)
    t = tau[:, 0].float().clone()
    t[1] = -1.0
    kw = dict(sampling_mask=sm) if sets == "recorded" else dict(top_k=7)
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(*z.shape[:2], 6, generator=g), torch.randn(z.shape[-1], 6, generator=g)
    outs = {}
    for backend in ("triton", "torch"):
        x = (z if entry == "logits" else w).clone().requires_grad_()
        cfg = GTPOConfig(entropy_coef=0.01)
        if entry == "logits":
            out = gtpo_loss(x, ids, adv, mask, group_size=2, config=cfg, temperature=t, backend=backend,
                            validate=False, **kw)
        else:
            out = linear_gtpo_loss(h, x, ids, adv, mask, group_size=2, config=cfg, temperature=t, backend=backend,
                                   validate=False, **kw)
        out.loss.backward()
        outs[backend] = (out, x.grad)
    others = torch.tensor([True, False, True, True])
    for backend, (out, grad) in outs.items():
        assert torch.isnan(out.loss), backend
        for f in ("logps", "entropy", "per_token_loss"):
            v = getattr(out, f)
            assert torch.isnan(v[~others][mask[~others]]).all() and torch.isfinite(v[others]).all(), (backend, f)
        if entry == "logits":
            rows = grad.isnan().any(-1)  # (over kept sets only the kept columns carry a gradient)
            assert rows[~others][mask[~others]].all() and torch.isfinite(grad[others]).all(), backend
    (o, gr), (e, eg) = outs["triton"], outs["torch"]
    for f in ("logps", "entropy", "per_token_loss"):
        assert torch.equal(getattr(o, f).isnan(), getattr(e, f).isnan()), f
        assert_value_close(f, getattr(o, f)[others], getattr(e, f)[others], 1e-5)
    assert torch.equal(gr.isnan().any(-1), eg.isnan().any(-1))  # (the rows: NaN where kept, or in every column)
    if entry == "logits":
        assert_grad_close("grad", gr[others].double(), eg[others].double(), 1e-4)


def test_float64_metrics_are_float64_exact():
    """A float64 call's kept-set metrics meet the float64 reference to 1e-12 (they were once formed in
    float32: 2.5e-8 off)."""
    z, ids, mask, adv, tau = _batch(12)
    z = z.double()
    out = gtpo_loss(z, ids, adv, mask, group_size=2, config="grpo", temperature=tau, top_k=9, top_p=0.9,
                    backend="torch")
    _, _, rmet, _ = rs.replay_token_logprobs(z, ids, mask, temperature=tau, top_k=9, top_p=0.9)
    for k in ("kept_mass", "mean_kept_size"):
        assert out.metrics[k].dtype == torch.float64
        assert abs(float(out.metrics[k]) - float(rmet[k])) <= 1e-12 * max(1.0, abs(float(rmet[k]))), k
