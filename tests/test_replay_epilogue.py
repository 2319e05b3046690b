"""The loss math in the epilogue kernel over the sampler's kept sets (pipeline/logps_epilogue.py): gtpo_loss
with sampling_mask (the recorded sets: kernels/logps_ops.replay_epilogue) or top_k on Triton against its
eager twin (the torch backend: the replay, then loss.logps_loss) and the float64 reference: outputs, spec 13's
and 14's metrics and the gradient, logits_start and sliced logits, tau per token, by value and the config's
tensor; each invalid kept set NaN unvalidated and the twin's error validating; the calls trace under
torch.compile(fullgraph=True). Tolerances: spec 7 (float32: 1e-5)."""
import pytest
import torch
from conftest import assert_grad_close, assert_value_close
from test_logps_epilogue import TOL, _compare, _metrics_equal, _nan_where_counted
from test_sampling_replay import rollout

import gtpo_reference as ref
from bench.launches import counting
from gtpo_kernels import GTPOConfig, gtpo_loss, gtpo_loss_from_logps


def _sets(seed, packed, B=4, T=4, V=60, start=0):
    """A rollout (tests/test_sampling_replay.rollout: kept sets drawn as an engine draws them) as gtpo_loss
    takes it: (logits, ids, advantages, mask, temperature, sampling_mask, extra keywords)."""
    z, mask, tau, y, sets = rollout(seed, B=B, T=T, V=V, top_k=8, start=start)
    ids = torch.zeros(mask.shape, dtype=torch.long).masked_scatter(mask, y)
    adv = torch.randn(B, generator=torch.Generator().manual_seed(seed))
    if not packed:
        return z, ids, adv, mask, tau, sets, dict(logits_start=start) if start else {}
    cu = torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(1).cumsum(0)])
    return z[mask], y, adv, None, tau[mask], sets, dict(cu_seqlens=cu)


RECORDED = [("seq-mean-token-mean", False, "token", "start"), ("none", True, "number", "plain"),
            ("token-mean", True, "config", "plain"), ("gtpo-official", False, "number", "sliced")]
# each case's drawn rollout weights: per token, per completion (B, 1), per token, per completion (B,) padded
RECORDED_WEIGHTS = ["token", "completion", "token", "completion-flat"]


@pytest.mark.parametrize("agg,packed,tau,layout", RECORDED)
def test_recorded_sets_match_twin_and_reference(agg, packed, tau, layout):
    """Logits with logits_start, or a view with rows of stride more than T V (a model's logits sliced), or
    packed; tau per token, a number, the config's tensor; rollout log-probs (spec 14's metrics) once; rollout
    weights per token or per completion (RECORDED_WEIGHTS)."""
    z, ids, adv, mask, taus, sets, kw = _sets(3, packed, start=int(layout == "start"))
    weights = RECORDED_WEIGHTS[RECORDED.index((agg, packed, tau, layout))]
    if layout == "sliced":  # logits[:, :T] of (B, T + 2, V) logits
        z = torch.cat([z, torch.randn(z.shape[0], 2, z.shape[2], generator=torch.Generator().manual_seed(2))], 1)
    view = (lambda x: x[:, :ids.shape[1]]) if layout == "sliced" else (lambda x: x)
    temperature = {"token": taus, "number": 0.8, "config": None}[tau]
    cfg = GTPOConfig.preset("gtpo", loss_agg=agg, entropy_coef=0.01, entropy_threshold=None, beta=0.04,
                            temperature=torch.tensor(0.9) if tau == "config" else 1.0)
    # old and ref log-probs off the replayed ones (the reference's, float64)
    base = gtpo_loss(view(z.double()), ids, adv.double(), mask, sampling_mask=sets, temperature=temperature,
                     config=cfg.replace(beta=0.0), group_size=2, backend="reference", **kw).logps
    g = torch.Generator().manual_seed(9)
    gap = torch.randn(base.shape, generator=g, dtype=torch.float64)
    kw.update(old_logps=(base + 0.3 * torch.randn(base.shape, generator=g, dtype=torch.float64)).float(),
              ref_logps=(base + 0.1 * torch.sign(gap) * (0.5 + gap.abs())).float())
    B = adv.shape[0]
    kw["rollout_is_weights"] = torch.rand(ids.shape if weights == "token" else (B, 1) if weights == "completion"
                                          else (B,), generator=g) + 0.5
    if tau == "config":
        kw["rollout_logps"] = (base + 0.2 * torch.randn(base.shape, generator=g, dtype=torch.float64)).float()
    counted = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask
    up = torch.where(counted, torch.rand(ids.shape, generator=g) + 0.5, torch.full(ids.shape, float("inf")))
    runs = {}
    for backend in ("triton", "torch", "reference"):
        x = (z.double() if backend == "reference" else z).clone().requires_grad_()
        k = {key: v.double() if backend == "reference" and torch.is_tensor(v) and v.is_floating_point() else v
             for key, v in kw.items()}
        with counting() as c:
            out = gtpo_loss(view(x), ids, adv, mask, sampling_mask=sets, temperature=temperature, config=cfg,
                            group_size=2, validate=False, backend=backend, **k)
            if out.loss.dim():
                out.loss.backward(torch.where(counted, up, 0.0).double() if backend == "reference" else up)
            else:
                out.loss.backward()
        runs[backend] = (out, x.grad, c)
    (out, grad, c), (twin, tgrad, _), (r, rgrad, _) = runs["triton"], runs["torch"], runs["reference"]
    assert dict(c.triton_names) == {"_conflict_weights_kernel": 1, "_flat_sets_kernel": 1, "_replay_fwd_kernel": 1,
                                    "_set_check_kernel": 1, "_epilogue_kernel": 1, "_scale_kernel": 1,
                                    "_replay_bwd_kernel": 1}
    assert rgrad.abs().sum() > 0
    for name, other, og in (("triton vs torch", twin, tgrad), ("triton vs reference", r, rgrad)):
        _compare(name, out, other, counted, False)
        _metrics_equal(out, other, ordered=other is twin)  # (the reference adds the replay's metrics last)
        assert_grad_close(f"{name} grad", grad.reshape(-1, grad.shape[-1]), og.reshape(-1, grad.shape[-1]).double(),
                          TOL)
    if "rollout_logps" in kw:
        assert "rollout_k3" in out.metrics


