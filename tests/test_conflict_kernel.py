"""The conflict weights in one Triton launch (kernels/conflict_triton._conflict_weights_kernel, the loss's
fourth kernel when gtpo_loss computes lam and n_conf itself, spec 8) against the float64 reference of spec 3:
padded and packed, any mask dtype, groups of 1 to 5, small vocabularies (many shared ids), zero advantages,
counted ids outside [0, 2**31) (their completion NaN, unvalidated) and malformed cu_seqlens (every weight
NaN); and compiled for the GPUs."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gtpo_reference as ref
from conftest import compiled_ahead, examples
from gtpo_kernels.kernels import ops


@st.composite
def batches(draw):
    G, P = draw(st.integers(1, 5)), draw(st.integers(1, 3))
    B, V = G * P, draw(st.integers(2, 4))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    packed = draw(st.booleans())
    lens = draw(st.lists(st.integers(0, 9), min_size=B, max_size=B)) if packed else [draw(st.integers(0, 9))] * B
    return dict(G=G, B=B, V=V, seed=seed, packed=packed, lens=lens, mask=draw(st.sampled_from(["none", "bool", "float"])),
                w=draw(st.sampled_from([(2.0, 0.0), (1.5, 0.5)])), bad_id=draw(st.sampled_from([None, -1, 2 ** 31])))


def _inputs(c):
    g = torch.Generator().manual_seed(c["seed"])
    B, L = c["B"], max(c["lens"], default=0)
    ids = torch.randint(0, c["V"], (B, L), generator=g)
    inside = torch.arange(L)[None, :] < torch.tensor(c["lens"])[:, None]
    m = (torch.rand(B, L, generator=g) < 0.85) & inside
    adv = torch.randint(-1, 2, (B,), generator=g).double() * torch.rand(B, generator=g).double()
    bad_row = None
    if c["bad_id"] is not None and m.any():
        k = int(torch.nonzero(m.reshape(-1))[torch.randint(0, int(m.sum()), (1,), generator=g)])
        ids.view(-1)[k] = c["bad_id"]
        bad_row = k // max(L, 1)
    return ids, m, inside, adv, bad_row


def _expected(c, ids, m, adv, bad_row):
    """The reference on the padded batch, the invalid token left out of everyone's conflicts and its
    completion NaN (spec 6: unvalidated invalid input gives NaN where it reaches, never a finite number)."""
    m_ref = m.clone()
    if bad_row is not None:
        m_ref &= (ids >= 0) & (ids < 2 ** 31)
    lam, n_conf = ref.conflict_weights(ids.clamp(0, 2 ** 31 - 1), m_ref, adv, c["G"], *c["w"])
    if bad_row is not None:
        lam[bad_row], n_conf[bad_row] = float("nan"), float("nan")
    return lam, n_conf


def _call(c, ids, m, inside, adv, cu=None):
    mask = {"none": None, "bool": m, "float": m.float()}[c["mask"]]
    if c["packed"]:
        flat = lambda x: x[inside]  # noqa: E731
        cu = cu if cu is not None else torch.tensor([0] + torch.tensor(c["lens"]).cumsum(0).tolist(), dtype=torch.int32)
        args = (flat(ids).contiguous(), None if mask is None else flat(mask).contiguous(), adv.float(), cu, 0)
    else:
        args = (ids.reshape(-1).contiguous(), None if mask is None else mask.reshape(-1).contiguous(), adv.float(),
                None, ids.shape[1])
    return ops.conflict_weights(*args, c["G"], *c["w"])


@settings(max_examples=examples(60), deadline=None)
@given(c=batches())
def test_conflict_kernel_matches_reference(c):
    ids, m, inside, adv, bad_row = _inputs(c)
    if c["mask"] == "none":
        m = inside.clone()  # no mask: every token of a completion counts (the invalid id's among them)
    lam, n_conf = _call(c, ids, m, inside, adv)
    rlam, rn = _expected(c, ids, m, adv, bad_row)
    rlam = rlam[inside] if c["packed"] else rlam.reshape(-1)
    assert torch.equal(torch.isnan(lam), torch.isnan(rlam.float())), (lam, rlam)
    assert torch.equal(lam.nan_to_num(7.0).double(), rlam.nan_to_num(7.0)), (lam, rlam)
    assert torch.equal(n_conf.nan_to_num(7.0).double(), rn.nan_to_num(7.0)), (n_conf, rn)


def test_a_fixed_case_has_conflicts_and_both_weights():
    """The property's comparisons are not of ones: a group with shared prefixes and suffixes gives lam 2
    and 0 (spec 3) and n_conf above 1, in both layouts."""
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 5, 4], [1, 7, 3, 4], [9, 2, 3, 4]])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    m = torch.ones(4, 4, dtype=torch.bool)
    for packed in (False, True):
        c = dict(G=4, B=4, packed=packed, lens=[4] * 4, mask="bool", w=(2.0, 0.0))
        lam, n_conf = _call(c, ids, m, m, adv.double())
        rlam, rn = ref.conflict_weights(ids, m, adv.double(), 4, 2.0, 0.0)
        assert torch.equal(lam.double(), rlam.reshape(-1)) and torch.equal(n_conf.double(), rn)
        assert (lam == 2).any() and (lam == 0).any() and (n_conf > 1).any()


def test_malformed_cu_seqlens_gives_nan_everywhere():
    """Unvalidated, a cu_seqlens that decreases or does not end at N: every lam and n_conf NaN (each
    program fills its share of lam; nothing is read out of bounds)."""
    c = dict(G=2, B=4, packed=True, lens=[3, 2, 4, 1], mask="bool", w=(2.0, 0.0))
    ids = torch.randint(0, 3, (4, 4), generator=torch.Generator().manual_seed(0))
    inside = torch.arange(4)[None, :] < torch.tensor(c["lens"])[:, None]
    for cu in ([0, 3, 2, 9, 10], [0, 3, 5, 9, 11], [1, 3, 5, 9, 10]):
        lam, n_conf = _call(c, ids, inside, inside, torch.tensor([1.0, -1.0, 1.0, -1.0]).double(),
                            torch.tensor(cu, dtype=torch.int64))
        assert torch.isnan(lam).all() and torch.isnan(n_conf).all(), cu


def test_conflict_kernel_compiles_for_the_gpus():
    """Compiled ahead of time for sm_90, sm_80 and sm_100 (no GPU needed): what the interpreter does not
    check (a non-constexpr global, a loop-carried type) fails here."""
    code = ("from bench.aot.compiler import compile_conflict_weights\n"
            "for arch, sw in [(90, {}), (80, dict(PACKED=False, HAS_MASK=False)), (100, dict(BLOCK_G=32, BLOCK_T=32))]:\n"
            "    assert compile_conflict_weights(arch, **sw).asm.get('ptx'), (arch, sw)\n"
            "print('compiled')\n")
    compiled_ahead(code)


def test_runs_continue_across_blocks():
    """Completions longer than the kernel's block of positions (256 for a group of 4): a run of shared
    tokens carries from block to block, forward and backward, and ends where the tokens differ."""
    T = 600
    ids = torch.full((4, T), 3)
    ids[:, 300] = torch.arange(4) + 10  # runs of 300 shared tokens forward, about 290 backward ...
    m = torch.ones(4, T, dtype=torch.bool)
    m[1, 590:] = False  # ... aligned at each one's last counted token
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0]).double()
    for packed in (False, True):
        c = dict(G=4, B=4, packed=packed, lens=[T] * 4, mask="bool", w=(2.0, 0.5))
        lam, n_conf = _call(c, ids, m, torch.ones_like(m), adv)
        rlam, rn = ref.conflict_weights(ids, m, adv, 4, 2.0, 0.5)
        assert (rn > 256).any()
        assert torch.equal(lam.double(), rlam.reshape(-1)) and torch.equal(n_conf.double(), rn)
