"""The union tiles' bounds cut on the device (kernels/union_plan_triton.py) for the head over kept sets:
the tiles of pipeline/head_replay.plan_union and of their row-by-row greedy definition on random sizes,
budgets, V and row caps (empty sets, sets over V, single-row tiles, negative sizes from malformed
offsets); a device plan that differs from the host's is refused; end to end over recorded sets, several
tiles on the Triton backend equal the torch backend's (which copies the host's tiles) and malformed
offsets unvalidated give NaN, not an error; compiled ahead of time."""
import pytest
import torch

from conftest import assert_grad_close, assert_value_close, compiled_ahead
from gtpo_kernels import GTPOConfig, linear_gtpo_loss
from gtpo_kernels.kernels.tile_union import tile_unions
from gtpo_kernels.kernels.union_plan_triton import union_bounds
from gtpo_kernels.pipeline.head import row_bytes
from gtpo_kernels.pipeline.head_replay import TILE_ROWS, plan_union
from test_head_replay import _greedy_union_tiles


def _offsets(sizes):
    return torch.tensor([0] + sizes).cumsum(0)


@pytest.mark.parametrize("seed", range(3))
def test_the_device_cuts_the_host_tiles(seed):
    g = torch.Generator().manual_seed(seed)
    seen = 0
    for case in range(40):
        n, V = (int(x) for x in torch.randint(1, 60, (2,), generator=g))
        mr = int(torch.randint(1, 40, (1,), generator=g)) if case % 4 else TILE_ROWS
        sizes = torch.randint(0, 50, (n,), generator=g).tolist()
        if case % 5 == 0:  # a malformed (decreasing) offset, unvalidated: an empty set to both planners
            sizes[int(torch.randint(0, n, (1,), generator=g))] = -int(torch.randint(1, 20, (1,), generator=g))
        per_entry, budget = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(8, 4000, (1,), generator=g))
        if any(per_entry * min(k, V) > budget for k in sizes):
            continue
        tiles = plan_union(sizes, V, per_entry, budget, mr)
        assert tiles == _greedy_union_tiles([max(k, 0) for k in sizes], V, per_entry, budget, mr)
        got = union_bounds(_offsets(sizes), len(tiles), V, per_entry, budget, mr).tolist()
        assert got == [m0 for m0, _ in tiles] + [n], (case, sizes, tiles, got)
        seen += len(tiles) > 1
    assert seen >= 5  # several cases cut more than one tile
    huge = plan_union([3] * 9, 40, 8, 1 << 70, 4)  # a budget past 64 bits: what fits is the same
    assert union_bounds(_offsets([3] * 9), len(huge), 40, 8, 1 << 70, 4).tolist() == [0, 4, 8, 9]
    many = [3] * 600  # past one block of the running sums; tiles of TILE_ROWS rows
    tiles = plan_union(many, 10**6, 8, 1 << 40)
    assert len(tiles) == 3
    assert union_bounds(_offsets(many), 3, 10**6, 8, 1 << 40, TILE_ROWS).tolist() == [0, 256, 512, 600]


@pytest.mark.parametrize("sizes,V,budget,max_rows,want", [
    ([2, 2, 2], 100, 8, 10, [0, 2, 3]),                # 2 rows x 4 entries: exactly the budget
    ([5, 5, -20, 5, 5], 100, 20, 10, [0, 2, 4, 5]),    # a negative size counts 0, not -20
    ([70, 70, 1], 50, 120, 10, [0, 2, 3]),              # min(sum, V): 2 rows x 50 entries, not 140
    ([1] * 9, 100, 10 ** 6, 4, [0, 4, 8, 9]),           # max_rows (not a power of 2's lanes) bounds a tile
])
def test_the_device_cuts_the_edges_as_the_host(sizes, V, budget, max_rows, want):
    tiles = plan_union(sizes, V, 1, budget, max_rows)
    assert [m0 for m0, _ in tiles] + [len(sizes)] == want
    assert union_bounds(_offsets(sizes), len(tiles), V, 1, budget, max_rows).tolist() == want


