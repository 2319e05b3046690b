"""Triton's interpreter (TRITON_INTERPRET=1, the kernels run on the CPU) without its per-call re-patching.

The interpreter swaps `triton.language`'s builtins for NumPy versions when a kernel's grid starts, and puts
them back when it ends. It also repeats the swap at every call of a `@triton.jit` helper inside the kernel,
where it is already in place: a scan of the language modules' members, about 0.25 ms a call, some 40 % of
the interpreter's time on this package's kernels (a helper-heavy vocabulary kernel's program: 17 ms -> 10 ms).
`install()` skips that repeat while a grid runs and the helper sees no language module the grid did not
patch (which language modules a function sees is found once per function), and makes the interpreter's
dtype table once instead of at each of its lookups (an 18-entry dict of NumPy dtypes, built at every
operation's type check: about 10 % of the interpreter's time). It also makes each block type's values once
(`tl.block_type` of an element type and shape: its checked shape, and the shape and size a tensor of it
carries, made at every operation's result) and skips the implicit broadcast of two operands whose shapes are
already equal (the shipped rule makes two same-shape views and their types), and the type check of two
tensors of one 32- or 64-bit scalar type (no promotion, no cast): about 20 % of what remained.
The kernels' code, and what each operation computes, are unchanged. It changes nothing unless
TRITON_INTERPRET=1, and nothing on a Triton whose interpreter lacks the internals it wraps (then the
interpreter runs as shipped). The tests' and the benchmark's CPU runs call it."""
import contextlib
import inspect
import os

_installed = False
original_np_dtype = None  # the interpreter's own _get_np_dtype, once install() replaced it
replaced = {}  # (owner, name): the shipped attribute, for each one install() replaced (see `shipped`)


def _replace(owner, name, new):
    replaced.setdefault((owner, name), getattr(owner, name))
    setattr(owner, name, new)


def _undo(owner, name):
    setattr(owner, name, replaced.pop((owner, name)))


@contextlib.contextmanager
def shipped():
    """Triton's interpreter as shipped, inside the block (the tests compare what a kernel computes with and
    without install()'s replacements); install()'s again after it."""
    mine = {k: getattr(*k) for k in replaced}
    for (owner, name), v in replaced.items():
        setattr(owner, name, v)
    try:
        yield
    finally:
        for (owner, name), v in mine.items():
            setattr(owner, name, v)


def install():
    """Patch Triton's interpreter once per process (see the module's text); returns whether it did."""
    global _installed
    if _installed:
        return True
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
        grid_call = interp.GridExecutor.__call__
        patch_lang = interp._patch_lang
        error = interp.InterpreterError
        interp.InterpretedFunction.rewrite  # noqa: B018 (an internal the wrapper below calls)
    except (ImportError, AttributeError):
        return False
    np_dtype = _np_dtype_once(interp, tl)
    langs = (tl, tl.core)
    state = {"depth": 0, "patched": frozenset()}
    seen = {}

    def lang_ids(fn):
        ids = seen.get(fn)
        if ids is None:
            ids = seen[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in langs)
        return ids

    def grid_call_once(self, *args, **kwargs):
        depth, patched = state["depth"], state["patched"]
        state["depth"], state["patched"] = depth + 1, patched | lang_ids(self.fn)
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            state["depth"], state["patched"] = depth, patched

    def helper_call(self, *args, **kwargs):
        # as InterpretedFunction.__call__ (a device function's call), without a repeat of the grid's patch
        mine = lang_ids(self.fn)
        if not (state["depth"] and mine <= state["patched"]):
            patch_lang(self.fn)
            if state["depth"]:
                state["patched"] |= mine
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise error(repr(e)) from e

    _replace(interp.GridExecutor, "__call__", grid_call_once)
    if np_dtype is not None:
        _replace(interp, "_get_np_dtype", np_dtype)
    _replace(interp.InterpretedFunction, "__call__", helper_call)
    _types_once(tl.core)
    _equal_shapes_unbroadcast()
    _same_type_operands()
    _installed = True
    return True


def _np_dtype_once(interp, tl):
    """The interpreter's _get_np_dtype with its table made once (the same table and lookups), or None where
    this Triton's differs from the one it was written against (then the interpreter's own runs)."""
    global original_np_dtype
    import numpy as np
    table = {}
    for name, np_type in (("int1", bool), ("float16", np.float16), ("float32", np.float32), ("float64", np.float64),
                          ("int8", np.int8), ("uint8", np.uint8), ("int16", np.int16), ("uint16", np.uint16),
                          ("int32", np.int32), ("uint32", np.uint32), ("int64", np.int64), ("uint64", np.uint64),
                          ("bfloat16", np.uint16), ("float8e5", np.uint8), ("float8e5b16", np.uint8),
                          ("float8e4nv", np.uint8), ("float8e4b8", np.uint8), ("float8e4b15", np.uint8)):
        if not hasattr(tl, name):
            return None
        table[getattr(tl, name)] = np.dtype(np_type)
    original, pointer, block, u64 = interp._get_np_dtype, tl.pointer_type, tl.block_type, np.dtype(np.uint64)
    try:  # the table is the interpreter's own, entry by entry
        if any(original(ty) != table[ty] for ty in table):
            return None
    except Exception:  # noqa: BLE001 - another Triton's lookup: keep it
        return None

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, pointer):
            return u64
        if isinstance(tt_dtype, block):
            if isinstance(tt_dtype.element_ty, pointer):
                return u64
            return table[tt_dtype.element_ty]
        return table[tt_dtype]
    original_np_dtype = original
    return np_dtype


