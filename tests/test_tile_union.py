"""The tiles' unions of kept sets (kernels/tile_union.py) that the head over kept sets projects: the torch
definition and the Triton kernels against a plain Python statement of it, on random sets, tilings and
vocabulary slices, and the kernels compiled ahead of time for the GPUs."""
import pytest
import torch

from conftest import compiled_ahead
from gtpo_kernels.kernels.tile_union import tile_unions


def _case(seed, M, V, empty=0.0):
    """Random kept sets (distinct ids, some empty), sampled ids (half their set's first id), a tiling."""
    g = torch.Generator().manual_seed(seed)
    sizes = [0 if torch.rand(1, generator=g).item() < empty else int(torch.randint(1, 7, (1,), generator=g))
             for _ in range(M)]
    ids = torch.cat([torch.randperm(V, generator=g)[:k] for k in sizes] + [torch.zeros(0, dtype=torch.long)])
    off = torch.tensor([0] + sizes).cumsum(0)
    y = torch.randint(0, V, (M,), generator=g)
    for m in range(0, M, 2):
        if sizes[m]:
            y[m] = ids[off[m]]
    cuts = sorted(set(torch.randint(1, M, (int(torch.randint(0, M, (1,), generator=g)),), generator=g).tolist())) \
        if M > 1 else []
    edges = [0] + cuts + [M]
    return ids, off, y, list(zip(edges[:-1], edges[1:]))


def _definition(ids, off, y, tiles, V_r, lo):
    """Per tile: (union, local ids, local offsets, local y) as Python lists."""
    out = []
    for m0, m1 in tiles:
        k0, k1 = int(off[m0]), int(off[m1])
        cols = [v - lo for v in ids[k0:k1].tolist()]
        union = sorted({c for c in cols if 0 <= c < V_r})
        at = {c: i for i, c in enumerate(union)}
        out.append((union, [at.get(c, -1) if 0 <= c < V_r else -1 for c in cols],
                    (off[m0:m1 + 1] - k0).tolist(),
                    [at.get(v - lo, -1) if 0 <= v - lo < V_r else -1 for v in y[m0:m1].tolist()]))
    return out


CASES = [  # (seed, M, V, V_r, lo, empty sets' share)
    (0, 9, 30, 30, 0, 0.0),      # no split: every id inside
    (1, 14, 40, 13, 11, 0.0),    # a slice: ids on both sides of it
    (2, 12, 25, 25, 0, 0.4),     # empty sets among the tokens
    (3, 1, 10, 10, 0, 0.0),      # one token, one tile
    (4, 6, 20, 5, 15, 0.5),      # the last slice, few ids inside
    (5, 300, 700, 700, 0, 0.1),  # more than one block of keys and tokens
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"seed{c[0]}")
def test_unions_match_the_definition(case, backend):
    seed, M, V, V_r, lo, empty = case
    ids, off, y, tiles = _case(seed, M, V, empty)
    un = tile_unions(ids, off, y, tiles, V_r, lo, backend)
    want = _definition(ids, off, y, tiles, V_r, lo)
    assert un.starts[0] == 0 and un.ids.numel() == un.starts[-1] == sum(len(w[0]) for w in want)
    assert any(len(w[0]) for w in want)
    for j, ((m0, m1), w) in enumerate(zip(tiles, want)):
        got = un.tile(j, m0, m1, int(off[m0]), int(off[m1]))
        assert [x.tolist() for x in got] == list(w), (j, m0, m1)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_an_id_kept_by_several_tokens_is_one_column(backend):
    """The smallest id of a tile kept by three of its tokens (the first keys after the sort: each copy
    after the first must not count as a column of its own), and in the next tile again."""
    ids = torch.tensor([0, 2, 5, 0, 3, 0, 5, 0, 1])
    off = torch.tensor([0, 3, 5, 7, 9])
    y = torch.tensor([2, 0, 5, 1])
    for tiles in ([(0, 4)], [(0, 3), (3, 4)], [(0, 1), (1, 4)]):
        un = tile_unions(ids, off, y, tiles, 8, 0, backend)
        for j, ((m0, m1), w) in enumerate(zip(tiles, _definition(ids, off, y, tiles, 8, 0))):
            assert [x.tolist() for x in un.tile(j, m0, m1, int(off[m0]), int(off[m1]))] == list(w), tiles
        assert un.ids.numel() == un.starts[-1]


def test_no_kept_id_at_all():
    """Every set empty (unvalidated input can hold that): empty unions, every sampled id -1, on both."""
    y = torch.tensor([3, 1, 4])
    off = torch.zeros(4, dtype=torch.long)
    for backend in ("torch", "triton"):
        un = tile_unions(torch.zeros(0, dtype=torch.long), off, y, [(0, 2), (2, 3)], 8, 0, backend)
        assert un.starts == [0, 0, 0] and un.y.tolist() == [-1, -1, -1] and un.offsets.tolist() == [0, 0, 0, 0, 0]


AOT = '''
import torch
from bench.aot.compiler import _compile_ahead
from gtpo_kernels.kernels import tile_union_triton as U
i64, f32 = torch.int64, torch.float32
meta = dict(BLOCK=256, num_warps=4)
for arch in (90, 80, 100):
    assert _compile_ahead(U._keys_kernel, arch, dict(ids_ptr=i64, off_ptr=i64, y_ptr=i64, bounds_ptr=i64, key_ptr=i64,
                          ky_ptr=i64, tile_ptr=i64, loc_ptr=i64), f32,
                          dict(n_tiles=64, lo=0, V_r=151936, steps=8), meta).asm.get("ptx")
    assert _compile_ahead(U._first_kernel, arch, dict(skey_ptr=i64, first_ptr=i64), f32,
                          dict(K=1 << 20, V_r=151936), meta).asm.get("ptx")
    assert _compile_ahead(U._starts_kernel, arch, dict(skey_ptr=i64, first_ptr=i64, rank_ptr=i64, starts_ptr=i64),
                          f32, dict(K=1 << 20, n_tiles=64, V_r=151936, steps=22), meta).asm.get("ptx")
    assert _compile_ahead(U._columns_kernel, arch, dict(skey_ptr=i64, order_ptr=i64, first_ptr=i64, rank_ptr=i64,
                          starts_ptr=i64, ky_ptr=i64, tile_ptr=i64, local_ptr=i64, uids_ptr=i64, ly_ptr=i64), f32,
                          dict(K=1 << 20, M=16384, V_r=151936, steps=22), meta).asm.get("ptx")
print("compiled")
'''


def test_kernels_compile_for_the_gpus():
    """The four kernels compiled ahead of time for sm_90, sm_80 and sm_100 by Triton's compiler."""
    compiled_ahead(AOT)
