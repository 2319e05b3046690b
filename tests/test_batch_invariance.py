"""Spec 14, batch invariance on logits: a counted token's logp and entropy from gtpo_loss and
token_logprobs are bitwise identical (torch.equal) whatever else the call holds: other completions and
their order, padded or packed layout, logits_start (extra rows before the completion's), and other
tokens' kept sets; on every backend (Triton under the interpreter, torch). Drawn by hypothesis: a
batch, a permutation of its completions with extra completions added, and the layout of each call."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples
from gtpo_kernels import gtpo_loss, token_logprobs


@st.composite
def cases(draw):
    return dict(seed=draw(st.integers(0, 2**31 - 1)), B=draw(st.integers(1, 4)), extra=draw(st.integers(1, 3)),
                T=draw(st.integers(1, 7)), V=draw(st.sampled_from([3, 17, 300, 2100])), backend=draw(st.sampled_from(["triton", "torch"])),
                entry=draw(st.sampled_from(["loss", "logprobs"])), start=draw(st.integers(0, 3)),
                packed=draw(st.booleans()), kept=draw(st.sampled_from([None, "top_k", "top_p"])),
                tau=draw(st.sampled_from([1.0, 0.7])), scale=draw(st.sampled_from([1.0, 8.0])))


def _call(c, logits, ids, mask, adv, start, packed, kept_for):
    """(logp, entropy) as (B, T) from one call in the given layout; kept_for: the (B,) per-completion top_k
    (or top_p) values when kept sets are in use."""
    B, T = ids.shape
    kw = dict(backend=c["backend"])
    if kept_for is not None:  # per completion, (B, 1): never ambiguous with per token
        kw[c["kept"]] = kept_for[:, None]
    if packed:
        keep = mask.reshape(-1)
        lengths = mask.sum(1)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        z = logits[:, start:start + T].reshape(B * T, -1)[keep]
        fl = ids.reshape(-1)[keep]
        form = dict(cu_seqlens=cu, max_seqlen=T)
        if c["entry"] == "loss":
            out = gtpo_loss(z, fl, adv, config="grpo", temperature=c["tau"], **form, **kw)
            lp, h = out.logps, out.entropy
        else:
            lp, h = token_logprobs(z, fl, c["tau"], **form, **kw)
        full_lp = torch.zeros(B * T, dtype=lp.dtype)
        full_h = torch.zeros(B * T, dtype=h.dtype)
        full_lp[keep], full_h[keep] = lp, h
        return full_lp.view(B, T), full_h.view(B, T)
    ls = dict(logits_start=start) if start or logits.shape[1] != T else {}
    if c["entry"] == "loss":
        out = gtpo_loss(logits, ids, adv, mask, config="grpo", temperature=c["tau"], **ls, **kw)
        return out.logps, out.entropy
    return token_logprobs(logits, ids, c["tau"], mask, **ls, **kw)


@settings(max_examples=examples(7), deadline=None)  # CI time (the rules' kernel interpreted): nightly runs 70
@given(cases())
def test_a_tokens_logp_and_entropy_do_not_depend_on_the_batch(c):
    g = torch.Generator().manual_seed(c["seed"])
    B, T, V, E = c["B"], c["T"], c["V"], c["extra"]
    n = B + E
    logits = torch.randn(n, T + 4, V, generator=g) * c["scale"]
    ids = torch.randint(0, V, (n, T), generator=g)
    mask = torch.rand(n, T, generator=g) > 0.3
    mask[:, 0] = True
    adv = torch.randn(n, generator=g)
    kept = None
    if c["kept"] == "top_k":
        kept = torch.randint(1, V + 1, (n,), generator=g)
    elif c["kept"] == "top_p":
        kept = torch.rand(n, generator=g) * 0.9 + 0.1
    # call 1: the first B completions alone, padded; a token's logits sit at row 4 + t of `logits`
    a_lp, a_h = _call(c, logits[:B], ids[:B], mask[:B], adv[:B], 4, False, None if kept is None else kept[:B])
    # call 2: all n completions shuffled, in the drawn layout, with logits_start s (padded) over fewer rows
    perm = torch.randperm(n, generator=g)
    s2 = c["start"]
    z2, start2 = (logits[perm], 4) if c["packed"] else (logits[perm][:, 4 - s2:], s2)
    b_lp, b_h = _call(c, z2, ids[perm], mask[perm], adv[perm], start2, c["packed"],
                      None if kept is None else kept[perm])
    inv = torch.argsort(perm)
    b_lp, b_h = b_lp[inv][:B], b_h[inv][:B]
    m = mask[:B]
    assert torch.equal(a_lp[m], b_lp[m]), (a_lp[m] - b_lp[m]).abs().max()
    assert torch.equal(a_h[m], b_h[m]), (a_h[m] - b_h[m]).abs().max()
    assert torch.isfinite(a_lp[m]).all() and (a_h[m] != 0).any() or V == 1


# ---------------------------------------------------------------- the LM head, batch_invariant=True

@st.composite
def head_cases(draw):
    return dict(seed=draw(st.integers(0, 2**31 - 1)), B=draw(st.integers(1, 3)), extra=draw(st.integers(1, 3)),
                T=draw(st.integers(1, 9)), backend=draw(st.sampled_from(["triton", "torch"])),
                dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
                entry=draw(st.sampled_from(["loss-fused", "loss-recompute", "logprobs"])),
                packed=draw(st.booleans()), rows=draw(st.integers(1, 80)), f32=draw(st.booleans()))


def _head_call(c, h, w, ids, mask, adv, rows, packed):
    from gtpo_kernels import linear_gtpo_loss, linear_token_logprobs
    V = w.shape[0]
    kw = dict(backend=c["backend"], batch_invariant=True, memory_budget=rows * V * 16,
              head_dtype=torch.float32 if c["f32"] else None)
    B, T = ids.shape
    if packed:
        keep = mask.reshape(-1)
        form = dict(cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.int64), mask.sum(1).cumsum(0)]), max_seqlen=T)
        args, m = (h.reshape(B * T, -1)[keep], w, ids.reshape(-1)[keep]), None
    else:
        form, args, m = {}, (h, w, ids), mask
    if c["entry"] == "logprobs":
        lp, ent = linear_token_logprobs(*args, 1.0, m, **form, **kw)
    else:
        out = linear_gtpo_loss(*args, adv, m, config="grpo", schedule=c["entry"].split("-")[1], **form, **kw)
        lp, ent = out.logps, out.entropy
    if not packed:
        return lp, ent
    full_lp, full_h = torch.zeros(B * T, dtype=lp.dtype), torch.zeros(B * T, dtype=ent.dtype)
    full_lp[keep], full_h[keep] = lp, ent
    return full_lp.view(B, T), full_h.view(B, T)


@settings(max_examples=examples(14), deadline=None)  # CI time: nightly runs 140
@given(head_cases())
def test_head_batch_invariant_bitwise(c):
    """batch_invariant=True: a counted token's logp and entropy from the head are torch.equal whether its
    completion comes alone (tiles of 1-80 rows) or shuffled among 1-3 others (tiles of another size),
    padded or packed, on both backends and schedules, bf16 or float32, head_dtype None or float32."""
    g = torch.Generator().manual_seed(c["seed"])
    B, T, D, V = c["B"], c["T"], 24, 300
    n = B + c["extra"]
    h = torch.randn(n, T, D, generator=g).to(c["dtype"])
    w = (torch.randn(V, D, generator=g) / 3).to(c["dtype"])
    ids = torch.randint(0, V, (n, T), generator=g)
    mask = torch.rand(n, T, generator=g) > 0.25
    mask[:, 0] = True
    adv = torch.randn(n, generator=g)
    a_lp, a_h = _head_call(c, h[:B], w, ids[:B], mask[:B], adv[:B], c["rows"], False)
    perm = torch.randperm(n, generator=g)
    b_lp, b_h = _head_call(c, h[perm], w, ids[perm], mask[perm], adv[perm], 81 - c["rows"], c["packed"])
    inv = torch.argsort(perm)
    m = mask[:B]
    assert torch.equal(a_lp[m], b_lp[inv][:B][m]) and torch.equal(a_h[m], b_h[inv][:B][m])


def test_head_default_is_not_invariant_and_batch_invariant_is():
    """Why the option exists: on this CPU a float32 GEMM of fewer than 16 rows rounds differently from a
    larger one, so the default head's logp moves with the tile; batch_invariant=True does not. Gradients
    are deterministic call after call."""
    from gtpo_kernels import linear_gtpo_loss, linear_token_logprobs
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(1, 40, 64, generator=g), torch.randn(500, 64, generator=g) / 4
    ids = torch.randint(0, 500, (1, 40), generator=g)
    alone = [linear_token_logprobs(h[:, :3], w, ids[:, :3], batch_invariant=inv)[0] for inv in (False, True)]
    among = [linear_token_logprobs(h, w, ids, batch_invariant=inv)[0][:, :3] for inv in (False, True)]
    assert not torch.equal(alone[0], among[0]) and torch.equal(alone[1], among[1])
    grads = []
    for _ in range(2):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        old = torch.full((1, 40), -6.0)
        linear_gtpo_loss(hh, ww, ids, torch.tensor([1.0]), old_logps=old, config="grpo", batch_invariant=True,
                         memory_budget=7 * 500 * 16).loss.backward()
        grads.append((hh.grad, ww.grad))
    assert grads[0][1].abs().sum() > 0
    assert all(torch.equal(x, y) for x, y in zip(*grads))


def test_head_batch_invariant_refusals():
    from gtpo_kernels import linear_gtpo_loss, linear_token_logprobs
    h, w, ids = torch.randn(2, 3, 8), torch.randn(11, 8), torch.randint(0, 11, (2, 3))
    with pytest.raises(ValueError, match="batch_invariant=True with kept sets"):
        linear_gtpo_loss(h, w, ids, torch.tensor([1.0, -1.0]), batch_invariant=True, top_k=3)
    with pytest.raises(ValueError, match="batch_invariant=True applies to the 'triton' and 'torch' backends"):
        linear_token_logprobs(h, w, ids, batch_invariant=True, backend="reference")
    with pytest.raises(TypeError, match="batch_invariant must be True or False"):
        linear_token_logprobs(h, w, ids, batch_invariant=1)


@pytest.mark.parametrize("rows", [None, 70])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_head_batch_invariant_logits_are_the_projection(backend, rows):
    """batch_invariant=True changes how the logits are computed, not what they are: over tiles of more than
    INVARIANT_ROWS rows (150 counted tokens in one tile, blocks of 64, 64 and 22 rows the last padded, or
    tiles of 70 rows), with bias, logp and entropy within 1e-5 (|x - ref| / max(1, |ref|)) of float64 of the
    exact product h @ W.T + b."""
    from gtpo_kernels import linear_token_logprobs
    g = torch.Generator().manual_seed(6)
    B, T, D, V = 3, 60, 24, 300
    h, w = torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g) / 3
    b = torch.randn(V, generator=g) * 0.2
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.15
    budget = {} if rows is None else dict(memory_budget=rows * 2 * V * 4)
    lp, ent = linear_token_logprobs(h, w, ids, completion_mask=mask, bias=b, batch_invariant=True, backend=backend,
                                    **budget)
    z = torch.log_softmax(h.double() @ w.double().t() + b.double(), -1)
    r_lp, r_h = z.gather(-1, ids[..., None])[..., 0], -(z.exp() * z).sum(-1)
    assert int(mask.sum()) > 2 * 64
    for x, r in ((lp, r_lp), (ent, r_h)):
        err = float(((x[mask].double() - r[mask]).abs() / r[mask].abs().clamp(min=1)).max())
        assert err <= 1e-5, err
