"""The fused LM head's tile plan formed on the device (kernels/tile_plan_triton.py) against the host's plan
(pipeline/tile_plan.plan and plan_rows' host path) and a plain Python statement of it, on random masks,
completion lengths (longer than a tile included), tile sizes and live rows; and compiled ahead of time."""
import bisect
import types

import pytest
import torch

from conftest import compiled_ahead
from gtpo_kernels.kernels.tile_plan_triton import slots, tile_plan
from gtpo_kernels.pipeline import tile_plan as tp


def _case(seed, longest=10):
    """Random padded or packed tokens: (counted, seg, live, B, per_tile); some completions empty, some
    longer than a tile."""
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 8, (1,), generator=g))
    lengths = torch.randint(0, longest + 1, (B,), generator=g)
    seg = torch.repeat_interleave(torch.arange(B), lengths)
    N = seg.numel()
    counted = torch.rand(N, generator=g) < float(torch.rand(1, generator=g)) * 1.2
    live = torch.rand(N, generator=g) < 0.5
    per_tile = int(torch.randint(1, 13, (1,), generator=g))
    return counted, seg, live, B, per_tile


def _statement(counted, seg, live, B, per_tile):
    """The plan in plain Python: counts, the greedy tiles' starts, each counted row's tile, live per tile."""
    counts = [int((counted & (seg == i)).sum()) for i in range(B)]
    starts, start, size = [], 0, 0
    for c in counts:
        if size and size + c > per_tile:
            starts.append(start)
            start, size = start + size, 0
        size += c
        while size > per_tile:
            starts.append(start)
            start, size = start + per_tile, size - per_tile
    if size:
        starts.append(start)
    rows = counted.nonzero().squeeze(1).tolist()
    tile = [bisect.bisect_right(starts, j) - 1 for j in range(len(rows))]
    per = [sum(int(live[r]) for r, t in zip(rows, tile) if t == k) for k in range(len(starts))]
    return counts, starts, tile, per


@pytest.mark.parametrize("seed,longest", [(s, 10) for s in range(40)] + [(s, 400) for s in range(3)])
def test_the_device_plan_is_the_statement_and_the_host_plan(seed, longest):
    """Short completions, and long ones: more tokens than the kernel's block (its places carried across)."""
    counted, seg, live, B, per_tile = _case(seed, longest)
    planned, tile = tile_plan(counted, seg, live, B, per_tile)
    counts, starts, tile_exp, per = _statement(counted, seg, live, B, per_tile)
    h = planned.tolist()
    n_slots = slots(B, seg.numel(), per_tile)
    assert len(h) == B + n_slots + 1 and len(starts) <= n_slots
    assert h[:B] == counts and h[-1] == len(starts), (h, counts, starts)
    assert [k.s for k in tp.plan(counts, per_tile, True)] == starts  # the statement is the host's plan
    assert h[B:B + len(starts)] == per and not any(h[B + len(starts):-1]), (h, per)
    rows = counted.nonzero().squeeze(1)
    assert tile[rows].tolist() == tile_exp and (tile[~counted] == -1).all()


def test_a_completion_longer_than_several_tiles():
    """One completion of 10 rows between two short ones, 3 rows a tile: the greedy cut by hand."""
    seg = torch.tensor([0, 0] + [1] * 10 + [2])
    counted, live = torch.ones(13, dtype=torch.bool), torch.arange(13) % 2 == 0
    planned, tile = tile_plan(counted, seg, live, 3, 3)
    # tiles: [0, 2) (completion 0), [2, 5) [5, 8) [8, 11) (completion 1's full tiles), [11, 13) (its rest + 2)
    assert planned[-1].item() == 5 and tile.tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4]
    assert planned[3:8].tolist() == [1, 2, 1, 2, 1]