def test_rules_replay_takes_the_epilogue():
    """Kept sets rebuilt by top_k: one launch writes them as thresholds, which the vocabulary kernels read,
    around the same epilogue as the twin's surrogate, with rollout weights per completion ((B,), padded) and
    conflict weights computed in the call: 6 launches, against the twin's kept sets listed and replayed."""
    z, ids, adv, mask, taus, sets, kw = _sets(4, False)
    w = torch.rand(adv.shape, generator=torch.Generator().manual_seed(4)) + 0.5
    runs = {}
    for backend in ("triton", "torch"):
        x = z.clone().requires_grad_()
        with counting() as c:
            out = gtpo_loss(x, ids, adv, mask, top_k=5, temperature=0.7, config="gtpo", group_size=2,
                            rollout_is_weights=w, validate=False, backend=backend)
            out.loss.backward()
        runs[backend] = (out, x.grad, c)
    (out, grad, c), (twin, tgrad, _) = runs["triton"], runs["torch"]
    assert dict(c.triton_names) == {"_conflict_weights_kernel": 1, "_kept_rule_kernel": 1, "_vocab_fwd_kernel": 1,
                                    "_epilogue_kernel": 1, "_vocab_bwd_kernel": 1}, dict(c.triton_names)
    assert c.launches == 6 and c.host_reads == 0, (c.launches, dict(c.ops), dict(c.reads))
    _compare("top_k", out, twin, mask, False)
    _metrics_equal(out, twin)
    assert tgrad.abs().sum() > 0
    assert_grad_close("top_k grad", grad.reshape(-1, z.shape[-1]), tgrad.reshape(-1, z.shape[-1]).double(), TOL)


@pytest.mark.parametrize("bad", ["repeated", "missing", "offsets", "count", "nan_logit"])
def test_invalid_kept_sets_unvalidated_nan_validated_the_twins_error(bad):
    """A kept set repeating an id, a sampled token missing from its set, malformed offsets, a wrong number
    of sets, a NaN kept logit: validate=False gives NaN at the affected token (spec 13; the others' log-probs
    finite and the twin's) and in the loss, at every counted token where no set can be attributed (malformed
    offsets, a wrong number of sets), as the twin; validate=True the twin's error."""
    z, ids, adv, mask, taus, (tok, off), _ = _sets(5, False)
    tok, off, z, ids = tok.clone(), off.clone(), z.clone(), ids.clone()
    pos = mask.nonzero()
    if bad == "repeated":  # two ids other than the sampled one (the replay kernel flags a sampled id twice)
        m = next(m for m in range(len(pos)) if off[m + 1] - off[m] >= 3)
        b, t = pos[m].tolist()
        others = [k for k in range(int(off[m]), int(off[m + 1])) if tok[k] != ids[b, t]]
        tok[others[1]] = tok[others[0]]
    elif bad == "missing":
        b, t = pos[3].tolist()
        ids[b, t] = int(next(v for v in range(z.shape[-1]) if v not in tok[off[3]:off[4]].tolist()))
    elif bad == "offsets":
        off[2] = off[1] - 1
    elif bad == "count":
        off = off[:-1]
        tok = tok[:int(off[-1])]
    else:
        b, t = pos[4].tolist()
        z[b, t, tok[int(off[4])]] = float("nan")
    errors, outs = {}, {}
    for backend in ("triton", "torch"):
        out = outs[backend] = gtpo_loss(z, ids, adv, mask, sampling_mask=(tok, off), config="gtpo", group_size=2,
                                        validate=False, backend=backend)
        if bad in ("offsets", "count"):
            _nan_where_counted(out, mask)
        else:  # the affected token alone among the log-probs: (b, t) above
            assert torch.isnan(out.loss), backend
            hit = torch.zeros_like(mask)
            hit[b, t] = True
            for f in ("logps", "entropy"):
                v = getattr(out, f)
                assert torch.isnan(v[hit]).all() and torch.isfinite(v[mask & ~hit]).all(), (backend, f, bad)
        with pytest.raises(ValueError) as e:
            gtpo_loss(z, ids, adv, mask, sampling_mask=(tok, off), config="gtpo", group_size=2, backend=backend)
        errors[backend] = str(e.value)
    assert errors["triton"] == errors["torch"], errors
    for f in ("logps", "entropy", "per_token_loss"):
        a, e = getattr(outs["triton"], f), getattr(outs["torch"], f)
        assert torch.equal(a.isnan(), e.isnan()), f
        assert_value_close(f, a[~a.isnan()], e[~e.isnan()], TOL)


