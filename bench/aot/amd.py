"""bench.aot's counts for AMD's gfx942 (MI300): the kernels compiled by the installed Triton's own HIP
backend (its bundled LLVM and linker: no ROCm, no GPU), counted on the AMDGCN assembly.

- registers: `.vgpr_count` (vector registers per lane; `.agpr_count` added when the kernel uses any),
  spills: the `.vgpr_spill_count` + `.sgpr_spill_count` of the code object's metadata and its
  private (scratch) segment in bytes, stored in AotResult.spill_stores / spill_loads respectively;
- the main loop: the body of the backward branch (`s_cbranch_*` / `s_branch`) to a label above it that
  LLVM marks as a loop header, holding a global or buffer load, the longest such; its instructions (`s_nop` excluded) per element a
  thread (a lane of the 64-wide wavefront) handles per iteration, BLOCK_V / (64 * num_warps);
- barriers: `s_barrier` in the body; transcendental operations (the MUFU of NVIDIA's count):
  v_exp / v_log / v_rcp / v_rsq / v_sqrt / v_sin / v_cos;
- 16-byte loads: `*_load_dwordx4` (counted into AotResult.ldg128, narrower ones into narrow_ldg);
- occupancy: the compiler's `; Occupancy:` (waves per SIMD) times the 4 SIMDs of a CDNA3 compute unit,
  reported as warps_per_sm (waves per CU).
The 16-byte-load check of NVIDIA is not applied (expect_vector=False): at 4 warps of 64 lanes a thread
holds 8 bytes of a bf16 half-block, so the widest possible load is 8 bytes; the widths are reported.
"""
from __future__ import annotations

import re

_TRANSCENDENTAL = ("v_exp_", "v_log_", "v_rcp_", "v_rsq_", "v_sqrt_", "v_sin_", "v_cos_")
_LOAD = re.compile(r"^(?:global|buffer)_load_(dwordx[234]|dword|ushort|short|ubyte|sbyte|"
                   r"d16_b16|d16_hi_b16)\b")
_WIDTH = {"dwordx4": 16, "dwordx3": 12, "dwordx2": 8, "dword": 4, "ushort": 2, "short": 2, "d16_b16": 2,
          "d16_hi_b16": 2, "ubyte": 1, "sbyte": 1}
SIMDS_PER_CU = 4


def instructions(asm):
    """[(loop header?, label or None, instruction text)] of the kernel's code, directives and comments
    dropped; a label line gives (whether LLVM marks it a loop header, label, None)."""
    out = []
    for ln in asm.splitlines():
        s = ln.split(";", 1)[0].strip()
        if not s:
            # LLVM may put a label's loop comment on the lines after it ("=>  This Inner Loop Header")
            if "Loop Header" in ln and out and out[-1][1] is not None and out[-1][2] is None:
                out[-1] = (True, out[-1][1], None)
            continue
        m = re.match(r"^(\.LBB\d+_\d+):", s)
        if m:
            out.append(("Loop Header" in ln, m.group(1), None))
        elif not s.startswith(".") and not s.endswith(":"):
            out.append((False, None, s))
    return out


def find_main_loop(asm):
    """The longest innermost loop body holding a vector memory load: a backward branch to a label LLVM marks
    as a loop header (a backward jump to another block is only layout); [instruction text] or None."""
    ins = instructions(asm)
    where = {lab: i for i, (head, lab, _) in enumerate(ins) if lab and head}
    loops = []
    for i, (_, _, text) in enumerate(ins):
        m = re.match(r"^s_(?:cbranch_\w+|branch)\s+(\.LBB\d+_\d+)", text or "")
        if m and where.get(m.group(1), i) < i:
            loops.append((where[m.group(1)], i))
    best = None
    for lo, hi in loops:
        if any(lo <= a and b < hi for a, b in loops if (a, b) != (lo, hi)):
            continue  # another loop inside this one: the innermost is the main loop (as sass.find_main_loop)
        body = [t for _, _, t in ins[lo:hi + 1] if t and not t.startswith("s_nop")]
        if any(_LOAD.match(t) for t in body) and (best is None or len(body) > len(best)):
            best = body
    return best


def _meta(asm, key, default=0):
    m = re.search(rf"^\s*\.{key}:\s+(\d+)", asm, re.M)
    return int(m.group(1)) if m else default


def count(res, asm, block, num_warps, elem_bytes):
    """Fills AotResult `res` from the AMDGCN assembly `asm`."""
    res.registers = _meta(asm, "vgpr_count") + _meta(asm, "agpr_count")
    res.spill_stores = _meta(asm, "vgpr_spill_count") + _meta(asm, "sgpr_spill_count")
    res.spill_loads = _meta(asm, "private_segment_fixed_size")
    widths = [_WIDTH[m.group(1)] for m in map(_LOAD.match, (t for _, _, t in instructions(asm) if t)) if m]
    res.ldg128 = sum(w == 16 for w in widths)
    res.narrow_ldg = sum(w < 16 for w in widths)
    occ = re.search(r"^; Occupancy:\s+(\d+)", asm, re.M)
    res.warps_per_sm = int(occ.group(1)) * SIMDS_PER_CU if occ else 0
    body = find_main_loop(asm)
    if body is None:
        res.loop_note = "no loop with a global load found"
        return res
    ept = max(1, block // (64 * num_warps))
    loaded = sum(_WIDTH[m.group(1)] for m in map(_LOAD.match, body) if m)
    if loaded != ept * elem_bytes:
        res.loop_note = f"the body loads {loaded} bytes a thread, {ept} elements would be {ept * elem_bytes}"
    res.loop_instr, res.elems_per_thread = len(body), ept
    res.instr_per_elem = len(body) / ept
    res.bar_per_iter = sum(t.startswith("s_barrier") for t in body)
    res.mufu_per_elem = sum(t.startswith(_TRANSCENDENTAL) for t in body) / ept
    res.ldg128_in_loop = sum(_WIDTH[m.group(1)] == 16 for m in map(_LOAD.match, body) if m)
    return res
