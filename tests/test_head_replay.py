"""The sampler's kept sets through the LM head (spec 11 and 13): linear_gtpo_loss and
linear_token_logprobs with a recorded `sampling_mask` (only the union of a tile's sets projected) or with
`top_k` / `top_p` / `min_p` (rebuilt from tiles of the whole vocabulary), on the Triton (interpreted),
torch and reference backends, padded and packed, bias, logit_scale and soft-cap, per-token temperature,
tiles of a few rows. Oracles, float64 on the materialized logits: the reference's replay
(gtpo_reference.gtpo_sampling) for the sets and values, and the reference loss on logits whose entries
outside each kept set are -inf (the same distribution), gradients of hidden, weight and bias by float64
autograd through the projection. Tolerances: spec 7 (values 1e-5; head gradients 1e-4, GEMMs over the
columns as tests/test_linear.py)."""
import pytest
import torch

import gtpo_reference as ref
from conftest import assert_grad_close, assert_value_close
from gtpo_kernels import GTPOConfig, linear_gtpo_loss, linear_token_logprobs
from gtpo_kernels.pipeline.head_replay import TILE_ROWS, plan_union
from gtpo_reference import gtpo_sampling as rs

BACKENDS = ["triton", "torch", "reference"]


def _batch(seed, B=4, T=5, D=8, V=48):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64) * 0.9
    w[:3] += 1.5 * h.mean((0, 1)) / h.mean((0, 1)).norm()  # a peaked head, as a policy's
    bias = torch.randn(V, generator=g, dtype=torch.float64) * 0.3
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True
    adv = torch.randn(B, generator=g)
    tau = (torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5).float().double()
    return h, w, bias, ids, mask, adv, tau


def _logits(h, w, bias, scale, cap):
    z = (h @ w.t() + (0 if bias is None else bias)) * scale
    return z if cap is None else cap * torch.tanh(z / cap)


def _keep(sm, mask, V):
    token_ids, offsets = sm
    keep = torch.zeros(*mask.shape, V, dtype=torch.bool)
    for j, (i, t) in enumerate(mask.nonzero().tolist()):
        keep[i, t, token_ids[offsets[j]:offsets[j + 1]]] = True
    keep[~mask] = True
    return keep


def _budget(rows, V):
    return rows * 2 * V * 4  # float32: `rows` rows of logits and gradient over the whole vocabulary


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["mask", "rules"])
@pytest.mark.parametrize("transforms", [(1.0, None), (0.7, 3.0)])
def test_head_loss_over_kept_sets_matches_reference(backend, how, transforms):
    scale, cap = transforms
    h, w, bias, ids, mask, adv, tau = _batch(3 if how == "mask" else 4)
    V = w.shape[0]
    z64 = _logits(h, w, bias, scale, cap)
    rule = dict(top_k=9, top_p=0.9)
    _, _, _, sm = rs.replay_token_logprobs(z64, ids, mask, temperature=tau, **rule)
    cfg = GTPOConfig.preset("gtpo", entropy_threshold=None, entropy_coef=0.01)
    rlp, _, _, _ = rs.replay_token_logprobs(z64, ids, mask, temperature=tau, sampling_mask=sm)
    gen = torch.Generator().manual_seed(9)
    old = torch.where(mask, rlp + 0.1 * torch.randn(rlp.shape, generator=gen, dtype=torch.float64), 0.0).float()
    hc, wc, bc = (x.float().requires_grad_() for x in (h, w, bias))
    kw = dict(sampling_mask=sm) if how == "mask" else rule
    out = linear_gtpo_loss(hc, wc, ids, adv, mask, bias=bc, logit_scale=scale, logit_softcap=cap, group_size=2,
                           old_logps=old, config=cfg, temperature=tau.float(), memory_budget=_budget(3, V),
                           backend=backend, **kw)
    out.loss.backward()
    hr, wr, br = (x.clone().requires_grad_() for x in (h, w, bias))
    keep = _keep(sm, mask, V)
    zk = torch.where(keep, _logits(hr, wr, br, scale, cap), float("-inf")) / tau[..., None]
    r = ref.gtpo_loss(zk, ids, adv, mask, group_size=2, old_logps=old.double(), **(cfg.__dict__ | {"temperature": 1.0}))
    r["loss"].backward()
    assert_value_close("loss", out.loss.detach(), r["loss"].detach(), 1e-5)
    assert_value_close("logps", out.logps, r["logps"], 1e-5)
    assert_value_close("entropy", out.entropy, r["entropy"], 1e-5)
    for name, got, want in (("grad hidden", hc.grad, hr.grad), ("grad weight", wc.grad, wr.grad),
                            ("grad bias", bc.grad, br.grad)):
        assert (want != 0).any(), name
        assert_grad_close(name, got, want, 1e-4)
    unused = ~keep[mask].any(0)  # vocabulary rows in no kept set: exactly no gradient
    assert unused.any() and (wc.grad[unused] == 0).all() and (bc.grad[unused] == 0).all()
    assert float(out.metrics["mean_kept_size"]) == pytest.approx((sm[1][-1] / mask.sum()).item())
    if how == "rules" and backend != "reference":  # the full softmax's mass on each set, against float64
        rows = (z64 / tau[..., None])[mask]
        want = rs.sampling_metrics(rows, rs.kept_sets(rows, 1.0, targets=ids[mask], **rule)[:2])["kept_mass"]
        assert_value_close("kept_mass", out.metrics["kept_mass"], want, 1e-5)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_head_token_logprobs_over_kept_sets_packed(backend):
    h, w, bias, ids, mask, _, tau = _batch(5)
    mask[:] = True
    B, T, D = h.shape
    V = w.shape[0]
    cu = torch.arange(0, B * T + 1, T, dtype=torch.int32)
    z64 = _logits(h, w, None, 1.0, None)
    for rule in (dict(top_k=6), dict(top_p=0.8), dict(min_p=0.05), dict(top_k=10, top_p=0.9, min_p=0.02)):
        rlp, rent, _, sm = rs.replay_token_logprobs(z64, ids, mask, temperature=tau, **rule)
        for kw in (rule, dict(sampling_mask=sm)):
            lp, ent = linear_token_logprobs(h.float().reshape(B * T, D), w.float(), ids.reshape(-1),
                                            tau.float().reshape(-1), cu_seqlens=cu, max_seqlen=T,
                                            memory_budget=_budget(2, V), backend=backend, **kw)
            assert_value_close(f"logps {list(kw)}", lp, rlp.reshape(-1), 1e-5)
            assert_value_close(f"entropy {list(kw)}", ent, rent.reshape(-1), 1e-5)


