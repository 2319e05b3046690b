"""The host checks' device predicate in one launch (kernels/check_triton, registered with core.checks):
for every float dtype and for int32 / int64 ids, with and without the counted positions, empty, one block
and several, it says what torch's predicate says, and the checks built on it raise the same errors,
naming the same position."""
import pytest
import torch

from gtpo_kernels.core import checks
from gtpo_kernels.kernels import check_triton
from conftest import compiled_ahead


def _torch_any(x, where, V):
    flat = x.reshape(-1)
    bad = ((flat < 0) | (flat.long() >= V)) if V is not None else ~torch.isfinite(flat)
    return bool((bad if where is None else bad & where.reshape(-1)).any())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("n", [0, 1, 7, 5000])
def test_non_finite_predicate_equals_torch(dtype, n):
    g = torch.Generator().manual_seed(n)
    for bad_value in (None, float("nan"), float("inf"), float("-inf")):
        x = (torch.randn(n, generator=g) * 100).to(dtype)
        if dtype == torch.float64 and n:
            x[0] = 1e300  # finite in float64, not in float32
        where = torch.rand(n, generator=g) > 0.5
        if bad_value is not None and n:
            k = int(torch.randint(0, n, (1,), generator=g))
            x[k] = bad_value
        for w in (None, where):
            got = check_triton.any_outside(x, w)
            assert got is not None and got.dtype == torch.bool and got.shape == ()
            assert bool(got) == _torch_any(x, w, None), (bad_value, w is None)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_ids_predicate_equals_torch(dtype):
    g = torch.Generator().manual_seed(1)
    for n in (0, 3, 4100):
        for edit in (None, -1, 50, 49, -100):
            ids = torch.randint(0, 50, (n,), generator=g).to(dtype)
            if edit is not None and n:
                ids[n // 2] = edit
            where = torch.rand(n, generator=g) > 0.3
            for w in (None, where):
                assert bool(check_triton.any_outside(ids, w, 50)) == _torch_any(ids, w, 50), (n, edit)


def test_the_checks_raise_naming_the_position():
    assert checks.DEVICE_ANY is check_triton.any_outside
    x = torch.randn(2, 6)
    x[1, 2] = float("nan")
    counted = torch.ones(12, dtype=torch.bool)
    with pytest.raises(ValueError, match="old_logps must be finite at counted positions; flat position 8"):
        checks.check_finite("old_logps", x, counted)
    counted[8] = False
    checks.check_finite("old_logps", x, counted)  # not counted: no error
    ids = torch.tensor([3, 9, 40, 2])
    with pytest.raises(ValueError, match=r"\[0, V\) = \[0, 10\).*flat position 2 holds 40"):
        checks.check_ids_in_range(ids, torch.ones(4, dtype=torch.bool), 10)
    checks.check_ids_in_range(ids, torch.tensor([True, True, False, True]), 10)


AOT = '''
import torch
from bench.aot.compiler import _compile_ahead
from gtpo_kernels.kernels import check_triton as C
for arch in (90, 80, 100):
    for dt, ids in ((torch.bfloat16, False), (torch.float64, False), (torch.int64, True), (torch.int32, True)):
        assert _compile_ahead(C._any_outside_kernel, arch, dict(x_ptr=dt, where_ptr=torch.bool, out_ptr=torch.bool),
                              torch.float32, dict(n=32768, V=151936),
                              dict(IDS=ids, HAS_WHERE=True, BLOCK=2048, num_warps=4)).asm.get("ptx")
print("compiled")
'''


def test_kernel_compiles_for_the_gpus():
    """Compiled ahead of time for sm_90, sm_80 and sm_100 by Triton's compiler (without the interpreter)."""
    compiled_ahead(AOT)


def test_a_view_with_strides_is_read_by_its_values():
    """old_logps as a column of a wider tensor (stride 2) holding a NaN at a counted position: found (the
    kernel reads the view's values, not its storage's first n)."""
    both = torch.randn(4, 3, 2)
    both[1, 2, 0] = float("nan")
    old = both[..., 0]
    assert old.stride() == (6, 2)
    assert bool(check_triton.any_outside(old)) and not bool(check_triton.any_outside(both[..., 1]))
    with pytest.raises(ValueError, match="flat position 5 holds nan"):
        checks.check_finite("old_logps", old, torch.ones(12, dtype=torch.bool))


def test_backend_torch_launches_no_kernel_of_its_own():
    """backend='torch' is the way around Triton: a validating call then forms its checks with torch (no Triton
    launch at all), and the checks still refuse what they refused."""
    from bench.launches import counting
    from gtpo_kernels import gtpo_loss_from_logps
    g = torch.Generator().manual_seed(0)
    lp = (-torch.rand(4, 5, generator=g) * 3).requires_grad_()
    old = lp.detach() + 0.1 * torch.randn(4, 5, generator=g)
    ids = torch.randint(0, 30, (4, 5), generator=g)

    def call(o):
        return gtpo_loss_from_logps(lp, ids, torch.tensor([1.0, -1.0, 0.5, -0.5]), old_logps=o,
                                    entropy=torch.rand(4, 5, generator=g), config="grpo", group_size=2,
                                    backend="torch", validate=True)
    call(old)
    with counting() as c:
        call(old)
    assert c.triton == 0 and c.aten > 0, dict(c.triton_names)
    old[2, 3] = float("inf")
    with pytest.raises(ValueError, match="old_logps must be finite at counted positions; flat position 13"):
        call(old)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_warnings_point_at_the_trainers_line(backend):
    """The entropy filter's warning and the unused group_size's name the caller's file, whatever lies between
    (the entry points' backend decorator, the pipeline, torch's custom ops)."""
    import warnings
    from gtpo_kernels import GTPOConfig, gtpo_loss, gtpo_loss_from_logps, linear_gtpo_loss
    g = torch.Generator().manual_seed(0)
    x, ids = torch.randn(4, 5, 30, generator=g), torch.randint(0, 30, (4, 5), generator=g)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    cfg = GTPOConfig(entropy_threshold=0.01)  # below every completion's entropy: all dropped
    calls = [lambda: gtpo_loss(x, ids, adv, group_size=2, config=cfg, backend=backend),
             lambda: gtpo_loss_from_logps(-torch.rand(4, 5, generator=g), ids, adv, entropy=torch.rand(4, 5) + 1,
                                          group_size=2, config=cfg, backend=backend),
             lambda: linear_gtpo_loss(torch.randn(4, 5, 8, generator=g), torch.randn(30, 8, generator=g), ids, adv,
                                      group_size=2, config=cfg, backend=backend),
             lambda: gtpo_loss(x, ids, adv, group_size=3, config="grpo", backend=backend)]
    for call in calls:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
        ours = [w for w in caught if "entropy filter dropped" in str(w.message) or "does not divide" in str(w.message)]
        assert len(ours) == 1 and ours[0].filename == __file__, [(w.filename, str(w.message)[:60]) for w in caught]