@pytest.mark.parametrize("bad", ["none", "adv", "old", "mask", "id", "max_seqlen", "weight"])
def test_recorded_sets_validate_in_the_kernels(bad):
    """Validating, the recorded sets' path makes its value checks in the kernels (the batch's and the sets'):
    a valid call makes 8 launches and one host read (the status word); an invalid input raises the torch
    path's error (the host checks run after the status word, to name it). Rollout weights in every call (per
    token padded, per completion packed; "weight": a NaN one at a counted token)."""
    packed = bad == "max_seqlen"
    z, ids, adv, mask, _, (tok, off), kw = _sets(7, packed)
    g = torch.Generator().manual_seed(3)
    old = torch.randn(ids.shape, generator=g) * 0.1 - 2.0
    mask = None if mask is None else mask.float()
    ids, adv = ids.clone(), adv.clone()
    if packed:
        kw["max_seqlen"] = int((kw["cu_seqlens"][1:] - kw["cu_seqlens"][:-1]).max()) - 1
    elif bad == "adv":
        adv[2] = float("nan")
    at = tuple(mask.nonzero()[2].tolist()) if mask is not None else None  # a counted token
    if bad == "old":
        old[at] = float("inf")
    elif bad == "mask":
        mask[at] = 2.0
    elif bad == "id":
        ids[at] = z.shape[-1]
    w = torch.rand(ids.shape if not packed else (adv.shape[0], 1), generator=g) + 0.5
    if bad == "weight":
        w[at] = float("nan")
    for backend in ("triton", "torch"):
        x = z.clone().requires_grad_()
        call = lambda: gtpo_loss(x, ids, adv, mask, sampling_mask=(tok, off), old_logps=old,  # noqa: E731
                                 rollout_is_weights=w, config="grpo", backend=backend, **kw)
        if bad == "none":
            with counting() as c:
                call().loss.backward()
            if backend == "triton":
                assert (c.launches, c.host_reads, c.creations) == (8, 1, 0), (c.launches, dict(c.reads), dict(c.ops))
            assert x.grad.abs().sum() > 0
            continue
        with counting() as c, pytest.raises(ValueError) as e:
            call()
        if backend == "triton":
            assert c.triton_names.get("_epilogue_kernel") == 1, dict(c.triton_names)
            error = str(e.value)
        else:
            assert str(e.value) == error


def test_calls_trace_whole_under_torch_compile():
    """torch.compile(fullgraph=True) traces both calls on Triton (custom ops: no graph break) and gives the
    eager call's numbers."""
    z, ids, adv, mask, taus, sets, _ = _sets(6, False)
    lp, H = (x.float() for x in ref.token_logprobs(z.double(), ids, 1.0, mask))
    cfg = GTPOConfig.preset("gtpo", entropy_threshold=None, entropy_coef=0.01)

    def step(x, h, logits):
        a = gtpo_loss_from_logps(x, ids, adv, mask, entropy=h, config=cfg, group_size=2, backend="triton")
        b = gtpo_loss(logits, ids, adv, mask, sampling_mask=sets, temperature=taus, config=cfg, group_size=2,
                      backend="triton")
        return a.loss + b.loss, a.per_token_loss, b.logps

    torch._dynamo.reset()
    got, want = [], []
    for fn, acc in ((torch.compile(step, fullgraph=True, backend="aot_eager"), got), (step, want)):
        x, h, logits = lp.clone().requires_grad_(), H.clone().requires_grad_(), z.clone().requires_grad_()
        out = fn(x, h, logits)
        out[0].backward()
        acc += [*out, x.grad, h.grad, logits.grad]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert all(g.abs().sum() > 0 for g in want[3:])