def test_union_tiles_keep_the_budget():
    """Tiles of rows x min(total set size, V) entries within the budget and at most TILE_ROWS rows (the
    union, so each token's GEMM work, grows with the tile); one set over the budget is refused."""
    sizes = [3, 5, 0, 7, 2, 9, 4]
    tiles = plan_union(sizes, V=20, per_entry=8, budget=8 * 40)
    assert tiles[0][0] == 0 and tiles[-1][1] == len(sizes)
    assert all(a[1] == b[0] for a, b in zip(tiles, tiles[1:]))
    for m0, m1 in tiles:
        assert (m1 - m0) * min(sum(sizes[m0:m1]), 20) * 8 <= 8 * 40 or m1 - m0 == 1
    assert len(tiles) > 1
    roomy = plan_union([2] * 600, V=10**6, per_entry=8, budget=1 << 40)  # a budget holding all: TILE_ROWS bound
    assert [m1 - m0 for m0, m1 in roomy] == [TILE_ROWS, TILE_ROWS, 600 - 2 * TILE_ROWS]
    with pytest.raises(ValueError, match="memory_budget = 64 bytes holds no row of kept logits"):
        plan_union([3, 9], V=20, per_entry=8, budget=64)



def _greedy_union_tiles(sizes, V, per_entry, budget, max_rows):
    """The tiles' definition, row by row: a tile grows while its next row still fits (rows x min(sets'
    total, V) entries within the budget, at most max_rows rows)."""
    tiles, m0 = [], 0
    for m in range(1, len(sizes) + 1):
        if m == len(sizes) or m + 1 - m0 > max_rows or \
                per_entry * (m + 1 - m0) * min(sum(sizes[m0:m + 1]), V) > budget:
            tiles.append((m0, m))
            m0 = m
    return tiles


