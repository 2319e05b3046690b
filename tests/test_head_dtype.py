"""Spec 14, a float32 head: `head_dtype=torch.float32` on linear_gtpo_loss and linear_token_logprobs
projects 16-bit hidden and weight in float32, so logp and entropy are within 1e-6 (|x - ref| / max(1,
|ref|)) of float64 of the exact product of the 16-bit inputs, on every schedule (fused, recompute, the
kept-set replay by recorded sets and by rules), both backends, padded and packed, with bias, scale and
softcap, where the default (each logit rounded to 16 bits) is off by orders of magnitude more. Gradients
keep the inputs' dtypes and match the float64 gradient to 16-bit rounding."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gtpo_reference as ref
from conftest import examples
from gtpo_kernels import linear_gtpo_loss, linear_token_logprobs

TOL = 1e-6


def _exact_logits(h, w, b, scale, cap):
    z = h.double() @ w.double().t()
    z = (z if b is None else z + b.double()) * scale
    return z if cap is None else cap * torch.tanh(z / cap)


@st.composite
def cases(draw):
    return dict(seed=draw(st.integers(0, 2**31 - 1)), dtype=draw(st.sampled_from([torch.bfloat16, torch.float16])),
                backend=draw(st.sampled_from(["torch", "triton"])),
                path=draw(st.sampled_from(["auto", "fused", "recompute", "top_k", "sampling_mask", "logprobs"])),
                packed=draw(st.booleans()), bias=draw(st.booleans()), cap=draw(st.sampled_from([None, 8.0])),
                scale=draw(st.sampled_from([1.0, 0.5])), tau=draw(st.sampled_from([1.0, 0.8])))


def _batch(c):
    g = torch.Generator().manual_seed(c["seed"])
    B, T, D, V = 3, 4, 48, 200
    h = torch.randn(B, T, D, generator=g).to(c["dtype"])
    w = (torch.randn(V, D, generator=g) / 3).to(c["dtype"])
    b = (torch.randn(V, generator=g) * 0.2).to(c["dtype"]) if c["bias"] else None
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True
    return h, w, b, ids, mask, torch.tensor([1.0, -1.0, 0.5])


def _call(c, head_dtype, h, w, b, ids, mask, adv):
    """(logp, entropy) of the counted tokens, flat, and the reference's on the exact product."""
    z64 = _exact_logits(h, w, b, c["scale"], c["cap"])
    kw = dict(bias=b, logit_scale=c["scale"], logit_softcap=c["cap"], backend=c["backend"], head_dtype=head_dtype)
    kept = {}
    if c["path"] == "top_k":
        kept = dict(top_k=7)
    elif c["path"] == "sampling_mask":  # each token's recorded set: the 5 largest exact logits and its own id
        top = z64.topk(5, dim=-1).indices
        sets = [sorted(set(top[i, t].tolist()) | {int(ids[i, t])}) for i in range(ids.shape[0])
                for t in range(ids.shape[1]) if mask[i, t]]  # one per counted token, in the packed order
        kept = dict(sampling_mask=(torch.tensor([v for s in sets for v in s]),
                                   torch.tensor([0] + [len(s) for s in sets]).cumsum(0)))
    if c["path"] in ("top_k", "sampling_mask"):
        r_lp, r_h = ref.replay_token_logprobs(z64, ids, mask, temperature=c["tau"], **kept)[:2]
    else:
        r_lp, r_h = ref.token_logprobs(z64, ids, c["tau"], mask)
    if c["packed"] and c["path"] != "sampling_mask":
        keep = mask.reshape(-1)
        form = dict(cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(1).cumsum(0)]),
                    max_seqlen=ids.shape[1])
        args = (h.reshape(-1, h.shape[-1])[keep], w, ids.reshape(-1)[keep])
        m, want = None, (r_lp[mask], r_h[mask])
    else:
        form, args, m, want = {}, (h, w, ids), mask, (r_lp, r_h)
    if c["path"] == "logprobs":
        lp, ent = linear_token_logprobs(*args, c["tau"], m, **form, **kw)
    else:
        sched = c["path"] if c["path"] in ("auto", "fused", "recompute") else "auto"
        out = linear_gtpo_loss(*args, adv, m, config="grpo", temperature=c["tau"], schedule=sched, **form, **kw,
                               **kept)
        lp, ent = out.logps, out.entropy
    sel = mask if m is not None else slice(None)
    return (lp[sel], ent[sel]), (want[0][sel], want[1][sel])


def _err(x, r):
    return float(((x.double() - r) .abs() / r.abs().clamp(min=1)).max())


@settings(max_examples=examples(30), deadline=None)
@given(cases())
def test_float32_head_is_the_exact_product_to_1e6(c):
    h, w, b, ids, mask, adv = _batch(c)
    (lp, ent), (r_lp, r_h) = _call(c, torch.float32, h, w, b, ids, mask, adv)
    assert lp.dtype == torch.float32 and torch.isfinite(lp).all()
    assert _err(lp, r_lp) <= TOL and _err(ent, r_h) <= TOL, (_err(lp, r_lp), _err(ent, r_h))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_default_rounds_each_logit_and_float32_does_not(dtype):
    """The same call with head_dtype None (each logit the GEMM's 16-bit output) is far from the exact
    product: the difference the option removes."""
    c = dict(seed=4, dtype=dtype, backend="triton", path="auto", packed=False, bias=True, cap=None, scale=1.0,
             tau=1.0)
    h, w, b, ids, mask, adv = _batch(c)
    (lp32, _), (r_lp, _) = _call(c, torch.float32, h, w, b, ids, mask, adv)
    (lp16, _), _ = _call(c, None, h, w, b, ids, mask, adv)
    assert _err(lp32, r_lp) <= TOL < 100 * TOL < _err(lp16, r_lp)


