"""Replay over the kept sets (spec 13): log-probs, entropies and gradients of the torch and Triton
backends against the float64 reference, on kept sets drawn the way a rollout engine draws them (top_p
0.95 / top_k 50 from peaked distributions, the sampled token drawn from the truncated distribution);
the gradient exactly 0 outside the kept sets; NaN, never a finite number, for invalid unvalidated input."""
import pytest
import torch
from conftest import TOL, assert_grad_close, assert_value_close

import gtpo_reference as ref
from gtpo_kernels.core.sampling import check_sampling_mask
from gtpo_kernels.kernels.replay import counted_rows, replay_logprobs
from gtpo_kernels.kernels.tile_union import tile_unions


def rollout(seed, B=3, T=6, V=300, dtype=torch.float32, top_k=50, top_p=0.95, start=1):
    """Logits (B, start + T, V) of peaked rows, a mask, per-token tau, and kept sets with sampled ids as
    an engine records them (sets from the dtype's logits, y drawn inside each set)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, start + T, V, generator=g) * (1 + 2 * torch.rand(B, start + T, 1, generator=g))
    hot = torch.randint(0, V, (B, start + T, 4), generator=g)
    z.scatter_add_(-1, hot, 2 + 6 * torch.rand(B, start + T, 4, generator=g))  # a few confident tokens
    z = z.to(dtype)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[0, 0] = True
    tau = 0.6 + 0.8 * torch.rand(B, T, generator=g)
    rows = z[:, start:][mask].double()
    t_m = tau[mask].double()
    ids, off, _ = ref.kept_sets(rows, t_m, top_k, top_p)
    y = torch.empty(rows.shape[0], dtype=torch.long)
    for r in range(rows.shape[0]):
        k = ids[off[r]:off[r + 1]]
        y[r] = k[torch.multinomial(torch.softmax(rows[r, k] / t_m[r], 0), 1, generator=g)]
    return z, mask, tau, y, (ids, off)


def _zprime(z, scale, softcap):
    z = z * scale
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def _check(backend, dtype, tau_per_token, scale=1.0, softcap=None, entropy_grad=True, seed=0):
    start = 1
    z, mask, tau, y, (ids, off) = rollout(seed, dtype=dtype, start=start)
    B, T_l, V = z.shape
    rb, rt = counted_rows(mask, mask.shape, start)
    t_m = tau[mask] if tau_per_token else 0.8
    x = z.clone().requires_grad_()
    logp, ent, flags = replay_logprobs(x, rb, rt, y, t_m, ids, off, scale=scale, softcap=softcap, backend=backend)
    assert (flags == 0).all()
    w1 = torch.randn(logp.shape[0], generator=torch.Generator().manual_seed(7))
    w2 = torch.randn(logp.shape[0], generator=torch.Generator().manual_seed(8)) if entropy_grad else None
    (logp * w1 + (ent * w2 if entropy_grad else 0)).sum().backward()
    xr = z.double().requires_grad_()
    rows = _zprime(xr[:, start:][mask], scale, softcap)
    lr, hr = ref.replay_logprobs(rows, y, (ids, off), t_m.double() if tau_per_token else t_m)
    (lr * w1.double() + (hr * w2.double() if entropy_grad else 0)).sum().backward()
    tol = TOL[dtype]
    assert_value_close("logp", logp.detach(), lr.detach(), tol["value"])
    assert_value_close("entropy", ent.detach(), hr.detach(), tol["value"])
    assert xr.grad.abs().sum() > 0
    assert_grad_close("grad logits", x.grad.reshape(-1, V), xr.grad.reshape(-1, V), tol["grad"])
    # exactly 0 outside the kept sets (and on rows that predict no counted token)
    kept = torch.zeros(B, T_l, V, dtype=torch.bool)
    seg = torch.repeat_interleave(torch.arange(y.numel()), off[1:] - off[:-1])
    kept[rb[seg], rt[seg], ids] = True
    assert (x.grad[~kept] == 0).all()
    assert (xr.grad[~kept] == 0).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_matches_reference(backend, dtype):
    _check(backend, dtype, tau_per_token=True, seed=1)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_replay_number_tau_softcap_scale_no_entropy_grad(backend):
    _check(backend, torch.float32, tau_per_token=False, scale=0.5, softcap=6.0, entropy_grad=False, seed=2)


def test_replay_float64_torch():
    _check("torch", torch.float64, tau_per_token=True, seed=3)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_replay_confident_rows(backend):
    """Near-certain rows inside the set: logp ~ 0, H ~ 0 and the gradient held to the relative measure."""
    z = torch.full((1, 4, 50), -3.0)
    z[0, torch.arange(4), torch.arange(4)] = torch.tensor([20.0, 25.0, 14.0, 30.0])
    y = torch.arange(4)
    ids = torch.tensor([0, 7, 9, 1, 2, 3, 2, 5, 3, 4, 8])
    off = torch.tensor([0, 3, 6, 8, 11])
    rb, rt = torch.zeros(4, dtype=torch.long), torch.arange(4)
    x = z.clone().requires_grad_()
    lp, h, _ = replay_logprobs(x, rb, rt, y, 1.0, ids, off, backend=backend)
    (lp.sum() + h.sum()).backward()
    xr = z.double().requires_grad_()
    lr, hr = ref.replay_logprobs(xr[0], y, (ids, off))
    (lr.sum() + hr.sum()).backward()
    assert_value_close("logp", lp.detach(), lr.detach(), 1e-5)
    assert_value_close("entropy", h.detach(), hr.detach(), 1e-5)
    assert_grad_close("grad", x.grad[0], xr.grad[0], 1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_invalid_unvalidated_tokens_are_nan(backend):
    """An id out of range, an id repeated, the sampled token missing, a NaN kept logit: those tokens'
    logp, H and gradient rows are NaN; the other tokens match the reference."""
    z, mask, tau, y, (ids, off) = rollout(4, start=0)
    V = z.shape[-1]
    ids = ids.clone()
    M = y.numel()
    ids[off[1]] = V + 3  # token 1: out of range
    ids[off[3] + 1] = ids[off[3]]  # token 3: repeated
    y = y.clone()
    y[5] = int(torch.tensor([v for v in range(V) if v not in ids[off[5]:off[6]].tolist()][0]))  # token 5
    rb, rt = counted_rows(mask, mask.shape)
    z = z.clone()
    z[rb[7], rt[7], ids[off[7]]] = float("nan")  # token 7: a NaN kept logit
    bad = torch.zeros(M, dtype=torch.bool)
    bad[[1, 3, 5, 7]] = True
    _, _, invalid = check_sampling_mask((ids, off), y, V, validate=False)
    assert invalid.tolist() == (bad & (torch.arange(M) != 7)).tolist()
    x = z.clone().requires_grad_()
    lp, h, flags = replay_logprobs(x, rb, rt, y, tau[mask], ids, off, invalid=invalid, backend=backend)
    assert torch.isnan(lp[bad]).all() and torch.isnan(h[bad]).all() and flags[7] != 0
    assert torch.isfinite(lp[~bad]).all() and torch.isfinite(h[~bad]).all()
    (lp.sum() + h.sum()).backward()
    for m in (1, 3, 5, 7):
        assert torch.isnan(x.grad[rb[m], rt[m]]).any()
    good = (~bad).nonzero().squeeze(1)
    keep = torch.cat([torch.arange(int(off[m]), int(off[m + 1])) for m in good.tolist()])
    counts = (off[1:] - off[:-1])[good]
    xr = z[rb[good], rt[good]].double().requires_grad_()
    lr, hr = ref.replay_logprobs(xr, y[good], (ids[keep], torch.cat([torch.zeros(1, dtype=torch.long),
                                                                   counts.cumsum(0)])), tau[mask][good].double())
    (lr.sum() + hr.sum()).backward()
    assert_value_close("logp", lp[good].detach(), lr.detach(), 1e-5)
    assert_value_close("entropy", h[good].detach(), hr.detach(), 1e-5)
    assert_grad_close("grad of the valid tokens", x.grad[rb[good], rt[good]], xr.grad, 1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_malformed_offsets_unvalidated_all_nan(backend):
    z, mask, tau, y, (ids, off) = rollout(5, start=0)
    off = off.clone()
    off[2] = off[1] - 1  # decreasing
    _, _, invalid = check_sampling_mask((ids, off), y, z.shape[-1], validate=False)
    assert invalid.all()
    rb, rt = counted_rows(mask, mask.shape)
    lp, h, _ = replay_logprobs(z, rb, rt, y, 1.0, ids, off, invalid=invalid, backend=backend)
    assert torch.isnan(lp).all() and torch.isnan(h).all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tile_union_replay_equals_full_rows(backend):
    """A head tile projects only the union of its tokens' kept sets (tile_unions: every tile at once): replay
    on those columns gives the full rows' logp, H and (scattered back) gradient, tile by tile."""
    z, mask, tau, y, (ids, off) = rollout(6, start=0, V=400)
    rb, rt = counted_rows(mask, mask.shape)
    M = y.numel()
    x = z.clone().requires_grad_()
    lp, h, _ = replay_logprobs(x, rb, rt, y, tau[mask], ids, off, backend=backend)
    (lp.sum() + h.sum()).backward()
    tiles = [(0, 2), (2, M - 1), (M - 1, M)]
    un = tile_unions(ids, off, y, tiles, z.shape[-1])
    assert un.starts[0] == 0 and un.ids.numel() == un.starts[-1]
    for j, (m0, m1) in enumerate(tiles):
        k0, k1 = int(off[m0]), int(off[m1])
        union, local, loff, y_t = un.tile(j, m0, m1, k0, k1)
        assert torch.equal(union, torch.unique(ids[k0:k1])) and union.numel() < z.shape[-1]
        assert torch.equal(union[local], ids[k0:k1]) and torch.equal(loff, off[m0:m1 + 1] - k0)
        assert torch.equal(union[y_t], y[m0:m1])
        zt = z[rb[m0:m1], rt[m0:m1]][:, union][None].clone().requires_grad_()  # (1, tile, U)
        at = torch.arange(m1 - m0)
        lpt, ht, _ = replay_logprobs(zt, torch.zeros_like(at), at, y_t, tau[mask][m0:m1], local, loff,
                                     backend=backend)
        (lpt.sum() + ht.sum()).backward()
        # against the float64 reference over the tile's sets on the full rows
        rows = z[rb[m0:m1], rt[m0:m1]].double().requires_grad_()
        sets = (ids[k0:k1], off[m0:m1 + 1] - off[m0])
        rlp, rh = ref.gtpo_sampling.replay_logprobs(rows, y[m0:m1], sets, tau[mask][m0:m1].double())
        (rlp.sum() + rh.sum()).backward()
        assert_value_close("tile logp", lpt, rlp, TOL[torch.float32]["value"])
        assert_value_close("tile entropy", ht, rh, TOL[torch.float32]["value"])
        full = torch.zeros(m1 - m0, z.shape[-1])
        full[:, union] = zt.grad[0]
        assert rows.grad.abs().sum() > 0
        assert_grad_close("tile grad", full, rows.grad, TOL[torch.float32]["grad"])
        # and equal to the full rows' own replay
        assert torch.allclose(lpt, lp[m0:m1], atol=1e-6, rtol=0) and torch.allclose(ht, h[m0:m1], atol=1e-6, rtol=0)
        assert torch.allclose(full, x.grad[rb[m0:m1], rt[m0:m1]], atol=1e-6, rtol=0)


