"""Triton's interpreter (TRITON_INTERPRET=1, the kernels run on the CPU) without its per-call re-patching.

The interpreter swaps `triton.language`'s builtins for NumPy versions when a kernel's grid starts, and puts
them back when it ends. It also repeats the swap at every call of a `@triton.jit` helper inside the kernel,
where it is already in place: a scan of the language modules' members, about 0.25 ms a call, some 40 % of
the interpreter's time on this package's kernels (a helper-heavy vocabulary kernel's program: 17 ms -> 10 ms).
`install()` skips that repeat while a grid runs and the helper sees no language module the grid did not
patch (which language modules a function sees is found once per function), and makes the interpreter's
dtype table once instead of at each of its lookups (an 18-entry dict of NumPy dtypes, built at every
operation's type check: about 10 % of the interpreter's time); the kernels' code, and what each operation
computes, are unchanged. It changes nothing unless
TRITON_INTERPRET=1, and nothing on a Triton whose interpreter lacks the internals it wraps (then the
interpreter runs as shipped). The tests' and the benchmark's CPU runs call it."""
import inspect
import os

_installed = False
original_np_dtype = None  # the interpreter's own _get_np_dtype, once install() replaced it


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

    interp.GridExecutor.__call__ = grid_call_once
    if np_dtype is not None:
        interp._get_np_dtype = np_dtype
    interp.InterpretedFunction.__call__ = helper_call
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
