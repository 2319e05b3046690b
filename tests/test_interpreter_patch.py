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
