"""The vocabulary-parallel merge (spec 12, kernels/vp_merge), in one process: the slices' statistics
from the Triton vocabulary kernel, merged as the ranks merge them (the all-reduces' MAX and SUM done
here) by the Triton kernels and by their torch twin, against the float64 reference's log-probs and
entropies on the whole vocabulary and against each other; uneven and empty slices, a slice all at
-inf, ties at the maximum across slices, a confident row, per-token temperatures, a NaN logit."""
import pytest
import torch

import gtpo_reference
from gtpo_kernels.core.flags import BAD_NONFINITE
from gtpo_kernels.kernels import vp_merge
from conftest import compiled_ahead

CASES = [  # (slice sizes, per-token temperature)
    ((20, 17), False),
    ((10, 0, 15, 12), True),
    ((37,), False),
]


def _inputs(seed, V=37, n=12):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, V, generator=g, dtype=torch.float64) * 2
    ids = torch.randint(0, V, (n,), generator=g)
    x[1, ids[1]] += 14.0            # confident: the target holds the maximum
    x[2] = 0.25                     # every entry tied: the maximum in every slice
    x[3, :25] = float("-inf")       # banned: the first slices all -inf on this row
    ids[3] = 30
    x[4, 5] = x[4, 30] = x[4].max() + 1.0  # the maximum tied across two slices
    counted = torch.rand(n, generator=g) > 0.15
    counted[:5] = True
    return x, ids, counted, g


def _slices(x, ids, counted, tau, sizes):
    """Each slice's forward outputs on Triton, with the slice's maximum the forward kernel stores (VP_MAX),
    equal to the torch twin's local_max bit for bit."""
    from gtpo_kernels.kernels import vocab_triton
    parts, start = [], 0
    for s in sizes:
        loc = ids - start
        sl = x[:, start:start + s].float().contiguous()[None]
        M_r = torch.full((ids.numel(),), 7.0)
        lp, en, st, bad = vocab_triton.vocab_fwd(sl, loc, counted, tau, 0, local_max=M_r)
        assert torch.equal(M_r, vp_merge.local_max(st, en, bad, s)), (M_r, vp_merge.local_max(st, en, bad, s))
        parts.append((lp, en, st, bad, loc, s, M_r))
        start += s
    return parts


def _merge(impl, parts, ids, counted, tau, V):
    M = torch.stack([M_r if impl is not vp_merge else impl.local_max(st, en, bad, Vr)
                     for (lp, en, st, bad, loc, Vr, M_r) in parts]).amax(0)
    vec = sum(impl.local_sums(lp, en, st, bad, loc, counted, M, tau, Vr) for (lp, en, st, bad, loc, Vr, _) in parts)
    return impl.finish(vec, M, ids, counted, V)


@pytest.mark.parametrize("sizes,per_token", CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_merge_kernels_equal_their_twin_and_the_reference(sizes, per_token, seed):
    x, ids, counted, g = _inputs(seed)
    n, V = x.shape
    tau = (0.5 + torch.rand(n, generator=g)) if per_token else torch.tensor([0.8])
    parts = _slices(x, ids, counted, tau.float(), sizes)
    tri = _merge(vp_merge.select("triton"), parts, ids, counted, tau.float(), V)
    twin = _merge(vp_merge, parts, ids, counted, tau.float(), V)
    assert vp_merge.select("triton") is not vp_merge
    names = ("logp", "entropy", "stats")
    for name, a, b in zip(names, tri[:3], twin[:3]):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6, msg=name)
    assert torch.equal(tri[3], twin[3])
    # the float64 reference on the whole vocabulary (counted tokens; 0 elsewhere)
    scaled = x / tau.double().reshape(-1, 1)  # the temperature per row (one value, or per token)
    ref_lp, ref_h = (r[0] for r in gtpo_reference.token_logprobs(scaled[None], ids[None], 1.0))
    for got, ref in ((tri[0], ref_lp), (tri[1], ref_h)):
        assert torch.isfinite(ref[counted]).all() and ref[counted].abs().sum() > 0
        err = (got.double() - torch.where(counted, ref, 0.0)).abs() / ref.abs().clamp(min=1)
        assert err.max() <= 1e-5, err.max()
    q = tri[2][:, 2].double()
    ref_q = torch.where(counted, -torch.expm1(ref_lp), 0.0)
    assert ((q - ref_q).abs() / ref_q.abs().clamp(min=1e-3)).max() <= 1e-4


def test_a_non_finite_logit_is_flagged_on_its_token_only():
    x, ids, counted, _ = _inputs(3)
    x[6, 30] = float("nan")
    parts = _slices(x, ids, counted, torch.tensor([1.0]), (20, 17))
    for impl in (vp_merge.select("triton"), vp_merge):
        *_, bad = _merge(impl, parts, ids, counted, torch.tensor([1.0]), 37)
        assert (bad[6] & BAD_NONFINITE) != 0 and bool((bad[counted & (torch.arange(12) != 6)] == 0).all()), bad


