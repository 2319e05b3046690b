"""The static GPU report, made on any machine: our kernels compiled ahead of time for Hopper and Ampere.

Each kernel is specialized as a real launch would be (Triton's own binder on stand-in arguments: pointers
16-byte aligned, V and the row strides divisible by 16 at real vocabulary sizes, T and logits_start not
specialized), compiled with `triton.compile` for `GPUTarget("cuda", 90 | 80, 32)`, then
- `ptxas -v` (the one Triton ships, triton/backends/nvidia/bin) gives registers and spill bytes;
- `cuobjdump -sass` of the cubin lists the global loads by width. The only tensor-shaped loads of both
  kernels are the logits (checked on the TTIR); the other loads are per-token scalars. So the logits
  are read with 16-byte loads when the SASS has LDG.E.128 and no more narrow loads than the kernel has
  scalar loads (a logits loop split into narrow loads would add one per vector piece).

    python -m bench.aot            # the table; exit status 1 if a kernel fails the check
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tempfile

import torch

ARCHS = (90, 80)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
V_REAL = 151936  # all of 32000, 128256, 151936, 262144 get the same specialization and BLOCK_V
T_REAL = 1024


class _Ptr:
    """Stands for a tensor in Triton's binder: a dtype and a 16-byte aligned address."""

    def __init__(self, dtype):
        self.dtype = dtype

    @staticmethod
    def data_ptr():
        return 1 << 20


def _arg_for(name, dtype, V, T, has_e):
    """The value a launch passes for parameter `name` (our launchers' naming)."""
    T_l = T + 1
    if name.endswith("_ptr"):
        return _Ptr({"logits_ptr": dtype, "grad_ptr": dtype, "ids_ptr": torch.int64, "mask_ptr": torch.bool,
                     "bad_ptr": torch.int8}.get(name, torch.float32))
    table = {"stride_lb": T_l * V, "stride_gb": T_l * V, "stride_lt": V, "stride_gt": V, "T": T, "T_l": T_l,
             "V": V, "logits_start": 0, "inv_temp": 1.0}
    if name in table:
        return table[name]
    raise KeyError(f"aot: no stand-in for kernel parameter {name!r}; teach bench/aot.py its value")


def _bin(tool):
    import triton
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", tool)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{tool} not shipped with this triton ({path})")
    return path


@dataclasses.dataclass
class AotResult:
    kernel: str
    variant: str
    dtype: str
    arch: int
    V: int
    ok: bool
    registers: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    ldg128: int = 0
    narrow_ldg: int = 0
    scalar_loads: int = 0
    error: str = ""
    expect_vector: bool = True

    def problems(self):
        out = []
        if self.error:
            return [self.error]
        if self.spill_stores or self.spill_loads:
            out.append(f"spills {self.spill_stores}/{self.spill_loads} bytes")
        if self.expect_vector and (self.ldg128 == 0 or self.narrow_ldg > self.scalar_loads):
            out.append(f"narrow logits loads (LDG.E.128: {self.ldg128}, narrow: {self.narrow_ldg}, "
                       f"scalar loads: {self.scalar_loads})")
        return out


def _ldg_widths(sass):
    widths = []
    for m in re.finditer(r"\bLDG((?:\.[A-Z0-9_]+)*)", sass):
        mods = m.group(1).split(".")
        w = 32
        for mod, bits in (("128", 128), ("64", 64), ("U16", 16), ("S16", 16), ("U8", 8), ("S8", 8)):
            if mod in mods:
                w = bits
        widths.append(w)
    return widths


