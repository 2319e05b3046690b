"""The static GPU report, made on any machine: our kernels compiled ahead of time for Hopper (sm_90),
Ampere (sm_80), Blackwell (sm_100) and AMD's CDNA3 (gfx942, MI300; counted by amd.py).

Each kernel is specialized as a real launch would be (Triton's own binder on stand-in arguments: pointers
16-byte aligned, V and the row strides divisible by 16 at real vocabulary sizes, T and logits_start not
specialized, scale = 1 and no soft-cap unless --transforms), compiled with `triton.compile` for
`GPUTarget("cuda", 90 | 80 | 100, 32)` (and `GPUTarget("hip", "gfx942", 64)`), then
- `ptxas -v` (the one Triton ships, triton/backends/nvidia/bin; ptxas-blackwell for sm_100) gives
  registers and spill bytes;
- `cuobjdump -sass` of the cubin lists the global loads by width. The only tensor-shaped loads of both
  kernels are the logits (checked on the TTIR); the other loads are per-token scalars. So the logits
  are read with 16-byte loads when the SASS has LDG.E.128 and no more narrow loads than the kernel has
  scalar loads (a logits loop split into narrow loads would add one per vector piece);
- the main vocabulary loop is found in that SASS (see `find_main_loop`): instructions per logit element,
  barriers and special-function (MUFU) operations per iteration;
- occupancy (warps per SM) from registers and shared memory with the sm_90 / sm_80 limits (`SM_LIMITS`);
- a roofline estimate for N = 16384 tokens, V = 151936, bf16 on each device of `DEVICES` whose
  constants are known, from the counts of its architecture (`roofline`): the largest of memory time,
  issue time and special-function time. None for gfx942 (no constants established here).

The SASS analysis (the main loop, occupancy, roofline) is sass.py; the tables and files tables.py.

Peers (peers.py, optional: compiled when installed, with their own launchers' settings, counted
the same way, shown with ours / theirs; they never decide the exit status): Liger-Kernel's GRPO loss
forward and backward (pip install liger-kernel==0.8.5) and TRL's log-prob / entropy forward.

The command is `python -m bench.aot` (__main__.py).
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tempfile

import torch

from ..common.record import ROOT
from .sass import ARCHS, V_REAL, _ldg_widths, kept_loop_stats, loop_stats, sass_instructions, warps_per_sm

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
T_REAL = 1024


class _Ptr:
    """Stands for a tensor in Triton's binder: a dtype and a 16-byte aligned address."""

    def __init__(self, dtype):
        self.dtype = dtype

    @staticmethod
    def data_ptr():
        return 1 << 20


# int64 tensors of the replay kernels (replay_triton): rows, sampled ids, the kept sets' offsets
_INT64_PTRS = ("rows_ptr", "ids_ptr", "row_ptr", "grow_ptr", "y_ptr", "off_ptr", "rb_ptr", "rt_ptr")