AOT = '''
import torch
from bench.aot.compiler import _compile_ahead
from gtpo_kernels.kernels import vp_merge_triton as M, digest_triton as D
i64, i8, f32 = torch.int64, torch.int8, torch.float32
for arch in (90, 80, 100):
    meta = dict(BLOCK=256, num_warps=4, ROWS=arch != 80)  # (ROWS: the LM head's tile, at its tokens)
    assert _compile_ahead(M._vp_sums_kernel, arch, dict(bad_ptr=i8, ids_ptr=i64, counted_ptr=torch.bool,
                          rows_ptr=i64, cu_ptr=torch.int32), f32, dict(n=32768, V_local=75968, tau_stride=1,
                          id_start=75968, row_length=512, n_seq=64),
                          dict(meta, TEMP_PER_SEQ={80: 1, 90: 2, 100: 0}[arch])).asm.get("ptx")
    # (a tau per completion: sm_80 per row, sm_90 found in a packed batch's cu_seqlens)
    # with the call's conflict weights as more programs (CONFLICT; sm_80 padded, sm_90 and sm_100 packed)
    assert _compile_ahead(M._vp_sums_kernel, arch, dict(bad_ptr=i8, ids_ptr=i64, counted_ptr=torch.bool,
                          logits_ptr=torch.bfloat16, c_ids=i64, c_mask=torch.bool, c_cu=i64), f32,
                          dict(n=32768, V_local=75968, tau_ptr=0.7, tau_stride=0, id_start=0, stride_lb=75968 * 512,
                               stride_lt=75968, T=512, logits_start=0, n_sums=128, c_B=64, c_T=512, c_N=32768,
                               c_G=8, w_pos=2.0, w_neg=0.0, n_groups=8),
                          dict(meta, ROWS=False, TEMP_BY_VALUE=True, TARGET_Z=True, CONFLICT=True,
                               C_PACKED=arch != 80, C_HAS_MASK=True, BLOCK_G=8, BLOCK_T=128)).asm.get("ptx")
    assert _compile_ahead(M._vp_finish_kernel, arch, dict(bad_out=i8, ids_ptr=i64, counted_ptr=torch.bool,
                          rows_ptr=i64), f32, dict(n=32768, V=151936), meta).asm.get("ptx")
    for dt, fp in ((torch.bfloat16, True), (i64, False)):
        assert _compile_ahead(D._terms_kernel, arch, dict(x_ptr=dt, where_ptr=torch.bool, out_ptr=i64), f32,
                              dict(n=32768, size_term=1 << 60, pos=3),
                              dict(IS_FLOAT=dt.is_floating_point, HAS_WHERE=True, FP=fp, BLOCK=1024,
                                   num_warps=4)).asm.get("ptx")
    terms = {f"{a}{k}": v for k in range(8) for a, v in (("n", 4096), ("s", 1 << 60), ("p", k), ("o", k + 1))}
    assert _compile_ahead(D._row_kernel, arch, dict(x0=torch.bfloat16, w0=torch.bool, x1=i64, x2=torch.float32,
                          w2=torch.float32, x4=torch.float32, w4=torch.bool, x5=torch.float32, x6=torch.float32,
                          w6=torch.bool, x7=torch.bfloat16, row_ptr=i64, ids_ptr=i64, counted_ptr=torch.float32,
                          cu_ptr=torch.int32 if arch == 90 else i64), i64,
                          dict(terms, n_tok=32768, T=512, o_tok=9, n_cu=64, n_fields=27, raw0=75968, key=(1 << 61) | 99),
                          dict(F0=3 | 8, F1=24 | 64, F2=3 | 48, F3=5 if arch == 80 else 40 | 64,
                               F4={80: 16, 90: 3 | 48 | 64 | 128, 100: 3 | 128}[arch],
                               F5=56 | 66 if arch == 100 else 32 | 64,
                               F6=3 | 48 | 256, F7=1 | 56 | 64 | 256,  # (per completion of cu_seqlens: at least 0
                               # with its checksum; a temperature alone)
                               N_TERMS=8, TOKENS=True, HAS_MASK=True, CHECKS=arch != 80, HEAD=0 if arch == 80 else 2,
                               BLOCK=1024,
                               num_warps=4)).asm.get("ptx")  # (checks: finite, ids alone, at least, cu_max alone,
    # 0 or 1 (sm_90: per-row weights at least 0 alone; sm_100: their checksum at the tokens), cu alone or on
    # sm_100 a temperature alone at `where`; digest_triton._add_term's F bits)
from gtpo_kernels.kernels import vocab_fwd_triton as F  # the forward kernel storing the slice's maximum (VP_MAX)
from gtpo_kernels.kernels.vocab_triton import fwd_block_v
assert _compile_ahead(F._vocab_fwd_kernel, 90, dict(logits_ptr=torch.bfloat16, ids_ptr=i64, mask_ptr=torch.bool,
                      bad_ptr=i8, max_ptr=f32), f32, dict(stride_lb=75968 * 512, stride_lt=75968, T=512, V=75968,
                      logits_start=0, temp_ptr=0.7, temp_stride=0, scale=1.0, softcap=0.0, NB=1, id_start=75968),
                      dict(HAS_SCALE=False, HAS_SOFTCAP=False, BLOCK_V=fwd_block_v(151936), TEMP_BY_VALUE=True,
                           VP_MAX=True, num_warps=8)).asm.get("ptx")
# the LM head's tile of a slice: inputs at each row's token, the slice's statistics and maximum at the row
assert _compile_ahead(F._vocab_fwd_kernel, 90, dict(logits_ptr=torch.bfloat16, ids_ptr=i64, mask_ptr=torch.bool,
                      bad_ptr=i8, max_ptr=f32, rows_ptr=i64), f32, dict(stride_lb=75968 * 512, stride_lt=75968,
                      T=512, V=75968, logits_start=0, temp_stride=1, scale=1.0, softcap=0.0, NB=1, id_start=0),
                      dict(HAS_SCALE=False, HAS_SOFTCAP=False, BLOCK_V=fwd_block_v(151936), HAS_MASK=False,
                           VP_MAX=True, ROWS=True, OUT_AT_ROW=True, num_warps=8)).asm.get("ptx")
# the first launch of a split loss: the slice's forward pass and the agreement's row (vp_first_triton)
from gtpo_kernels.kernels import vp_first_triton as P
terms = {f"{a}{k}": v for k in range(8) for a, v in (("n", 4096), ("s", 1 << 60), ("p", k), ("o", k + 1))}
for arch in (90, 80):
    assert _compile_ahead(P._vp_first_kernel, arch, dict(logits_ptr=torch.bfloat16, mask_ptr=torch.bool, bad_ptr=i8,
                          seq_cu_ptr=i64, row_ptr=i64, x0=torch.bfloat16, w0=torch.bool, x1=i64, ids_ptr=i64,
                          counted_ptr=torch.bool, cu_ptr=i64), f32,
                          dict(terms, stride_lb=75968 * 512, stride_lt=75968, T=512, V=75968, logits_start=0,
                               n_tok_f=32768, temp_stride=1, n_seq=64, n_tok=32768, T_tok=512, o_tok=9, n_cu=64,
                               n_fields=27, raw0=75968, key=(1 << 61) | 99),
                          dict(F0=3 | 8, F1=24 | 64, F2=0, F3=0, F4=0, F5=0, F6=0, F7=0, N_TERMS=2, TOKENS=True,
                               ROW_MASK=True, CHECKS=arch == 90, HEAD=2, BLOCK=P.ROW_BLOCK, BLOCK_V=fwd_block_v(151936),
                               HAS_MASK=True, TEMP_BY_VALUE=False, TEMP_PER_SEQ=2 if arch == 90 else 0,
                               VOCAB_BLOCK=8192, num_warps=4)).asm.get("ptx")
print("compiled")
'''


