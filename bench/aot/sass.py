"""Reading the SASS of a compiled kernel, and the static model built on it: the main vocabulary loop
and its counts (instructions, loads, barriers, MUFU per element), occupancy from registers and shared
memory (`SM_LIMITS`), and the roofline estimate per device (`DEVICES`). Used by compiler.py.

Method of the loop count. cuobjdump prints one instruction per address; the main loop is the body of the
backward branch (`BRA` to a lower address, not a self-branch) whose body holds a global load (LDG) and,
of those, the longest. Its instructions (NOPs excluded, every path of a branch inside the body counted)
are executed once per iteration by every thread, and one iteration covers BLOCK_V elements of the row
over 32 * num_warps threads, so

    instr_per_elem = body instructions / (BLOCK_V / (32 * num_warps))

(BLOCK_V = 4096, 8 warps: 16 elements per thread per iteration). The elements per thread are checked
against the bytes the body's LDGs load (a loop that ptxas unrolled or split would show as a mismatch,
reported in `loop_note`). Work outside the loop (once per row of 151936 elements) is not counted.

The kept-set replay kernels (`find_loops`, `kept_loop_stats`) have one or two loops over the kept ids,
which ptxas unrolls: each is counted per kept element, its unroll read off the bytes its body loads.
"""
from __future__ import annotations

import re

ARCHS = (90, 80, 100, "gfx942")  # an int: NVIDIA's compute capability; a str: an AMD target
V_REAL = 151936  # all of 32000, 128256, 151936, 262144 get the same specialization and BLOCK_V

# Limits per SM used for the occupancy (CUDA programming guide, compute capability 9.0 / 8.0):
# 32-bit registers, registers allocated per warp in units of 256, the most warps and blocks, shared memory
# per SM and the 1 KiB the driver reserves per block.
SM_LIMITS = {
    90: dict(regs=65536, reg_unit=256, max_warps=64, max_blocks=32, smem=228 * 1024, smem_per_block=1024),
    80: dict(regs=65536, reg_unit=256, max_warps=64, max_blocks=32, smem=164 * 1024, smem_per_block=1024),
    100: dict(regs=65536, reg_unit=256, max_warps=64, max_blocks=32, smem=228 * 1024, smem_per_block=1024),
}

# The roofline's devices, each estimated from the counts of its architecture (`arch`). bw: achievable
# device-to-device copy bandwidth in bytes/s counting bytes read plus written; clock: the sustained clock
# under load; issue: warp instructions issued per clock per SM (4 schedulers, 1 each); mufu: MUFU
# results (ex2, lg2, rcp) per clock per SM (16, programming guide throughput table for 8.0 and 9.0).
# `basis` says where the numbers come from:
# - H100 SXM, H200 (GH100, sm_90): spec section 8's 4.3 TB/s for an H200; an H100 SXM (3.35 TB/s HBM3
#   peak) about 3.0 TB/s the same way; 1.755 GHz sustained (max boost 1.98 GHz: a lower clock is the
#   cautious side for the issue and MUFU times).
# - A100 SXM (GA100, sm_80): datasheet figures, not a measurement: 2.04 TB/s HBM2e peak, taken as
#   ~1.9 TB/s of copy; 108 SMs; 1.41 GHz boost clock.
# - B200 (sm_100): datasheet figures and assumptions, not a measurement: 8 TB/s HBM3e peak, taken as
#   ~7 TB/s of copy; 148 SMs; the clock assumed as GH100's 1.755 GHz and the issue / MUFU rates as
#   sm_90's (no published per-SM table used here).
# - gfx942 (MI300X): no entry; its issue model (wave64 on SIMD16) and copy bandwidth are not
#   established here, so no estimate is made.
DEVICES = {
    "H100 SXM": dict(arch=90, sms=132, clock=1.755e9, bw=3.0e12, issue=4, mufu=16, basis="estimate from the 3.35 TB/s peak"),
    "H200": dict(arch=90, sms=132, clock=1.755e9, bw=4.3e12, issue=4, mufu=16, basis="spec 8"),
    "A100 SXM": dict(arch=80, sms=108, clock=1.41e9, bw=1.9e12, issue=4, mufu=16, basis="datasheet"),
    "B200": dict(arch=100, sms=148, clock=1.755e9, bw=7.0e12, issue=4, mufu=16, basis="datasheet + assumed"),
}
ROOF_N, ROOF_V = 16384, 151936  # roofline problem: N counted tokens (every row carries a gradient)


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