def test_tile_unions_of_a_slice():
    """With a vocabulary slice [lo, lo + V_r), each tile's union holds exactly its sets' ids inside the slice
    (as columns id - lo), sorted; an id outside the slice, and a sampled id not in its tile's union, is -1;
    the tiles' offsets start each tile at 0. Checked against the definition, tile by tile."""
    g = torch.Generator().manual_seed(3)
    sizes = [3, 1, 4, 2, 5, 2, 6]
    ids = torch.cat([torch.randperm(20, generator=g)[:k] for k in sizes])
    off = torch.tensor([0] + sizes).cumsum(0)
    y = torch.randint(0, 20, (len(sizes),), generator=g)
    y[::2] = ids[off[:-1:2]]  # half the tokens sampled their set's first id (in the slice, or not)
    lo, V_r = 6, 9
    tiles = [(0, 3), (3, 4), (4, 7)]
    un = tile_unions(ids, off, y, tiles, V_r, lo)
    for j, (m0, m1) in enumerate(tiles):
        k0, k1 = int(off[m0]), int(off[m1])
        union, local, loff, y_t = un.tile(j, m0, m1, k0, k1)
        mine = [v - lo for v in ids[k0:k1].tolist() if lo <= v < lo + V_r]
        assert union.tolist() == sorted(set(mine))
        assert local.tolist() == [union.tolist().index(v - lo) if lo <= v < lo + V_r else -1
                                  for v in ids[k0:k1].tolist()]
        assert loff.tolist() == (off[m0:m1 + 1] - k0).tolist()
        assert y_t.tolist() == [union.tolist().index(v - lo) if v - lo in union.tolist() else -1
                                for v in y[m0:m1].tolist()]
    assert any(v == -1 for v in un.local.tolist()) and any(v >= 0 for v in un.y.tolist())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_flat_layout_equals_counted_layout(backend):
    """Running over every flat token (rows and set offsets built without a host read, uncounted tokens
    with empty sets) gives the counted layout's values and gradient, and 0 at uncounted tokens."""
    from gtpo_kernels.core.sampling import check_sampling_mask_flat
    from gtpo_kernels.kernels.replay import flat_rows
    start = 1
    z, mask, tau, y, (ids, off) = rollout(7, start=start)
    rb, rt = counted_rows(mask, mask.shape, start)
    x = z.clone().requires_grad_()
    lp, h, _ = replay_logprobs(x, rb, rt, y, tau[mask], ids, off, backend=backend)
    (lp.sum() + h.sum()).backward()
    flat_y = torch.zeros(mask.shape, dtype=torch.long).masked_scatter(mask, y).reshape(-1)
    flat_y[~mask.reshape(-1)] = -100  # anything at uncounted positions
    tok, f_off, invalid = check_sampling_mask_flat((ids, off), flat_y, mask, z.shape[-1], validate=False)
    assert not invalid.any()
    fb, ft = flat_rows(mask.shape, start, z.device)
    xf = z.clone().requires_grad_()
    lpf, hf, flags = replay_logprobs(xf, fb, ft, flat_y, tau.reshape(-1), tok, f_off, invalid=invalid,
                                     backend=backend, counted=mask.reshape(-1))
    (lpf.sum() + hf.sum()).backward()
    # against the float64 reference on the counted rows
    rows = z[:, start:][mask].double().requires_grad_()
    rlp, rh = ref.gtpo_sampling.replay_logprobs(rows, y, (ids, off), tau[mask].double())
    (rlp.sum() + rh.sum()).backward()
    m = mask.reshape(-1)
    assert_value_close("flat logp", lpf[m], rlp, TOL[torch.float32]["value"])
    assert_value_close("flat entropy", hf[m], rh, TOL[torch.float32]["value"])
    assert rows.grad.abs().sum() > 0
    assert_grad_close("flat grad", xf.grad[:, start:][mask], rows.grad, TOL[torch.float32]["grad"])
    assert (flags == 0).all() and (lpf[~mask.reshape(-1)] == 0).all() and (hf[~mask.reshape(-1)] == 0).all()
    assert torch.equal(lpf[mask.reshape(-1)], lp) and torch.equal(hf[mask.reshape(-1)], h)
    assert torch.equal(xf.grad, x.grad)