def test_kernels_compile_for_the_gpus():
    """The merge's two kernels (the sums' with the call's conflict weights too) and the agreement's two
    checksum kernels compiled ahead of time for sm_90, sm_80 and sm_100, the forward kernel storing the slice's maximum (VP_MAX) for sm_90, and a split loss's
    first launch (the forward pass and the agreement's row) for sm_90 and sm_80, by Triton's compiler (a
    process without the interpreter)."""
    compiled_ahead(AOT)


def test_an_empty_slice_and_an_id_outside_the_vocabulary():
    """Whatever the pass returns for an empty slice adds nothing (here finite numbers that would win the
    maximum); a counted id outside [0, V) of the whole vocabulary is flagged, on either implementation."""
    from gtpo_kernels.core.flags import BAD_ID
    x, ids, counted, _ = _inputs(5)
    ids[7], counted[7] = 40, True
    tau = torch.tensor([1.0])
    out = {}
    for impl in (vp_merge.select("triton"), vp_merge):
        parts, start = [], 0
        for s in (20, 0, 17):
            loc = ids - start
            if s == 0:  # a pass's numbers for no vocabulary at all: ignored
                n = ids.numel()
                st, bad = torch.tensor([[9.0, 1.0, 0.5]]).repeat(n, 1), torch.zeros(n, dtype=torch.int8)
                en = torch.full((n,), 0.7)
                parts.append((torch.full((n,), -0.5), en, st, bad, loc, 0, vp_merge.local_max(st, en, bad, 0)))
                continue
            parts += _slices(x[:, start:], ids - start, counted, tau, (s,))
            start += s
        out[impl] = _merge(impl, parts, ids, counted, tau, 37)
        logp, ent, stats, bad = out[impl]
        assert (bad[7] & BAD_ID) != 0, bad
        ok = counted & (torch.arange(ids.numel()) != 7)
        ref_lp, ref_h = (r[0] for r in gtpo_reference.token_logprobs(x[None], ids.clamp(max=36)[None], 1.0))
        torch.testing.assert_close(logp[ok].double(), ref_lp[ok], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent[ok].double(), ref_h[ok], rtol=1e-5, atol=1e-5)