def compile_kernel(kernel, dtype, arch, V=V_REAL, T=T_REAL, has_e=None, expect_vector=True) -> AotResult:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from gtpo_kernels import vocab_triton as vt

    name = kernel.fn.__name__
    variant = "" if has_e is None else ("HAS_E" if has_e else "no E")
    res = AotResult(name, variant, str(dtype).replace("torch.", ""), arch, V, ok=False, expect_vector=expect_vector)
    try:
        target = GPUTarget("cuda", arch, 32)
        backend = make_backend(target)
        bv = vt.block_v_for(V)
        meta = {"BLOCK_V": bv, "num_warps": vt.num_warps_for(bv)}
        if has_e is not None:
            meta["HAS_E"] = has_e
        args = [_arg_for(p.name, dtype, V, T, has_e) for p in kernel.params if not p.is_constexpr]
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, spec, opts = binder(*args, **meta)
        options, sig, constexprs, attrs = kernel._pack_args(backend, meta, bound, spec, opts)
        ck = triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=target, options=options.__dict__)
        ptx, cubin, ttir = ck.asm["ptx"], ck.asm["cubin"], ck.asm["ttir"]
        gpu = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1).rstrip(",")
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "k.ptx"), "w") as f:
                f.write(ptx)
            with open(os.path.join(d, "k.cubin"), "wb") as f:
                f.write(cubin)
            info = subprocess.run([_bin("ptxas"), "-v", f"--gpu-name={gpu}", os.path.join(d, "k.ptx"), "-o",
                                   os.path.join(d, "v.cubin")], capture_output=True, text=True, check=True)
            sass = subprocess.run([_bin("cuobjdump"), "-sass", os.path.join(d, "k.cubin")], capture_output=True,
                                  text=True, check=True).stdout
        text = info.stdout + info.stderr
        res.registers = int(re.search(r"Used (\d+) registers", text).group(1))
        sp = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
        res.spill_stores, res.spill_loads = int(sp.group(1)), int(sp.group(2))
        widths = _ldg_widths(sass)
        res.ldg128 = sum(w == 128 for w in widths)
        res.narrow_ldg = sum(w < 128 for w in widths)
        loads = [ln for ln in ttir.splitlines() if "tt.load" in ln]
        res.scalar_loads = sum("tensor<" not in ln for ln in loads)
        elem = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}[dtype]
        tensor_loads = [ln for ln in loads if "tensor<" in ln]
        if any(f"!tt.ptr<{elem}>" not in ln for ln in tensor_loads):
            res.error = "a tensor-shaped load that is not of the logits: the check's premise no longer holds"
    except Exception as e:  # a compile error is a result
        res.error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:300]
    res.ok = not res.problems()
    return res


def report(archs=ARCHS, dtypes=DTYPES, odd_v=True):
    """Every kernel variant x dtype x arch at V_REAL, plus (informational, `expect_vector=False`) the
    forward in bfloat16 at V = 50257, whose odd row stride allows no 16-byte load."""
    from gtpo_kernels import vocab_triton as vt
    out = []
    for arch in archs:
        for dt in dtypes:
            out.append(compile_kernel(vt._vocab_fwd_kernel, dt, arch))
            for has_e in (False, True):
                out.append(compile_kernel(vt._vocab_bwd_kernel, dt, arch, has_e=has_e))
    if odd_v:
        out.append(compile_kernel(vt._vocab_fwd_kernel, torch.bfloat16, archs[0], V=50257, expect_vector=False))
    return out


def report_in_subprocess(timeout=600):
    """The report from a child process without TRITON_INTERPRET (this process's kernels may be the
    interpreter's, which cannot be compiled). Returns AotResult objects."""
    import json
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-m", "bench.aot", "--json"], env=env, capture_output=True, text=True,
                       timeout=timeout, cwd=root)
    try:
        return [AotResult(**d) for d in json.loads(p.stdout.strip().splitlines()[-1])]
    except Exception:
        raise RuntimeError(f"AOT child failed: {p.stderr[-2000:]}")


def format_table(results):
    lines = [f"{'kernel':<22} {'variant':<6} {'dtype':<9} {'arch':<5} {'V':>7} {'regs':>5} {'spill':>7} "
             f"{'LDG.128':>7} {'narrow':>6}  verdict"]
    for r in results:
        verdict = "ok" if r.ok else "FAIL: " + "; ".join(r.problems())
        if not r.expect_vector and not r.error:
            verdict = ("info: odd V, no 16-byte alignment possible" if r.ldg128 == 0 else "info") + \
                ("" if r.ok else f" ({verdict})")
        lines.append(f"{r.kernel:<22} {r.variant:<6} {r.dtype:<9} sm_{r.arch:<2} {r.V:>7} {r.registers:>5} "
                     f"{r.spill_stores:>3}/{r.spill_loads:<3} {r.ldg128:>7} {r.narrow_ldg:>6}  {verdict}")
    return "\n".join(lines)


def main():
    res = report()
    if "--json" in sys.argv:
        import json
        print(json.dumps([r.__dict__ for r in res]))
    else:
        print(format_table(res))
    sys.exit(0 if all(r.ok for r in res) else 1)


if __name__ == "__main__":
    main()