def _arg_for(name, dtype, V, T, has_e):
    """The value a launch passes for parameter `name` (our launchers' naming)."""
    T_l = T + 1
    if name.endswith("_ptr"):
        return _Ptr({"logits_ptr": dtype, "grad_ptr": dtype, "mask_ptr": torch.bool, "bad_ptr": torch.int8,
                     **dict.fromkeys(_INT64_PTRS, torch.int64)}.get(name, torch.float32))
    table = {"stride_lb": T_l * V, "stride_gb": T_l * V, "stride_lt": V, "stride_gt": V, "T": T, "T_l": T_l,
             "V": V, "logits_start": 0, "temp_stride": 0, "g_stride": 0, "scale": 0.5,
             "softcap": 30.0, "NB": 19, "id_start": 0,  # floats: never specialized; NB: blocks per token (the merge)
             "n_seq": 64, "max_seqlen": -1,  # the status word's cu_seqlens check (off unless CU_CHECK)
             "s0": T_l * V, "s1": V, "g0": T_l * V, "g1": V, "tau_stride": 1, "tau_value": 1.0}  # replay's rows, tau
    if name in table:
        return table[name]
    raise KeyError(f"aot: no stand-in for kernel parameter {name!r}; teach bench/aot/compiler.py its value")


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
    arch: object  # int (NVIDIA compute capability) or str (AMD target)
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
    block: int = 0  # BLOCK_V: elements of the row per main-loop iteration
    num_warps: int = 0
    shared: int = 0  # bytes of shared memory per block
    loop_instr: int = -1  # instructions in the main loop body
    elems_per_thread: int = 0  # elements each thread handles per iteration
    instr_per_elem: float = -1.0
    bar_per_iter: int = -1
    mufu_per_elem: float = -1.0
    ldg128_in_loop: int = 0
    warps_per_sm: int = 0
    loop_note: str = ""
    sass_text: str = ""  # filled in this process only (not through --json)
    provider: str = "gtpo_kernels"
    # "vocab": a pass over the row's V logits (per element: per logit); "replay": a pass over the kept
    # ids (replay_triton: per element: per kept id, every loop of the kernel summed, see sass.kept_loop_stats)
    family: str = "vocab"
    loops: list = dataclasses.field(default_factory=list)  # replay: [dict(instr, unroll, per_elem, ...)]
    other_instr: int = -1  # replay: instructions outside the loops (executed at most once per token)
    int64_offsets: bool = True  # replay: every offset added to the logits / gradient pointer is int64

    def problems(self):
        out = []
        if self.error:
            return [self.error]
        if self.spill_stores or self.spill_loads:
            out.append(f"spills {self.spill_stores}/{self.spill_loads} bytes")
        if not self.int64_offsets:
            out.append("an int32 offset into the logits or the gradient")
        if self.family == "replay" and (self.loop_note or len(self.loops) != (2 if "fwd" in self.kernel else 1)):
            out.append(f"kept-set loops not as expected ({len(self.loops)} found{'; ' if self.loop_note else ''}"
                       f"{self.loop_note})")
        if self.expect_vector and (self.ldg128 == 0 or self.narrow_ldg > self.scalar_loads):
            out.append(f"narrow logits loads (LDG.E.128: {self.ldg128}, narrow: {self.narrow_ldg}, "
                       f"scalar loads: {self.scalar_loads})")
        return out


def _target(arch):
    from triton.backends.compiler import GPUTarget
    return GPUTarget("hip", arch, 64) if isinstance(arch, str) else GPUTarget("cuda", arch, 32)


def _variant(has_e, transform):
    v = "" if has_e is None else ("HAS_E" if has_e else "no E")
    extra = ("+scale" if transform[0] else "") + ("+cap" if transform[1] else "")
    return (v or "-") + extra if extra else v