_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def sass_instructions(sass):
    """[(address, text)] of the SASS listing, encodings and blank lines dropped."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(_SASS_LINE.match, sass.splitlines()) if m]


def _opcode(text):
    t = re.sub(r"^@!?U?P\w+\s+", "", text)  # predicate guard
    return t.split()[0] if t.split() else ""


def find_main_loop(sass, outer=False):
    """The main vocabulary loop: the longest innermost backward-branch body holding a global load (the
    forward kernel's loop over the kernel blocks of one VOCAB_BLOCK block sits inside the loop over the
    vocabulary blocks); outer=True: the longest such body, nested loops included. Returns the body's
    [(address, text)] (first to the branch, inclusive) or None."""
    ins = sass_instructions(sass)
    loops = _backward_branches(ins)
    best = None
    for addr, target in loops:
        if not outer and any(target <= t2 and a2 < addr for a2, t2 in loops if (a2, t2) != (addr, target)):
            continue  # another loop inside this one
        body = [(a, t) for a, t in ins if target <= a <= addr and _opcode(t) != "NOP"]
        if any(_opcode(t).startswith("LDG") for _, t in body) and (best is None or len(body) > len(best)):
            best = body
    return best


_BRA = re.compile(r"\bBRA(?:\.U)?\s+(?:!?U?P\w+\s*,\s*)?(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)")


def _backward_branches(ins):
    """[(address, target)] of the branches to a lower address (the final self-branch excluded)."""
    out = []
    for addr, text in ins:
        m = _BRA.search(text)
        if m and _opcode(text).startswith("BRA") and int(m.group(1), 16) < addr:
            out.append((addr, int(m.group(1), 16)))
    return out


def find_loops(sass):
    """Every loop holding a global load, by address: [body] as find_main_loop's, nested or overlapping
    bodies dropped in favour of the longer one."""
    ins = sass_instructions(sass)
    spans = []
    for addr, target in _backward_branches(ins):
        body = [(a, t) for a, t in ins if target <= a <= addr and _opcode(t) != "NOP"]
        if any(_opcode(t).startswith("LDG") for _, t in body):
            spans.append(body)
    kept = []
    for body in sorted(spans, key=len, reverse=True):
        lo, hi = body[0][0], body[-1][0]
        if all(hi < k[0][0] or lo > k[-1][0] for k in kept):
            kept.append(body)
    return sorted(kept, key=lambda b: b[0][0])


def kept_loop_stats(sass, block, num_warps, elem_bytes, id_bytes=8):
    """Counts over the loops of a kept-set kernel (replay_triton: each iteration reads BLOCK_K kept ids
    and gathers their logits; the forward has two such passes, the backward one). ptxas unrolls these
    loops (by 4 on sm_80 / sm_90 / sm_100), so the elements a body handles are counted from its loads:
    every kept element is one id (id_bytes) and one logit (elem_bytes) a thread, so

        unroll = body bytes loaded / (elements per thread x (id_bytes + elem_bytes))

    must be a whole number (else `note` says so). Returns (loops: [dict(instr, unroll, per_elem, mufu, bar,
    stg)], instructions per kept element over all passes, MUFU per kept element, BAR per iteration, note)."""
    ept = max(1, block // (32 * num_warps))
    loops, note = [], ""
    bodies = find_loops(sass)
    for body in bodies:
        ops = [_opcode(t) for _, t in body]
        loaded = sum(_ldg_widths("\n".join(t for _, t in body if _opcode(t).startswith("LDG")))) // 8
        unroll, rest = divmod(loaded, ept * (id_bytes + elem_bytes))
        if rest or not unroll:
            note += (f"{'; ' if note else ''}a loop loads {loaded} bytes a thread, not a whole number of "
                     f"{ept} x ({id_bytes} + {elem_bytes})")
            unroll = max(unroll, 1)
        n = ept * unroll
        loops.append(dict(instr=len(ops), unroll=unroll, per_elem=len(ops) / n,
                          mufu=sum(o.startswith("MUFU") for o in ops) / n, bar=sum(o.startswith("BAR") for o in ops),
                          stg=sum(o.startswith("STG") for o in ops) / n))
    if not loops:
        return [], -1.0, -1.0, -1, "no loop with a global load found"
    inside = {a for body in bodies for a, _ in body}
    for addr, _ in _backward_branches(sass_instructions(sass)):  # would run code more than once per token
        if addr not in inside:
            note += f"{'; ' if note else ''}a loop without a global load at {addr:#x}"
    return (loops, sum(x["per_elem"] for x in loops), sum(x["mufu"] for x in loops), max(x["bar"] for x in loops),
            note)


def loop_stats(sass, block, num_warps, elem_bytes):
    """Counts over the main loop: (body instructions, elements per thread, instr/elem, BAR per iteration,
    MUFU per element, LDG.E.128 in the body, note)."""
    body = find_main_loop(sass)
    if body is None:
        return -1, 0, -1.0, -1, -1.0, 0, "no loop with a global load found"
    ops = [_opcode(t) for _, t in body]
    ept = max(1, block // (32 * num_warps))
    widths = _ldg_widths("\n".join(t for _, t in body if _opcode(t).startswith("LDG")))
    loaded = sum(widths) // 8
    note = ""
    if loaded != ept * elem_bytes:
        note = f"the body loads {loaded} bytes a thread, {ept} elements would be {ept * elem_bytes}"
    n_bar = sum(o.startswith("BAR") for o in ops)
    n_mufu = sum(o.startswith("MUFU") for o in ops)
    return (len(ops), ept, len(ops) / ept, n_bar, n_mufu / ept, sum(w == 128 for w in widths), note)


def warps_per_sm(regs, num_warps, shared, arch=90):
    """Resident warps per SM: blocks limited by registers (allocated per warp), shared memory, the block
    and warp limits."""
    lim = SM_LIMITS[arch]
    per_warp = -(-max(regs, 1) * 32 // lim["reg_unit"]) * lim["reg_unit"]
    by_regs = (lim["regs"] // per_warp) // num_warps
    by_smem = lim["smem"] // (shared + lim["smem_per_block"])
    blocks = min(by_regs, by_smem, lim["max_blocks"], lim["max_warps"] // num_warps)
    return blocks * num_warps


def roofline(r, device, n=ROOF_N, v=ROOF_V):
    """Estimated ms of one pass over n rows of v elements (of r.dtype) on `device` (a DEVICES key):
    memory = bytes / bw (forward reads the logits; backward reads them and writes the gradient),
    issue = loop warp instructions / (SMs * issue * clock), special function = MUFU ops / (SMs * mufu *
    clock); the estimate is the largest."""
    d = DEVICES[device]
    e = {"bfloat16": 2, "float16": 2, "float32": 4}[r.dtype]
    elems = n * v
    passes = 2 if "bwd" in r.kernel else 1
    mem = passes * elems * e / d["bw"]
    issue = elems * r.instr_per_elem / 32 / (d["sms"] * d["issue"] * d["clock"])
    mufu = elems * r.mufu_per_elem / (d["sms"] * d["mufu"] * d["clock"])
    parts = {"mem_ms": mem * 1e3, "issue_ms": issue * 1e3, "mufu_ms": mufu * 1e3}
    bound = max(parts, key=parts.get)
    return dict(parts, est_ms=parts[bound], bound=bound.replace("_ms", ""))


def clean_sass(sass):
    """The listing without the encoding comments and blank lines (half the size, same instructions)."""
    out = []
    for ln in sass.splitlines():
        ln = re.sub(r"\s*/\* 0x[0-9a-f]{16} \*/\s*$", "", ln)
        if ln.strip():
            out.append(ln.rstrip())
    return "\n".join(out) + "\n"


def arch_name(arch):
    return arch if isinstance(arch, str) else f"sm_{arch}"