def test_a_device_plan_that_differs_from_the_host_one_is_refused():
    ids, off, y = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 2, 3, 4]), torch.tensor([1, 2, 3, 4])
    tiles = [(0, 2), (2, 4)]
    good = tile_unions(ids, off, y, tiles, 10, 0, "triton", bounds=torch.tensor([0, 2, 4]))
    assert good.starts == [0, 2, 4]
    with pytest.raises(RuntimeError, match=r"the device's union tiles start at \[0, 1, 4\], the host's at \[0, 2, 4\]"):
        tile_unions(ids, off, y, tiles, 10, 0, "triton", bounds=torch.tensor([0, 1, 4]))


def _head(seed, B=4, T=6, D=8, V=40):
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g) * 0.8
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    adv = torch.randn(B, generator=g)
    z = h @ w.T
    sets = [sorted(set(z[mask][r].topk(2 + r % 5).indices.tolist()) | {int(ids[mask][r])})
            for r in range(int(mask.sum()))]
    kept = torch.tensor([v for s in sets for v in s]), torch.tensor([0] + [len(s) for s in sets]).cumsum(0)
    return h, w, ids, mask, adv, kept, row_bytes(1, torch.float32, h.device)


def test_several_union_tiles_on_triton_equal_the_torch_backend():
    h, w, ids, mask, adv, kept, per_entry = _head(0)
    budget = per_entry * 40  # tiles of a few rows
    sizes = kept[1].diff().tolist()
    assert len(plan_union(sizes, 40, per_entry, budget)) >= 4
    outs = []
    for backend in ("triton", "torch"):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        out = linear_gtpo_loss(hh, ww, ids, adv, mask, group_size=2, sampling_mask=kept,
                               config=GTPOConfig.preset("gtpo", entropy_threshold=None),
                               memory_budget=budget, backend=backend)
        out.loss.backward()
        outs.append((out, hh.grad, ww.grad))
    (o, gh, gw), (t, th, tw) = outs
    assert tw.abs().sum() > 0 and th.abs().sum() > 0
    assert_value_close("loss", o.loss.detach(), t.loss.detach(), 1e-5)
    assert_value_close("logps", o.logps, t.logps, 1e-5)
    assert_value_close("entropy", o.entropy, t.entropy, 1e-5)
    assert_grad_close("hidden grad", gh, th, 1e-4)
    assert_grad_close("weight grad", gw, tw, 1e-4)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_malformed_offsets_unvalidated_give_nan_over_several_tiles(backend):
    """Every counted token's outputs and its row of dL/dh NaN (on Triton the row was 0: the malformed sets
    project nothing, so no union column carried the NaN coefficient)."""
    h, w, ids, mask, adv, (token_ids, offsets), per_entry = _head(1)
    bad = offsets.clone()
    bad[3] = bad[5] + 2  # decreasing at token 4
    h = h.requires_grad_()
    out = linear_gtpo_loss(h, w, ids, adv, mask, group_size=2, config="grpo", sampling_mask=(token_ids, bad),
                           memory_budget=per_entry * 40, backend=backend, validate=False)
    out.loss.backward()
    assert torch.isnan(out.loss) and torch.isnan(out.logps[mask]).all() and torch.isnan(out.entropy[mask]).all()
    assert torch.isnan(h.grad[mask]).all() and not torch.isnan(h.grad[~mask]).any()


AOT = '''
import torch
from bench.aot.compiler import _compile_ahead
from gtpo_kernels.kernels import union_plan_triton as P
i64, f32 = torch.int64, torch.float32
for arch in (90, 80, 100):
    assert _compile_ahead(P._union_plan_kernel, arch, dict(off_ptr=i64, sums_ptr=i64, bounds_ptr=i64), f32,
                          dict(M=1 << 15, n_tiles=128, V=151936, per_entry=4, budget=1 << 31, max_rows=256),
                          dict(ROWS=256, BLOCK=256, num_warps=4)).asm.get("ptx")
print("compiled")
'''


def test_the_kernel_compiles_for_the_gpus():
    """_union_plan_kernel compiled ahead of time for sm_90, sm_80 and sm_100 by Triton's compiler."""
    compiled_ahead(AOT)