@pytest.mark.parametrize("seed", range(12))
def test_plan_rows_on_the_device_equals_its_host_path(seed):
    """plan_rows' fused schedule on the Triton backend (the plan formed by the kernel) and on the torch
    backend (formed on the host, the tiles' sizes copied to the device): the same rows in the same order,
    counts, tiles and live rows per tile."""
    counted, seg, live, B, per_tile = _case(seed)
    g = torch.Generator().manual_seed(1000 + seed)
    adv = torch.randn(B, generator=g) * (torch.rand(B, generator=g) < 0.5)  # some A = 0: rows known dead
    cfg = types.SimpleNamespace(entropy_coef=0.0, beta=0.0, entropy_penalty=0.0, policy_loss="ppo",
                                sequence_term=False)
    t = types.SimpleNamespace(counted=counted, seg=seg, extras=types.SimpleNamespace(ref=None, lam=None, adv=adv))
    got = []
    for backend in ("triton", "torch"):
        opts = types.SimpleNamespace(B=B, per_tile=per_tile, fused=True, cfg=cfg, backend=backend)
        got.append(tp.plan_rows(opts, t, True))
    (r1, c1, t1, l1), (r2, c2, t2, l2) = got
    assert torch.equal(r1, r2) and torch.equal(c1, c2) and t1 == t2 and list(l1) == list(l2), (got,)
    assert sum(l1) == int(((adv[seg] != 0) & counted).sum())


AOT = '''
import torch
from bench.aot.compiler import _compile_ahead
from gtpo_kernels.kernels import tile_plan_triton as P
i64, f32 = torch.int64, torch.float32
for arch in (90, 80, 100):
    assert _compile_ahead(P._tile_plan_kernel, arch, dict(counted_ptr=torch.bool, seg_ptr=i64, live_ptr=torch.bool,
                          plan_ptr=i64, starts_ptr=i64, tile_ptr=i64), f32,
                          dict(N=1 << 15, B=512, per_tile=480, n_slots=581, steps=11),
                          dict(BLOCK=256, num_warps=4)).asm.get("ptx")
print("compiled")
'''


def test_the_kernel_compiles_for_the_gpus():
    """_tile_plan_kernel compiled ahead of time for sm_90, sm_80 and sm_100 by Triton's compiler."""
    compiled_ahead(AOT)


@pytest.mark.parametrize("packed", [False, True])
def test_the_head_over_completions_longer_than_a_tile_plans_with_one_read(packed):
    """linear_gtpo_loss, fused schedule, token-local coefficients (dapo, beta = 0), completions of 7 tokens
    in tiles of 3 rows, some advantages 0 (rows known to have no gradient, put last in their tile): on the
    Triton backend the plan is formed on the device and read once (the host plan read the rows per tile a
    second time); the loss, log-probs and gradients equal the torch backend's."""
    from bench.launches import counting
    from gtpo_kernels import GTPOConfig, linear_gtpo_loss
    from gtpo_kernels.pipeline.head import row_bytes
    g = torch.Generator().manual_seed(5)
    B, T, D, V = 4, 7, 8, 30
    h = torch.randn(B * T, D, generator=g) if packed else torch.randn(B, T, D, generator=g)
    w = torch.randn(V, D, generator=g)
    ids = torch.randint(0, V, h.shape[:-1], generator=g)
    adv = torch.tensor([0.7, 0.0, -1.1, 0.0])
    mask = (torch.rand(h.shape[:-1], generator=g) < 0.85).float()
    kw = dict(cu_seqlens=torch.arange(0, B * T + 1, T), max_seqlen=T) if packed else {}
    outs, reads = [], []
    for backend in ("triton", "torch"):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with counting() as c:
            out = linear_gtpo_loss(hh, ww, ids, adv, mask, group_size=2, config=GTPOConfig.preset("dapo", beta=0.0),
                                   backend=backend, schedule="fused", memory_budget=3 * row_bytes(V, torch.float32,
                                                                                                 h.device), **kw)
        reads.append(c.host_reads)
        out.loss.backward()
        outs.append((out.loss, out.logps, hh.grad, ww.grad))
    assert reads[0] == 2, reads  # the plan's, and head_ops._longest_fits' (its longest completion over a tile)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert outs[0][3].abs().sum() > 0 and outs[0][2].abs().sum() > 0