def _types_once(core):
    """tl.block_type's values made once per (element type, shape), and a tensor's shape and size taken from its
    type as made there, where this Triton's tensor carries exactly what the shipped constructor gives it
    (checked on a block and a scalar tensor; else nothing is replaced)."""
    constexpr, block_type, tensor = core.constexpr, core.block_type, core.tensor
    accepted = (list, core.tuple)  # the shapes tl.block_type takes (core.tuple: Triton's, not Python's)
    block_init, tensor_init = block_type.__init__, tensor.__init__
    made = {}

    def block(self, element_ty, shape):
        key = hit = None
        if isinstance(shape, accepted):  # (as the shipped constructor checks; else its error)
            try:
                key = (element_ty, tuple(x.value if isinstance(x, constexpr) else x for x in shape))
                hit = made.get(key)
            except TypeError:  # (an element type without a hash: made each time, as shipped)
                key = None
        if hit is not None:
            self.__dict__.update(hit)
            return
        block_init(self, element_ty, shape)
        self._tensor_shape, self._tensor_numel = tuple(constexpr(x) for x in self.shape), constexpr(self.numel)
        if key is not None:
            made[key] = dict(self.__dict__)

    def tensor_of(self, handle, type):
        shape = type.__dict__.get("_tensor_shape")
        if shape is None:
            tensor_init(self, handle, type)
            if not type.is_block():  # a scalar type: its values once, on the type
                type._tensor_shape, type._tensor_numel = self.shape, self.numel
            return
        self.handle, self.shape, self.numel, self.type, self.dtype = \
            handle, shape, type.__dict__["_tensor_numel"], type, type.scalar

    def fields(t):
        return (t.handle, t.shape, t.numel, t.type, t.dtype)
    try:
        want = [tensor(None, block_type(core.float32, [2, 4])), tensor(None, core.int32)]
        _replace(block_type, "__init__", block)
        _replace(tensor, "__init__", tensor_of)
        for _ in range(2):  # the first made, then as found again
            got = [tensor(None, block_type(core.float32, [constexpr(2), 4])), tensor(None, core.int32)]
            if [fields(t) for t in got] != [fields(t) for t in want] or \
                    any(set(g.__dict__) != set(w.__dict__) for g, w in zip(got, want)):
                raise ValueError("fields")
    except Exception:  # noqa: BLE001 - another Triton's types: keep its own constructors
        for owner in (block_type, tensor):
            if (owner, "__init__") in replaced:
                _undo(owner, "__init__")
        made.clear()
        return False
    return True


def _equal_shapes_unbroadcast():
    """The implicit broadcast of two operands (TritonSemantic.broadcast_impl_value) returns them as they are
    when their shapes are already equal (two blocks of one shape, or two scalars); every other case runs the
    shipped rule."""
    try:
        from triton.language.semantic import TritonSemantic
        shipped = TritonSemantic.broadcast_impl_value
    except (ImportError, AttributeError):
        return False

    def broadcast(self, lhs, rhs):
        a, b = lhs.type, rhs.type
        if a.is_block():
            if b.is_block() and a.shape == b.shape:
                return lhs, rhs
        elif not b.is_block():
            return lhs, rhs
        return shipped(self, lhs, rhs)
    _replace(TritonSemantic, "broadcast_impl_value", broadcast)
    return True


def _same_type_operands():
    """A binary operation's type check (binary_op_type_checking_impl) on two tensors of one scalar type among
    float32, float64, int32 and int64 goes straight to the broadcast: the shipped rule finds that type as
    the computation type (with / and % too), casts neither operand and checks no pointer; every other case
    (a Python number, a pointer, 16-bit floats, two types) runs the shipped rule."""
    import triton.language as tl
    try:
        from triton.language.semantic import TritonSemantic
        shipped = TritonSemantic.binary_op_type_checking_impl
    except (ImportError, AttributeError):
        return False
    plain = {t.name for t in (tl.float32, tl.float64, tl.int32, tl.int64)}
    tensor, dtype = tl.tensor, tl.dtype

    def check(self, lhs, rhs, allow_lhs_ptr=False, allow_rhs_ptr=False, arithmetic_check=True, div_or_mod=False):
        if type(lhs) is tensor and type(rhs) is tensor:
            a, b = lhs.dtype, rhs.dtype  # (the scalar types)
            if type(a) is dtype and type(b) is dtype and a.name == b.name and a.name in plain:
                return self.broadcast_impl_value(lhs, rhs)
        return shipped(self, lhs, rhs, allow_lhs_ptr, allow_rhs_ptr, arithmetic_check, div_or_mod)
    _replace(TritonSemantic, "binary_op_type_checking_impl", check)
    return True
