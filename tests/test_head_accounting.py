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