def compile_kernel(kernel, dtype, arch, V=V_REAL, T=T_REAL, has_e=None, expect_vector=True, peer=None,
                   block=None, warps=None, transform=(False, False)) -> AotResult:
    """One kernel compiled and counted. `peer` (another project's kernel, see peers.py): a dict with
    provider, variant, kwargs (every parameter by name, constexprs included, as its launcher passes them),
    block, num_warps and num_stages. block / warps: another launch configuration of ours (bench.tune).
    transform: (HAS_SCALE, HAS_SOFTCAP) of our kernels (the default path: neither). arch: an int (NVIDIA,
    counted on the SASS) or an AMD target such as "gfx942" (counted by amd.py)."""
    import triton
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from gtpo_kernels.kernels import vocab_triton as vt

    name = kernel.fn.__name__
    variant = _variant(has_e, transform) if peer is None else peer["variant"]
    amd = isinstance(arch, str)
    replay = peer is None and any(p.name == "BLOCK_K" for p in kernel.params)
    res = AotResult(name, variant, str(dtype).replace("torch.", ""), arch, V, ok=False,
                    expect_vector=expect_vector and not amd and not replay, family="replay" if replay else "vocab")
    try:
        target = _target(arch)
        backend = make_backend(target)
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        if replay:  # replay_triton's launch: BLOCK_K, and Triton's default warps and stages (it passes none)
            from gtpo_kernels.kernels import replay_triton as rt
            bv = block or rt.BLOCK_K
            meta = {"BLOCK_K": bv, **({"num_warps": warps} if warps else {})}
        elif peer is None:
            bv = block or vt.fwd_block_v(V) if kernel is vt._vocab_fwd_kernel else block or vt.block_v_for(V)
            meta = {"BLOCK_V": bv, "num_warps": warps or vt.num_warps_for(bv)}
            if not any(p.name == "BLOCK_V" for p in kernel.params):  # the vocabulary-parallel merge: no block
                meta = {"num_warps": warps or 1}
        if peer is None:
            if has_e is not None:
                meta["HAS_E"] = has_e
            if any(p.name == "HAS_SOFTCAP" for p in kernel.params):
                meta["HAS_SCALE"], meta["HAS_SOFTCAP"] = transform
            args = {p.name: _arg_for(p.name, dtype, V, T, has_e) for p in kernel.params if not p.is_constexpr}
            names = {p.name for p in kernel.params}
            if "TEMP_BY_VALUE" in names:  # the call's variant: tau by value, the upstream gradient read by pointer
                meta["TEMP_BY_VALUE"], args["temp_ptr"] = True, 0.7
            if "HAS_G" in names:
                meta["HAS_G"] = True
            if "TAU_PTR" in names:  # replay: a temperature per token, read
                meta["TAU_PTR"] = True
            bound, spec, opts = binder(**args, **meta)
        else:
            res.provider = peer["provider"]
            bv = peer["block"]
            meta = {"num_warps": peer["num_warps"], "num_stages": peer["num_stages"]}
            kw = dict(peer["kwargs"])
            meta.update({p.name: kw[p.name] for p in kernel.params if p.is_constexpr and p.name in kw})
            bound, spec, opts = binder(**kw, num_warps=meta["num_warps"], num_stages=meta["num_stages"])
        options, sig, constexprs, attrs = kernel._pack_args(backend, meta, bound, spec, opts)
        ck = triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=target, options=options.__dict__)
        res.block, res.num_warps, res.shared = bv, ck.metadata.num_warps, int(getattr(ck.metadata, "shared", 0))
        if amd:
            from . import amd
            amd.count(res, ck.asm["amdgcn"], bv, res.num_warps, dtype.itemsize)
            res.sass_text = ck.asm["amdgcn"]
        else:
            _count_nvidia(res, ck, arch, dtype)
        elem = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}[dtype]
        tensor_loads = [ln for ln in ck.asm["ttir"].splitlines() if "tt.load" in ln and "tensor<" in ln]
        ptrs = (f"!tt.ptr<{elem}>", "!tt.ptr<i64>") if replay else (f"!tt.ptr<{elem}>",)  # replay: + the kept ids
        if peer is None and any(not any(p in ln for p in ptrs) for ln in tensor_loads):
            res.error = "a tensor-shaped load that is not of the logits: the check's premise no longer holds"
        if replay:
            res.int64_offsets = int64_offsets(ck.asm["ttir"])
    except Exception as e:  # a compile error is a result
        res.error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:300]
    res.ok = not res.problems()
    return res


def int64_offsets(ttir):
    """Whether every offset added in the TTIR to the logits or the gradient pointer, or to a pointer made
    from them (splat, broadcast, addptr), is int64: the row's element offset and the kept ids."""
    derived, rows = {"%logits_ptr", "%grad_ptr"}, []
    for ln in ttir.splitlines():  # SSA in program order: a pointer is defined before it is used
        m = re.match(r"\s*(%\S+) = tt\.(splat|broadcast|addptr) (%[^ ,:]+)", ln)
        if m and m.group(3) in derived:
            derived.add(m.group(1))
            if m.group(2) == "addptr":
                rows.append(ln)
    return bool(rows) and all(re.search(r", (?:tensor<[\dx]+xi64>|i64)(?: loc|$)", ln.rstrip()) for ln in rows)


