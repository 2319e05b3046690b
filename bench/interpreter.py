"""Triton's interpreter (TRITON_INTERPRET=1, the kernels run on the CPU) without its per-call re-patching.

The interpreter swaps `triton.language`'s builtins for NumPy versions when a kernel's grid starts, and puts
them back when it ends. It also repeats the swap at every call of a `@triton.jit` helper inside the kernel,
where it is already in place: a scan of the language modules' members, about 0.25 ms a call, some 40 % of
the interpreter's time on this package's kernels (a helper-heavy vocabulary kernel's program: 17 ms -> 10 ms).
`install()` skips that repeat while a grid runs and the helper sees no language module the grid did not
patch; the kernels' code, and what each operation computes, are unchanged. It changes nothing unless
TRITON_INTERPRET=1, and nothing on a Triton whose interpreter lacks the internals it wraps (then the
interpreter runs as shipped). The tests' and the benchmark's CPU runs call it."""
import inspect
import os

_installed = False


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
    langs = (tl, tl.core)
    state = {"depth": 0, "patched": frozenset()}

    def lang_ids(fn):
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in langs)

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
    interp.InterpretedFunction.__call__ = helper_call
    _installed = True
    return True
