"""bench/interpreter.py (installed by conftest for every test): the interpreter's dtype table made once gives
what the interpreter's own lookup gives, for every dtype, block and pointer it meets."""
import pytest
import triton.language as tl
from triton.runtime import interpreter as interp

from bench import interpreter


def test_the_dtype_table_made_once_equals_the_interpreters():
    if interpreter.original_np_dtype is None:
        pytest.skip("this Triton's interpreter runs as shipped (no table replaced)")
    fast, own = interp._get_np_dtype, interpreter.original_np_dtype
    assert fast is not own
    scalars = [getattr(tl, n) for n in ("int1", "float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16",
                                        "uint16", "int32", "uint32", "int64", "uint64", "float8e5", "float8e4nv")]
    types = scalars + [tl.pointer_type(t) for t in scalars] + [tl.block_type(t, [4]) for t in scalars] + \
        [tl.block_type(tl.pointer_type(t), [2, 8]) for t in scalars]
    for t in types:
        assert fast(t) == own(t), t
    assert fast(tl.bfloat16).itemsize == 2 and fast(tl.pointer_type(tl.int8)).itemsize == 8


def test_types_made_once_carry_what_the_shipped_constructors_give():
    """Block types made once per (element type, shape) and tensors taking their shape and size from them:
    every field as the shipped constructors give it, for blocks of scalars and pointers, 1-d and 2-d, shapes
    given as numbers or constexprs, and scalar tensors."""
    core = tl.core
    if (core.tensor, "__init__") not in interpreter.replaced:
        pytest.skip("this Triton's interpreter runs with its own constructors")

    def made():
        out = []
        for t in (tl.float32, tl.bfloat16, tl.int64, tl.int1, tl.pointer_type(tl.float16)):
            for shape in ([4], [2, 8], [tl.constexpr(16)], tl.tuple([1, tl.constexpr(32)])):
                b = tl.block_type(t, shape)
                out.append((b, b.shape, b.numel, b.name, b.element_ty))
                x = core.tensor(None, b)
                out.append((x.shape, x.numel, x.type, x.dtype, sorted(x.__dict__)))
            x = core.tensor(None, t)
            out.append((x.shape, x.numel, x.type, x.dtype, sorted(x.__dict__)))
        return out
    ours, again = made(), made()
    with interpreter.shipped():
        assert core.tensor.__init__ is interpreter.replaced[(core.tensor, "__init__")]
        theirs = made()
    assert ours == theirs and again == theirs


def test_kernels_compute_bitwise_what_the_shipped_interpreter_computes():
    """The forward vocabulary kernel (blocks of equal and of broadcast shapes, scalars, 32-bit and 64-bit
    operands, bf16 logits promoted) and a kernel that broadcasts a column against a row and divides two bf16
    vectors give bitwise the same outputs with install()'s replacements as with the interpreter as shipped."""
    import torch
    import triton

    from gtpo_kernels.kernels import dispatch
    from triton.language.semantic import TritonSemantic
    for owner, name in ((tl.core.tensor, "__init__"), (TritonSemantic, "broadcast_impl_value"),
                        (TritonSemantic, "binary_op_type_checking_impl")):
        assert (owner, name) in interpreter.replaced, name

    @triton.jit
    def outer(a_ptr, b_ptr, c_ptr, out_ptr, q_ptr, M: tl.constexpr, N: tl.constexpr):
        i = tl.arange(0, M)[:, None]
        j = tl.arange(0, N)[None, :]
        a, b = tl.load(a_ptr + i), tl.load(b_ptr + j)
        y = a * b + tl.exp(a - b) * 0.5
        tl.store(out_ptr + tl.arange(0, M * N), tl.reshape(y + y, [M * N]))  # (the broadcast's type: M x N)
        c, d = tl.load(c_ptr + tl.arange(0, N)), tl.load(c_ptr + N + tl.arange(0, N))  # bf16: / in float32
        tl.store(q_ptr + tl.arange(0, N), c / d)

    g = torch.Generator().manual_seed(5)
    z, ids = (torch.randn(3, 4, 40, generator=g) * 3).bfloat16(), torch.randint(0, 40, (12,), generator=g)
    counted, tau = torch.rand(12, generator=g) > 0.2, torch.tensor([0.8])
    a, b = torch.randn(4, generator=g), torch.randn(8, generator=g)
    c = (torch.rand(16, generator=g) + 0.5).bfloat16()

    def run():
        out, q = torch.empty(4, 8), torch.empty(8)
        outer[(1,)](a, b, c, out, q, M=4, N=8)
        return [out, q, *dispatch.vocab_fwd("triton", z, ids, counted, tau, 0)]
    ours = run()
    with interpreter.shipped():
        theirs = run()
    want = 2 * (a[:, None] * b[None, :] + torch.exp(a[:, None] - b[None, :]) * 0.5)
    assert torch.allclose(ours[0], want, rtol=1e-6, atol=0)
    cf = c.float()
    assert torch.allclose(ours[1], cf[:8] / cf[8:], rtol=1e-6, atol=0)
    for x, y in zip(ours, theirs):
        assert x.dtype == y.dtype and torch.equal(x.view(-1).view(torch.uint8) if x.is_floating_point() else x,
                                                  y.view(-1).view(torch.uint8) if y.is_floating_point() else y)