def test_torch_replay_over_a_vocabulary_sized_set_keeps_float32_accuracy():
    """A top-p set over a real vocabulary holds ~150k entries: the torch pass sums each set in float64
    (a float32 index_add_ adds them one by one: entropy 1.5e-5 and gradient 1.4e-4 off before). bf16-valued
    logits (many ties), V = 152064, two tokens with 95 % of the vocabulary kept; spec 7's float32 targets."""
    g = torch.Generator().manual_seed(11)
    V = 152064
    z = (torch.randn(1, 2, V, generator=g) * 2.5).to(torch.bfloat16).float()
    y = torch.randint(0, V, (2,), generator=g)
    keep = torch.rand(2, V, generator=g) < 0.95
    keep[0, y[0]] = keep[1, y[1]] = True
    ids = keep.nonzero()[:, 1]
    off = torch.cat([torch.zeros(1, dtype=torch.long), keep.sum(1).cumsum(0)])
    rb, rt = counted_rows(torch.ones(1, 2, dtype=torch.bool), (1, 2), 0)
    x = z.clone().requires_grad_()
    logp, ent, flags = replay_logprobs(x, rb, rt, y, 0.9, ids, off, backend="torch")
    assert (flags == 0).all()
    w = torch.tensor([0.7, -1.3])
    (logp * w + 0.1 * ent).sum().backward()
    xr = z.double().requires_grad_()
    lr, hr = ref.replay_logprobs(xr[0], y, (ids, off), 0.9)
    (lr * w.double() + 0.1 * hr).sum().backward()
    assert_value_close("logp", logp.detach(), lr.detach(), TOL[torch.float32]["value"])
    assert_value_close("entropy", ent.detach(), hr.detach(), TOL[torch.float32]["value"])
    assert xr.grad.abs().sum() > 0
    assert_grad_close("grad logits", x.grad.reshape(-1, V), xr.grad.reshape(-1, V), TOL[torch.float32]["grad"])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("tau", [-1.0, 0.0, float("nan")])
def test_replay_with_an_invalid_number_tau_is_nan_and_flagged(backend, tau):
    """A temperature passed by value (a number: the kernels take it as a launch argument) that is not finite
    and > 0 gives NaN log-probs and entropies, flagged BAD_NONFINITE, on both twins (the Triton kernel took
    1 / tau as it came: finite numbers at -1, a division by zero at 0)."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 3, 9, generator=g)
    mask = torch.ones(2, 3, dtype=torch.bool)
    rb, rt = counted_rows(mask, mask.shape)
    ids, off = torch.arange(9).repeat(6), torch.arange(7) * 9
    lp, h, flags = replay_logprobs(z, rb, rt, z.argmax(-1).reshape(-1), tau, ids, off, backend=backend)
    assert torch.isnan(lp).all() and torch.isnan(h).all() and (flags == 1).all()
    lp, _, flags = replay_logprobs(z, rb, rt, z.argmax(-1).reshape(-1), 0.7, ids, off, backend=backend)
    assert torch.isfinite(lp).all() and (flags == 0).all()
