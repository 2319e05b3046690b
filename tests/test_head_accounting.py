"""bench/head_accounting.py: the counter of the LM head's work outside its kernels, on counts derived by hand.

A fake head (projection, a suspended "kernel", the two gradient GEMMs, per tile) gives exact tile passes,
GEMM FLOPs, host syncs, allocations above the budget and N-sized allocations per tile; each deliberate
extra (one more tile op, a sync, a large tensor, an N-sized tensor in the loop) must show up. On the real
`linear_gtpo_loss`, the GEMM FLOPs of a case with no zero rows are exactly 3 (fused) or 4 (recompute)
GEMMs of 2 N V D, and the vocabulary kernels are excluded (suspended) rather than counted.
"""
import types

import pytest
import torch

from bench.head_accounting import counter as ha
from gtpo_kernels import GTPOConfig, gtpo_loss, linear_gtpo_loss

B, T, D, V = 2, 8, 12, 64  # N = 16 rows, D = 12, tiles of 4 rows: 4 tiles of 4 x 64 logits


def _geometry(rows, hidden, weight):
    return ha.Geometry(V, D, (V,), rows * V, 2 * rows * V * 4, (B, T), B * T,
                       (ha._ptr(hidden), ha._ptr(weight)))


class _FakeHead(torch.autograd.Function):
    """The fused schedule's shape, per tile of `rows` tokens: z = h W^T (1 pass), the kernel turns z into
    its gradient (suspended: not counted), dh = gz W and dW += gz^T h (2 passes); `extra` adds work."""

    @staticmethod
    def forward(ctx, hidden, weight, rows, kernel, extra):
        h2 = hidden.reshape(-1, D)
        dh, dw = torch.zeros_like(h2), torch.zeros_like(weight)
        for s in range(0, h2.shape[0], rows):
            h = h2[s:s + rows]
            z = h @ weight.t()
            if "tile_op" in extra:
                z.mul_(2.0)
            if "sync" in extra:
                z[:, 0].sum().item()
            if "n_alloc" in extra:
                torch.zeros(B * T)
            gz = kernel.vocab_bwd(z)
            dh[s:s + rows] = gz @ weight
            dw.addmm_(gz.t(), h)
        if "big" in extra:
            torch.empty(4 * rows * V * 4 // 4 + 1)  # more bytes than the budget (2 tiles)
        ctx.grads = dh.reshape(hidden.shape), dw
        return torch.ones((), dtype=hidden.dtype)

    @staticmethod
    def backward(ctx, g):
        dh, dw = ctx.grads
        return dh * g, dw * g, None, None, None


def _fake_counts(extra=()):
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(B, T, D, generator=gen, requires_grad=True)
    weight = torch.randn(V, D, generator=gen, requires_grad=True)
    kernel = types.SimpleNamespace(vocab_bwd=lambda z: torch.softmax(z, -1) - torch.softmax(z * 0.5, -1))
    run = lambda: _FakeHead.apply(hidden, weight, 4, kernel, tuple(extra))  # noqa: E731
    return ha.count_call(run, (hidden, weight), _geometry(4, hidden, weight), [(kernel, "vocab_bwd")])


def test_fake_head_exact_counts():
    c = _fake_counts()
    tiles = B * T // 4
    assert c["projections"] == tiles
    assert c["tile_passes"] == 3 * tiles, c["tile_passes_by_op"]  # the kernel's softmaxes are not counted
    assert c["tile_passes_by_op"] == {"aten.mm": 2 * tiles, "aten.addmm_": tiles}
    assert (c["tile_reads"], c["tile_writes"]) == (2 * tiles, tiles)
    assert c["gemm_flops"] == 3 * 2 * B * T * V * D
    assert c["kernel_calls"] == tiles and c["kernel_ops_excluded"] > 0
    assert c["host_syncs"] == 0 and c["allocs_over_budget"] == 0
    assert c["vd_allocs"] == 2  # dw and dw * g
    assert c["n_allocs_per_tile"]["forward"] == 0


def test_fake_head_extras_are_counted():
    tiles = B * T // 4
    assert _fake_counts(["tile_op"])["tile_passes"] == 4 * tiles
    c = _fake_counts(["sync"])
    assert c["host_syncs"] == tiles and c["host_syncs_by_op"] == {"aten._local_scalar_dense": tiles}
    assert c["host_syncs_per_tile"]["forward"] == 1
    assert _fake_counts(["n_alloc"])["n_allocs_per_tile"]["forward"] == 1
    assert _fake_counts(["big"])["allocs_over_budget"] == 1


def test_host_reads_of_every_kind_are_counted():
    x = torch.randn(6, 5)
    geo = ha.Geometry(1000, 3, (1000,), 10 ** 6, 10 ** 6, (2, 3), 6)
    counter = ha.HeadCounter(geo)
    kernel = types.SimpleNamespace(k=lambda t: (t > 0).nonzero().tolist())
    with ha.counting(counter, [(kernel, "k")]):
        float(x.sum()), x[x > 0], x.nonzero(), x[:, 0].tolist(), torch.bincount(x.argmax(1))
        kernel.k(x)  # suspended: not counted
    assert counter.syncs == {"aten._local_scalar_dense": 1, "aten.index": 1, "aten.nonzero": 1, "Tensor.tolist": 1,
                             "aten.bincount": 1}
    assert torch.Tensor.tolist is torch._C.TensorBase.tolist  # restored


@pytest.mark.parametrize("schedule,gemms", [("fused", 3), ("recompute", 4)])
def test_linear_head_gemm_flops_are_the_floor(schedule, gemms):
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(B, T, D, generator=gen, requires_grad=True)
    weight = (torch.randn(V, D, generator=gen) * 0.5).requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.arange(T)[None, :] < torch.tensor([[T], [T - 2]])
    adv = torch.tensor([1.0, -0.5])
    cfg = GTPOConfig.preset("grpo")
    N = int(mask.sum())
    z = (hidden.detach() @ weight.detach().t()).requires_grad_()  # every counted row has a gradient
    g, = torch.autograd.grad(gtpo_loss(z, ids, adv, mask, config=cfg, backend="torch").loss, z)
    assert bool((g != 0).any(-1)[mask].all())
    rows = 4
    run = lambda: linear_gtpo_loss(hidden, weight, ids, adv, mask, config=cfg, memory_budget=2 * rows * V * 4,  # noqa
                                   schedule=schedule, backend="torch").loss
    c = ha.count_call(run, (hidden, weight), _geometry(rows, hidden, weight), ha.our_kernels())
    assert c["gemm_flops"] == gemms * 2 * N * V * D
    assert c["kernel_calls"] > 0  # the vocabulary passes ran through dispatch.vocab_*, suspended
    assert c["allocs_over_budget"] == 0
    # completion 1 with A = 0 (its group's rewards all equal): both schedules project every row once in
    # the forward, and run the other GEMMs (the recompute schedule's second projection too) on row 0's
    run0 = lambda: linear_gtpo_loss(hidden, weight, ids, torch.tensor([1.0, 0.0]), mask, config=cfg,  # noqa
                                    memory_budget=2 * rows * V * 4, schedule=schedule, backend="torch").loss
    c0 = ha.count_call(run0, (hidden, weight), _geometry(rows, hidden, weight), ha.our_kernels())
    assert c0["gemm_flops"] == 2 * N * V * D + (gemms - 1) * 2 * T * V * D, (c0["gemm_flops"], N, T)


# ---- the head over the sampler's kept sets (spec 13): GEMMs over each tile's union -----------------

def _kept_case(k, seed=3):
    """The B x T batch above (completion 1 two tokens shorter), each counted token's kept set k distinct
    ids holding its sampled id, in the compressed layout (token_ids, offsets)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=gen, requires_grad=True)
    weight = (torch.randn(V, D, generator=gen) * 0.5).requires_grad_()
    mask = torch.arange(T)[None, :] < torch.tensor([[T], [T - 2]])
    sets = [torch.randperm(V, generator=gen)[:k] for _ in range(int(mask.sum()))]
    ids = torch.zeros(B, T, dtype=torch.long)
    ids[mask] = torch.stack([s[torch.randint(0, k, (), generator=gen)] for s in sets])
    offsets = torch.tensor([0] + [k] * len(sets)).cumsum(0)
    return hidden, weight, ids, mask, (torch.cat(sets), offsets), sets


def _replay_counts(hidden, weight, ids, mask, sampling_mask, budget):
    run = lambda: linear_gtpo_loss(hidden, weight, ids, torch.tensor([1.0, -0.5]), mask,  # noqa: E731
                                   config=GTPOConfig.preset("grpo"), memory_budget=budget, sampling_mask=sampling_mask,
                                   backend="torch").loss
    from bench.head_accounting.replay import replay_kernels
    return ha.count_call(run, (hidden, weight), _geometry(4, hidden, weight), replay_kernels())


def test_replay_head_gemm_flops_are_8_rows_union_d_per_tile():
    """Sets of 4 ids and a budget of 512 B (8 B an entry: logit and gradient) plan tiles of 4 tokens (4 x 16
    entries fit, 5 x 20 do not): the counter's GEMM FLOPs are 2 rows |U| D forward and 6 rows |U| D backward
    per tile, U the union of the tile's sets taken here by hand; the forward gathers |U| weight rows and the
    tile's hidden rows."""
    hidden, weight, ids, mask, sm, sets = _kept_case(k=4)
    N = len(sets)
    tiles = [(m0, min(N, m0 + 4)) for m0 in range(0, N, 4)]
    unions = [torch.unique(torch.cat(sets[m0:m1])).numel() for m0, m1 in tiles]
    assert max(unions) > 4 and min(unions) < V  # the unions are neither one set nor the vocabulary
    c = _replay_counts(hidden, weight, ids, mask, sm, budget=512)
    rows_u = sum((m1 - m0) * u for (m0, m1), u in zip(tiles, unions))
    assert c["gemm_flops_forward"] == 2 * rows_u * D, (c["gemm_flops_forward"], rows_u)
    assert c["gemm_flops_backward"] == 6 * rows_u * D, (c["gemm_flops_backward"], rows_u)
    assert c["gemm_flops"] == 8 * rows_u * D
    assert c["rows_gathered"]["forward"] == sum(unions) + N  # W[U] and hidden's rows, once per tile
    assert c["kernel_calls"] > 0  # the replay ran suspended (replay_torch.replay_fwd / replay_bwd)


def test_replay_head_on_whole_vocabulary_sets_costs_no_less_than_the_full_recompute_head():
    """Every kept set the whole vocabulary: the replay head's union is V in every tile, and its counted GEMM
    FLOPs (4 GEMMs of 2 rows V D) are no less than the full head's recompute schedule on the same batch
    (its backward skips nothing here: every row has a gradient)."""
    hidden, weight, ids, mask, sm, sets = _kept_case(k=V)
    N = len(sets)
    rows = 4
    c = _replay_counts(hidden, weight, ids, mask, sm, budget=2 * rows * V * 4)
    run = lambda: linear_gtpo_loss(hidden, weight, ids, torch.tensor([1.0, -0.5]), mask,  # noqa: E731
                                   config=GTPOConfig.preset("grpo"), memory_budget=2 * rows * V * 4,
                                   schedule="recompute", backend="torch").loss
    full = ha.count_call(run, (hidden, weight), _geometry(rows, hidden, weight), ha.our_kernels())
    assert c["gemm_flops"] == 8 * N * V * D
    assert c["gemm_flops"] >= full["gemm_flops"], (c["gemm_flops"], full["gemm_flops"])


def test_peak_bytes_is_the_allocators_high_water_mark():
    """Two 400 kB temporaries alive at once, then freed: the peak is at least their sum, the end holds the
    returned gradient only."""
    x = torch.randn(1, 100, requires_grad=True)

    def run():
        a = torch.ones(1000, 100)
        return (x * a).sum()
    peak, end, grads = ha.peak_bytes(run, (x,))
    assert grads == 400
    assert 800_000 <= peak < 4_000_000, peak
    assert end < 100_000, end