@pytest.mark.parametrize("seed", range(4))
def test_union_tiles_are_the_greedy_ones(seed):
    """plan_union's bisection gives the row-by-row greedy tiles on random sizes, budgets, V and row bounds
    (zero-size sets, sets over V, single-row tiles), and names the first set over the budget."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(300):
        n, V, mr = (int(x) for x in torch.randint(1, 40, (3,), generator=g))
        sizes = torch.randint(0, 50, (n,), generator=g).tolist()
        per_entry, budget = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(8, 4000, (1,), generator=g))
        over = [m for m, k in enumerate(sizes) if per_entry * min(k, V) > budget]
        if over:
            with pytest.raises(ValueError, match=f"counted token {over[0]}'s kept set of {sizes[over[0]]} ids"):
                plan_union(sizes, V, per_entry, budget, mr)
        else:
            assert plan_union(sizes, V, per_entry, budget, mr) == _greedy_union_tiles(sizes, V, per_entry, budget, mr)
    assert plan_union([], V=5, per_entry=8, budget=64) == []

@pytest.mark.parametrize("backend", ["torch", "triton"])  # (triton: the sets checked on the device, unvalidated)
def test_head_replay_refusals_and_nan(backend):
    h, w, bias, ids, mask, adv, tau = _batch(6)
    hc, wc = h.float(), w.float()
    z64 = _logits(h, w, None, 1.0, None)
    _, _, _, sm = rs.replay_token_logprobs(z64, ids, mask, top_k=5)
    with pytest.raises(ValueError, match="sampling_mask is given together with top_k"):
        linear_gtpo_loss(hc, wc, ids, adv, mask, group_size=2, sampling_mask=sm, top_k=5, backend=backend)
    with pytest.raises(ValueError, match="top_p must be in \\(0, 1\\]"):
        linear_token_logprobs(hc, wc, ids, 1.0, mask, top_p=0.0, backend=backend)
    wrong = (sm[0], sm[1][:-1])
    with pytest.raises(ValueError, match="sampling_mask.offsets must have shape"):
        linear_token_logprobs(hc, wc, ids, 1.0, mask, sampling_mask=wrong, backend=backend)
    lp, _ = linear_token_logprobs(hc, wc, ids, 1.0, mask, sampling_mask=wrong, backend=backend, validate=False)
    assert torch.isnan(lp[mask]).all()  # a wrong number of sets: every counted token NaN
    token_ids, offsets = sm
    first = int(ids[mask][0])
    out_of_set = (torch.where(token_ids[:offsets[1]] == first, (first + 1) % w.shape[0], token_ids[:offsets[1]]),)
    bad = (torch.cat([out_of_set[0], token_ids[offsets[1]:]]), offsets)
    if torch.unique(bad[0][:offsets[1]]).numel() == int(offsets[1]):  # the set stays without repeats
        with pytest.raises(ValueError, match="sampling_mask: the kept set of counted token"):
            linear_token_logprobs(hc, wc, ids, 1.0, mask, sampling_mask=bad, backend=backend)
        lp, _ = linear_token_logprobs(hc, wc, ids, 1.0, mask, sampling_mask=bad, backend=backend, validate=False)
        assert torch.isnan(lp[mask][0]) and torch.isfinite(lp[mask][1:]).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("broken", ["negative", "one-short", "decreasing"])
def test_head_malformed_offsets_unvalidated_give_nan_over_several_tiles(backend, broken):
    """Malformed recorded offsets, unvalidated, over several union tiles: every counted token's outputs NaN, the
    loss NaN, the backward runs, dL/dh is NaN at every counted row and dL/dW, dL/db NaN everywhere (as the whole
    vocabulary's gradient and the reference backend's; they were 0: every set empty), on both backends (the torch
    backend planned the tiles on the raw offsets: a budget error naming a set size the offsets made up, or an
    IndexError)."""
    h, w, bias, ids, mask, adv, _ = _batch(8)
    hc, wc, bc = h.float().requires_grad_(), w.float().requires_grad_(), bias.float().requires_grad_()
    _, _, _, sm = rs.replay_token_logprobs(_logits(h, w, None, 1.0, None), ids, mask, top_k=3)
    token_ids, off = sm
    off = {"negative": torch.where(torch.arange(off.numel()) == 3, -7, off), "one-short": off[:-1],
           "decreasing": torch.cat([off[:4], off[2:3], off[5:]])}[broken]
    budget = 3 * 2 * 4 * 4  # a few rows of three kept logits: several union tiles
    out = linear_gtpo_loss(hc, wc, ids, adv, mask, bias=bc, group_size=2, config="grpo",
                           sampling_mask=(token_ids, off), memory_budget=budget, validate=False, backend=backend)
    assert torch.isnan(out.loss) and torch.isnan(out.logps[mask]).all() and torch.isnan(out.entropy[mask]).all()
    out.loss.backward()
    assert torch.isnan(hc.grad[mask]).all() and (hc.grad[~mask] == 0).all()
    assert torch.isnan(wc.grad).all() and torch.isnan(bc.grad).all()
    lp, _ = linear_token_logprobs(hc.detach(), wc.detach(), ids, 1.0, mask, sampling_mask=(token_ids, off),
                                  memory_budget=budget, validate=False, backend=backend)
    assert torch.isnan(lp[mask]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["rules", "mask"])
def test_head_kept_sets_with_one_invalid_temperature_nan_the_weight_gradient(backend, how):
    """One counted token's temperature -1, unvalidated, over kept sets (rebuilt by top_k, or recorded): the loss
    NaN and dL/dW, dL/db NaN everywhere, as over the whole vocabulary and on the reference backend (the package's
    backends had NaN only at the union of the kept sets' columns, finite elsewhere); dL/dh NaN at that row."""
    h, w, bias, ids, mask, adv, _ = _batch(3)
    hc, wc, bc = h.float().requires_grad_(), w.float().requires_grad_(), bias.float().requires_grad_()
    tau = torch.rand(4, 5, dtype=torch.float64).float() + 0.5
    tau[1, 0] = -1.0
    _, _, _, sm = rs.replay_token_logprobs(_logits(h, w, None, 1.0, None), ids, mask, top_k=3)
    kept = dict(top_k=3) if how == "rules" else dict(sampling_mask=sm)
    out = linear_gtpo_loss(hc, wc, ids, adv, mask, bias=bc, group_size=2, config="grpo", temperature=tau,
                           memory_budget=_budget(2, 48), validate=False, backend=backend, **kept)
    out.loss.backward()
    assert torch.isnan(out.loss) and torch.isnan(hc.grad[1, 0]).all()
    assert torch.isnan(wc.grad).all() and torch.isnan(bc.grad).all()
