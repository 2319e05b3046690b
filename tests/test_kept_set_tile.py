"""The rules' kept sets listed on the Triton backend for a tile of the LM head (kernels/kept_set_triton:
the threshold kernel, then each row's ids in one launch) against the torch rebuild (kernels/kept_set, their
twin): the same ids, offsets, restored tokens, non-finite rows and kept masses, with the tile's transforms
or without, one temperature or one per row, each rule a number or a tensor per row, rows with ties, a NaN,
a +inf, every entry -inf, a sampled id outside the vocabulary; the tile itself is left as it was."""
import pytest
import torch

from gtpo_kernels.kernels.kept_set import kept_sets
from gtpo_kernels.kernels.kept_set_triton import kept_sets_tile
from conftest import compiled_ahead

RULES = [dict(top_k=5), dict(top_p=0.85), dict(min_p=0.05), dict(top_k=7, top_p=0.9, min_p=0.01),
         dict(top_k="per row", top_p="per row"), dict(top_k=60)]  # (the last keeps every finite entry)


def _tile(seed, n=9, V=40):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, V, generator=g) * 2.5
    y = torch.randint(0, V, (n,), generator=g)
    z[1, ::3] = z[1].max() + 0.5  # ties at the maximum
    z[2, 10:20] = 0.75  # ties inside the set
    z[3, 4] = float("nan")
    z[4, 7] = float("inf")
    z[5] = float("-inf")
    y[6] = 45  # outside the vocabulary (unvalidated): no column of the set, nor restored (its token is NaN)
    z[7] = z[7] * 0.01  # nearly flat: top-p keeps many
    z[8, :5] = float("-inf")  # banned entries: never kept
    return z, y, g


@pytest.mark.parametrize("rules", RULES, ids=[",".join(f"{k}={v}" for k, v in r.items()) for r in RULES])
@pytest.mark.parametrize("transforms", [(1.0, None), (0.7, 3.0)])
@pytest.mark.parametrize("per_row_tau", [False, True])
def test_listed_sets_equal_the_torch_rebuild(rules, transforms, per_row_tau):
    z, y, g = _tile(len(rules) + 3 * per_row_tau)
    n, V = z.shape
    tau = (torch.rand(n, generator=g) + 0.5) if per_row_tau else 0.8
    rules = dict(rules)
    if rules.get("top_k") == "per row":
        rules["top_k"] = torch.randint(0, 12, (n,), generator=g)
        rules["top_p"] = torch.rand(n, generator=g) * 0.5 + 0.5
    before = z.clone()
    got = kept_sets_tile(z, y, tau, scale=transforms[0], softcap=transforms[1], **rules)
    assert torch.equal(z.nan_to_num(), before.nan_to_num()) and torch.equal(z.isnan(), before.isnan())
    want = kept_sets(z.unsqueeze(0), torch.zeros(n, dtype=torch.long), torch.arange(n), y, tau,
                     scale=transforms[0], softcap=transforms[1], **rules)
    ids, off, restored, nonfinite, mass = got
    assert torch.equal(nonfinite, want[3]) and nonfinite[3] and not nonfinite[0]
    assert nonfinite[4] == (transforms[1] is None)  # (a soft-cap makes +inf its cap)
    fine = ~want[3]  # (a row with NaN or +inf has no set: its outputs are NaN, whatever is listed)
    for r in fine.nonzero().flatten().tolist():
        assert ids[off[r]:off[r + 1]].tolist() == want[0][want[1][r]:want[1][r + 1]].tolist(), r
    assert torch.equal(restored[fine], want[2][fine])
    assert (off.diff() >= 1).all() and off[-1] > n  # every row keeps its sampled id at least
    torch.testing.assert_close(mass[fine], want[4][fine].float(), rtol=1e-5, atol=1e-6, equal_nan=True)  # (all -inf: NaN)


def test_an_empty_tile():
    z = torch.zeros(0, 16)
    ids, off, restored, nonfinite, mass = kept_sets_tile(z, torch.zeros(0, dtype=torch.long), 1.0, top_k=3)
    assert ids.numel() == 0 and off.tolist() == [0] and restored.numel() == nonfinite.numel() == mass.numel() == 0


AOT = '''
import torch
from bench.aot.compiler import _compile_ahead
from gtpo_kernels.kernels import kept_set_triton as K
for arch in (90, 80, 100):
    for dt, by_value in ((torch.bfloat16, True), (torch.float32, False)):
        assert _compile_ahead(K._kept_ids_kernel, arch, dict(z_ptr=dt, y_ptr=torch.int64, tid_ptr=torch.int64,
                              off_ptr=torch.int64, ids_out=torch.int64, nf_out=torch.bool),
                              torch.float32, dict(stride_z=151936, V=151936, temp_stride=1,
                              **(dict(temp_ptr=0.7) if by_value else {})),
                              dict(TEMP_BY_VALUE=by_value, BLOCK_V=4096, num_warps=4)).asm.get("ptx")
print("compiled")
'''


def test_kernel_compiles_for_the_gpus():
    """The listing kernel compiled ahead of time for sm_90, sm_80 and sm_100 (without the interpreter)."""
    compiled_ahead(AOT)


def test_invalid_rule_values_list_what_they_count():
    """Unvalidated rule values out of range (top_k -2, top_p NaN or 1.5, min_p 1.5): the threshold kernel counts
    each set as the rules leave it (the value used as it is, as the torch rebuild does: the caller's flags make
    those tokens NaN), and the listing writes exactly those ids: every id in [0, V), the torch rebuild's sets."""
    z, y, g = _tile(11)
    n, V = z.shape
    top_k = torch.randint(1, 9, (n,), generator=g)
    top_k[0] = -2
    top_p = torch.full((n,), 0.9)
    top_p[1], top_p[2] = float("nan"), 1.5
    min_p = torch.zeros(n)
    min_p[6] = 1.5
    ids, off, *_ = kept_sets_tile(z, y, 0.9, top_k, top_p, min_p)
    want = kept_sets(z.unsqueeze(0), torch.zeros(n, dtype=torch.long), torch.arange(n), y, 0.9, top_k, top_p, min_p)
    assert ((ids >= 0) & (ids < V)).all() and not want[3][[0, 1, 2, 6]].any()  # (their rows are compared)
    for r in (~want[3]).nonzero().flatten().tolist():
        assert ids[off[r]:off[r + 1]].tolist() == want[0][want[1][r]:want[1][r + 1]].tolist(), r