@pytest.mark.parametrize("every_token", [False, True])
@pytest.mark.parametrize("schedule", ["fused", "recompute", "top_k"])
def test_float32_head_gradients_keep_the_inputs_dtypes(schedule, every_token):
    """dL/dhidden, dL/dweight, dL/dbias in bf16, within 16-bit rounding (1e-2, spec 7) of the float64
    gradient of the loss on the exact product (the reference's, through the same kept sets), and at least
    99% of their entries that float64 gradient rounded to bf16 (each a float32 product rounded once)."""
    c = dict(seed=9, dtype=torch.bfloat16, backend="triton", path=schedule, packed=False, bias=True, cap=None,
             scale=1.0, tau=1.0)
    h, w, b, ids, mask, adv = _batch(c)
    if every_token:  # no mask: a tile's rows are consecutive tokens, dL/dh written in place by its GEMM
        mask = torch.ones_like(mask)
    old = torch.randn(ids.shape, generator=torch.Generator().manual_seed(2)) * 0.3 - 3.0
    kept = dict(top_k=7) if schedule == "top_k" else {}
    leaves = [x.clone().requires_grad_() for x in (h, w, b)]
    out = linear_gtpo_loss(*leaves[:2], ids, adv, None if every_token else mask, bias=leaves[2], config="grpo",
                           old_logps=old, schedule="auto" if kept else schedule, head_dtype=torch.float32, **kept)
    out.loss.backward()
    r_leaves = [x.double().requires_grad_() for x in (h, w, b)]
    z64 = r_leaves[0] @ r_leaves[1].t() + r_leaves[2]
    if kept:  # the replay's sets, rebuilt by the reference on the counted rows; the others keep everything
        (tok, off), _ = ref.kept_sets(z64.detach()[mask], top_k=7, targets=ids[mask])[:2], None
        rows = torch.zeros(int(mask.sum()), z64.shape[-1], dtype=torch.bool)
        for r in range(rows.shape[0]):
            rows[r, tok[off[r]:off[r + 1]]] = True
        keep = torch.ones(z64.shape, dtype=torch.bool)
        keep[mask] = rows
        z64 = torch.where(keep, z64, torch.full_like(z64, float("-inf")))
    r = ref.gtpo_loss(z64, ids, adv.double(), mask, old_logps=old.double(), use_conflict_mask=False,
                      entropy_threshold=None, entropy_penalty=0.0)
    r["loss"].backward()
    for x, rx in zip(leaves, r_leaves):
        assert x.grad.dtype == torch.bfloat16
        assert float(rx.grad.norm()) > 0
        rel = float((x.grad.double() - rx.grad).norm() / rx.grad.norm())
        assert rel <= 1e-2, rel
        # a float32 product rounded once to bf16: the float64 gradient's rounding but for float32's own error
        # (measured: at most 0.3% of the entries; a bf16 operand in dL/dh's GEMM moves 35-38% of them)
        moved = float((x.grad != rx.grad.to(torch.bfloat16))[rx.grad != 0].double().mean())
        assert moved <= 0.01, moved


def test_head_dtype_refusals():
    h, w = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(11, 8, dtype=torch.float64)
    ids = torch.randint(0, 11, (2, 3))
    with pytest.raises(ValueError, match="head_dtype=torch.float32 would round float64"):
        linear_token_logprobs(h, w, ids, head_dtype=torch.float32)
    with pytest.raises(ValueError, match="head_dtype must be None"):
        linear_token_logprobs(h.float(), w.float(), ids, head_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dtype must be None"):
        linear_gtpo_loss(h.float(), w.float(), ids, torch.tensor([1.0, -1.0]), head_dtype="float32")
    a = linear_token_logprobs(h.float(), w.float(), ids, head_dtype=torch.float32)  # float32 inputs: a no-op
    assert all(torch.equal(x, y) for x, y in zip(a, linear_token_logprobs(h.float(), w.float(), ids)))


def test_the_accuracy_script_runs_small():
    """python -m bench.head_dtype (docs/accuracy.md's table) at a small size: the float32 head's logp error
    below the default's."""
    from bench.head_dtype import measure
    rows = measure(16, 64, 700)
    err = [float(r.split("logp error max ")[1].split(",")[0]) for r in rows[1:]]
    assert err[1] < 1e-5 < err[0], rows
    from bench.head_dtype import SETTINGS, timing  # gpu_check.sh's step 4c, at a tiny size on the CPU
    rows = timing(64, 16, 300, "cpu", reps=1)
    assert [r.split(":")[0] for r in rows[1:]] == [name for name, _ in SETTINGS], rows