def _count_nvidia(res, ck, arch, dtype):
    """ptxas -v (registers, spills) and cuobjdump's SASS (loads, the main loop) of a CUDA compile."""
    ptx, cubin, ttir = ck.asm["ptx"], ck.asm["cubin"], ck.asm["ttir"]
    gpu = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1).rstrip(",")
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "k.ptx"), "w") as f:
            f.write(ptx)
        with open(os.path.join(d, "k.cubin"), "wb") as f:
            f.write(cubin)
        ptxas = _bin("ptxas-blackwell" if arch >= 100 else "ptxas")
        info = subprocess.run([ptxas, "-v", f"--gpu-name={gpu}", os.path.join(d, "k.ptx"), "-o",
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
    if res.family == "replay":
        res.loops, res.instr_per_elem, res.mufu_per_elem, res.bar_per_iter, res.loop_note = kept_loop_stats(
            sass, res.block, res.num_warps, dtype.itemsize)
        res.elems_per_thread = max(1, res.block // (32 * res.num_warps))
        res.loop_instr = sum(x["instr"] for x in res.loops)
        res.other_instr = len([1 for _, t in sass_instructions(sass) if not t.startswith("NOP")]) - res.loop_instr
    else:
        (res.loop_instr, res.elems_per_thread, res.instr_per_elem, res.bar_per_iter, res.mufu_per_elem,
         res.ldg128_in_loop, res.loop_note) = loop_stats(sass, res.block, res.num_warps, dtype.itemsize)
    res.warps_per_sm = warps_per_sm(res.registers, res.num_warps, res.shared, arch)
    res.sass_text = sass


KERNELS = ("vocab", "replay")  # the families `report` compiles (AotResult.family)


def report(archs=ARCHS, dtypes=DTYPES, odd_v=True, transforms=False, kernels=KERNELS, elsewhere=None):
    """Every kernel variant x dtype x arch at V_REAL (elsewhere: the dtypes compiled on the archs after the
    first, sm_90, when not all of `dtypes`; the test suite's ci profile compiles bfloat16 there), plus
    (informational, `expect_vector=False`) the forward in bfloat16 at V = 50257, whose odd row stride allows no 16-byte load; with `transforms`,
    each kernel variant with scale != 1 and with the soft-cap, bf16, every arch (variant '+scale', '+cap').
    kernels: "vocab" (the vocabulary passes) and / or "replay" (the kept-set passes of replay_triton, on the
    NVIDIA targets only: their loops are counted on the SASS)."""
    from gtpo_kernels.kernels import replay_triton as rt
    from gtpo_kernels.kernels import vocab_triton as vt
    out = []
    for arch in archs:
        for dt in dtypes_on(arch, archs, dtypes, elsewhere):
            if "vocab" in kernels:
                out.append(compile_kernel(vt._vocab_fwd_kernel, dt, arch))
                for has_e in (False, True):
                    out.append(compile_kernel(vt._vocab_bwd_kernel, dt, arch, has_e=has_e))
            if "replay" in kernels and not isinstance(arch, str):
                out.append(compile_kernel(rt._replay_fwd_kernel, dt, arch))
                for has_e in (False, True):
                    out.append(compile_kernel(rt._replay_bwd_kernel, dt, arch, has_e=has_e))
    if odd_v and "vocab" in kernels:
        out.append(compile_kernel(vt._vocab_fwd_kernel, torch.bfloat16, archs[0], V=50257, expect_vector=False))
    for arch in archs if transforms and "vocab" in kernels else ():
        for tr in ((True, False), (False, True)):
            out.append(compile_kernel(vt._vocab_fwd_kernel, torch.bfloat16, arch, transform=tr))
            for has_e in (False, True):
                out.append(compile_kernel(vt._vocab_bwd_kernel, torch.bfloat16, arch, has_e=has_e, transform=tr))
    return out


def dtypes_on(arch, archs=ARCHS, dtypes=DTYPES, elsewhere=None):
    """The dtypes `report` compiles for `arch`: all of `dtypes` on the first arch, `elsewhere` (if given)
    on the others."""
    return dtypes if elsewhere is None or arch == archs[0] else tuple(elsewhere)


def report_in_subprocess(timeout=600, kernels=KERNELS, elsewhere=None):
    """The report from a child process without TRITON_INTERPRET (this process's kernels may be the
    interpreter's, which cannot be compiled). Returns AotResult objects. elsewhere: as `report`'s."""
    import json
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    more = [] if elsewhere is None else ["--dtypes-elsewhere", ",".join(str(d).replace("torch.", "")
                                                                         for d in elsewhere)]
    p = subprocess.run([sys.executable, "-m", "bench.aot", "--json", "--kernels", ",".join(kernels), *more],
                       env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    try:
        return [AotResult(**d) for d in json.loads(p.stdout.strip().splitlines()[-1])]
    except Exception:
        raise RuntimeError(f"AOT child failed: {p.stderr[-2000:]}")


def _compile_ahead(k, arch, dtypes, default, scal, meta):
    """Triton's compiled kernel `k` for `arch` (an NVIDIA capability, or an AMD target): its pointers of
    the dtypes `dtypes` (by name; others `default`), the scalars `scal` and the constexprs `meta`."""
    import triton
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    ptr = {p.name: _Ptr(dtypes.get(p.name, default)) for p in k.params
           if not p.is_constexpr and p.name not in scal}
    target = _target(arch)
    backend = make_backend(target)
    bound, spec, opts = create_function_from_signature(k.signature, k.params, backend)(**ptr, **scal, **meta)
    options, sig, constexprs, attrs = k._pack_args(backend, meta, bound, spec, opts)
    return triton.compile(ASTSource(k, sig, constexprs, attrs), target=target, options=options.__dict__)


def compile_epilogue(arch, **switches):
    """kernels/epilogue_triton.py compiled for `arch` (an NVIDIA capability, or an AMD target) with the
    given switches (the rest on: every term of the kernel compiled); returns Triton's compiled kernel.
    What the interpreter cannot see (a loop-carried type that changes, a global that differs between
    inner functions) fails here."""
    from gtpo_kernels.kernels.epilogue_triton import _epilogue_kernel as k
    scal = dict(B=64, T=512, N=32768, max_seqlen=-1, g_lo=0, g_hi=64, lo=0.8, hi=1.2, delta=1.5, dual_c=3.0,
                beta=0.04, ent_coef=0.01, penalty=0.1, thr=0.69, max_len_cfg=0.0, nitems_val=1.0, sapo_pos=1.0,
                sapo_neg=1.05, dro_beta=0.1, off_thr=0.01, top_q=0.8, k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0,
                cov_lb=1.0, cov_ub=5.0, kl_coef=0.1, ratio_bits=4551510721646314285)  # (the bits of 2e-4)
    meta = dict(PACKED=False, HAS_MASK=True, HAS_OLD=True, HAS_KL=True, BIAS_KL=True, HAS_LAM=True, HAS_NCONF=True,
                NITEMS=0, CLIP=True, HAS_DELTA=True, HAS_DUAL=True, HAS_E=True, FILTER=True, PENALTY=True, SEQ=False,
                AGG=0, BLOCK=1024, VALIDATE=True, MASK_VALUES=True, HAS_REF=True, HAS_ROLL=True, num_warps=4)
    meta.update(switches)
    return _compile_ahead(k, arch, {"bad_ptr": torch.int8, "mask_ptr": torch.bool, "cu_ptr": torch.int64,
                                    "kept_out": torch.uint8, "cu_fix": torch.int64, "status_ptr": torch.int32,
                                    "draws_ptr": torch.float64, "key_ptr": torch.float64, "cval_ptr": torch.float64,
                                    "cidx_ptr": torch.int64},
                          torch.float32, scal, meta)


def compile_kept_rule(arch, **switches):
    """kernels/kept_rule_triton.py's kernel of the sampler's kept sets compiled for `arch` (as compile_epilogue;
    by default every rule read per token)."""
    from gtpo_kernels.kernels.kept_rule_triton import _kept_rule_kernel as k
    meta = dict(TOP_K=2, TOP_P=2, MIN_P=2, HAS_MASK=True, TEMP_BY_VALUE=False, BLOCK_V=2048, STATS=True, num_warps=4)
    meta.update(switches)
    scal = dict(stride_lb=512 * 151936, stride_lt=151936, T=512, V=151936, logits_start=0, temp_stride=1,
                k_stride=1, k_val=50, p_stride=1, p_val=0.9, mp_stride=1, mp_val=0.05)
    if meta["TEMP_BY_VALUE"]:
        scal["temp_ptr"] = 0.7
    return _compile_ahead(k, arch, {"logits_ptr": torch.bfloat16, "ids_ptr": torch.int64, "mask_ptr": torch.bool,
                                    "tid_ptr": torch.int64, "k_ptr": torch.int64}, torch.float32, scal, meta)


def compile_vocab_keep(arch, backward=False, **switches):
    """The forward (or backward) vocabulary kernel with KEEP (each token's kept set as a threshold) compiled
    for `arch`, bf16 logits, tau by value."""
    from gtpo_kernels.kernels import vocab_triton as vt
    k = vt._vocab_bwd_kernel if backward else vt._vocab_fwd_kernel
    V = 151936
    scal = dict(stride_lb=512 * V, stride_lt=V, T=512, V=V, logits_start=0, temp_ptr=0.7, temp_stride=0, scale=1.0,
                softcap=1.0)
    if backward:
        scal.update(stride_gb=512 * V, stride_gt=V, T_l=512, g_stride=0, id_start=0)
        meta = dict(HAS_E=True, HAS_SCALE=False, HAS_SOFTCAP=False, BLOCK_V=2048, TEMP_BY_VALUE=True, HAS_G=True,
                    KEEP=True, num_warps=4)
    else:
        scal.update(NB=1, n_seq=0, max_seqlen=-1, id_start=0)
        meta = dict(HAS_SCALE=False, HAS_SOFTCAP=False, BLOCK_V=vt.fwd_block_v(V), TEMP_BY_VALUE=True, KEEP=True,
                    num_warps=4)
    meta.update(switches)
    return _compile_ahead(k, arch, {"logits_ptr": torch.bfloat16, "grad_ptr": torch.bfloat16, "ids_ptr": torch.int64,
                                    "mask_ptr": torch.bool, "bad_ptr": torch.int8, "keep_id_ptr": torch.int64,
                                    "rows_ptr": torch.int64, "status_ptr": torch.int32, "work_ptr": torch.int64,
                                    "cu_ptr": torch.int64}, torch.float32, scal, meta)


def compile_conflict_weights(arch, **switches):
    """kernels/conflict_triton.py's conflict-weights kernel compiled for `arch` (as compile_epilogue)."""
    from gtpo_kernels.kernels.conflict_triton import _conflict_weights_kernel as k
    meta = dict(PACKED=True, HAS_MASK=True, BLOCK_G=8, BLOCK_T=128, num_warps=4)
    meta.update(switches)
    return _compile_ahead(k, arch, {"ids_ptr": torch.int64, "mask_ptr": torch.bool, "cu_ptr": torch.int32},
                          torch.float32, dict(B=64, T=512, N=32768, G=8, w_pos=2.0, w_neg=0.0), meta)
