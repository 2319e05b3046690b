"""The kept-set replay kernels in the static report (gtpo_kernels/kernels/replay_triton.py): their records,
the file they go to and the table docs/benchmarks.md shows.

`python -m bench.aot` compiles `_replay_fwd_kernel` and `_replay_bwd_kernel` (no entropy term / with it)
as replay_triton launches them (BLOCK_K = 128 kept ids per iteration, Triton's default 4 warps and 3
stages: the launcher passes none; V not specialized) for sm_90, sm_80 and sm_100 (not gfx942: their loops
are counted on NVIDIA's SASS only) and counts, per kernel (compiler.py, sass.kept_loop_stats):
- registers and spill bytes (ptxas -v); warps per SM from the registers;
- instructions per kept element: each loop body's SASS instructions over the kept ids a thread handles
  per iteration (BLOCK_K / (32 x warps) = 1, times the unroll ptxas applied: 4), summed over the
  kernel's loops (the forward reads each set twice: pass 1 the maximum, pass 2 the sums; the backward
  once). The counts cover the loop ptxas unrolled, which runs while 4 or more blocks of 128 ids remain;
  smaller remainders run straight-line copies of the same body (counted in `other_instr`);
- `other_instr`: every instruction outside the loops (prologue, the remainder copies, the reductions
  across the 4 warps, the stores), each executed at most once per token: a bound on a token's work
  besides its loop iterations (a set of at most BLOCK_K x (unroll - 1) = 384 ids runs no loop iteration);
- whether every offset added to the logits and gradient pointers is int64 (on the TTIR).
The kept-set rebuild for top_k / top_p / min_p (kept_set.py) is PyTorch, not Triton: nothing to compile.

Records go to aot-replay.json beside aot-sm90.json (the SASS of the bf16 kernels under aot/); the table of
docs/benchmarks.md between `<!-- bench.aot:replay PATH -->` and `<!-- /bench.aot:replay -->` is rendered
from that file:

    python -m bench.aot --save --kernels replay    # bench/results/aot-replay.json (from a clean tree)
    python -m bench.aot.replay --write             # rewrite the docs table from it (no flag: check only)
"""
from __future__ import annotations

import json
import os
import re
import sys

from ..common import record
from .sass import DEVICES, arch_name, clean_sass

FILE = "aot-replay.json"
DOC = os.path.join(record.ROOT, "docs", "benchmarks.md")
BLOCK = re.compile(r"<!-- bench\.aot:replay (\S+) -->\n(.*?)<!-- /bench\.aot:replay -->", re.S)
ROOF_N = 16384  # tokens of the per-call bound (issue_bound_ms)


def _sass_name(r):
    v = {"no E": "-noE", "HAS_E": "-E"}.get(r.variant, "")
    return f"{r.kernel.strip('_')}{v}-{r.dtype}-{arch_name(r.arch).replace('_', '')}.sass"


def records(results):
    """One record per replay kernel variant x dtype x arch compiled (results of compiler.report)."""
    out = []
    for r in results:
        if r.family != "replay" or r.error:
            continue
        out.append(dict(kernel=r.kernel, variant=r.variant or "-", dtype=r.dtype, arch=arch_name(r.arch),
                        block_k=r.block, num_warps=r.num_warps, elems_per_thread=r.elems_per_thread,
                        loops=[{k: (round(v, 3) if isinstance(v, float) else v) for k, v in x.items()}
                               for x in r.loops],
                        instr_per_kept_elem=round(r.instr_per_elem, 3), mufu_per_kept_elem=round(r.mufu_per_elem, 3),
                        bar_per_iter=r.bar_per_iter, other_instr=r.other_instr, regs=r.registers,
                        spill_bytes=r.spill_stores + r.spill_loads, shared=r.shared, warps_per_sm=r.warps_per_sm,
                        int64_offsets=r.int64_offsets, ok=r.ok,
                        sass=os.path.join("aot", _sass_name(r)) if r.dtype == "bfloat16" else None))
    return out


def write(results, root, command="python -m bench.aot --save"):
    """aot-replay.json (stamped with the date, commit and Triton version) and the bf16 kernels' SASS under
    root/aot/; returns the path, or None when `results` holds no replay kernel."""
    recs = records(results)
    if not recs:
        return None
    record.require_clean(root)
    os.makedirs(os.path.join(root, "aot"), exist_ok=True)
    for r in results:
        if r.family == "replay" and r.dtype == "bfloat16" and r.sass_text:
            with open(os.path.join(root, "aot", _sass_name(r)), "w") as f:
                f.write(clean_sass(r.sass_text))
    for rec in recs:
        if rec["sass"]:
            rec["sass"] = os.path.relpath(os.path.join(root, rec["sass"]), record.ROOT)
    import datetime

    import triton
    doc = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               commit=record.commit(), versions=dict(triton=triton.__version__),
               command=command, rows=recs)
    path = os.path.join(root, FILE)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return path


def issue_bound_ms(rec, device="H200", n=ROOF_N):
    """A static bound, not a measurement: the ms of instruction issue of n tokens whose sets are too small
    for an iteration of the unrolled loops (`straight_ids`), each token's warps issuing at most every
    instruction outside the loops: n x warps x other_instr / (SMs x 4 x clock)."""
    d = DEVICES[device]
    return n * rec["num_warps"] * rec["other_instr"] / (d["sms"] * d["issue"] * d["clock"]) * 1e3


def straight_ids(rec):
    """The largest set whose every pass runs straight-line code only: an unrolled-by-u loop runs while u
    blocks of BLOCK_K ids remain."""
    return rec["block_k"] * (min(x["unroll"] for x in rec["loops"]) - 1)


def _markdown(head, rows):
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(c) + " |" for c in rows])


def render(doc, path):
    """The docs table: bf16, one row per architecture, forward and backward side by side."""
    rows, bounds = [], []
    by = {(r["arch"], r["kernel"], r["variant"]): r for r in doc["rows"] if r["dtype"] == "bfloat16"}
    for arch, device in (("sm_90", "H200"), ("sm_80", "A100 SXM"), ("sm_100", "B200")):
        f, n, e = (by.get((arch, k, v)) for k, v in (("_replay_fwd_kernel", "-"), ("_replay_bwd_kernel", "no E"),
                                                     ("_replay_bwd_kernel", "HAS_E")))
        if not (f and n and e):
            continue
        passes = " + ".join(f"{x['per_elem']:.2f}" for x in f["loops"])
        rows.append([f"{arch} ({device})", f"{f['instr_per_kept_elem']:.2f} ({passes}), {f['regs']}",
                     f"{n['instr_per_kept_elem']:.2f}, {n['regs']} / {e['instr_per_kept_elem']:.2f}, {e['regs']}",
                     str(sum(r["spill_bytes"] for r in (f, n, e))),
                     f"{f['warps_per_sm']} / {n['warps_per_sm']} / {e['warps_per_sm']}",
                     f"{f['other_instr']} / {n['other_instr']} / {e['other_instr']}",
                     "yes" if all(r["int64_offsets"] for r in (f, n, e)) else "**no**"])
        if arch == "sm_90":
            bounds = [issue_bound_ms(r) for r in (f, e)] + [min(straight_ids(r) for r in (f, n, e))]
    others = sorted({r["dtype"] for r in doc["rows"]} - {"bfloat16"})
    spill_all = sum(r["spill_bytes"] for r in doc["rows"])
    head = ["arch (device)", "forward instr / kept element (pass 1 + pass 2), regs",
            "backward instr / kept element, regs (no entropy / with)", "spilled bytes",
            "warps / SM (fwd / bwd / bwd with entropy)",
            "instructions outside the loops (fwd / bwd / bwd with entropy)", "int64 offsets into the logits"]
    out = [f"From `{path}` (`{doc.get('command', 'python -m bench.aot --save')}`: {doc['date'][:10]}, commit "
           f"{(doc.get('commit') or '?')[:7]}{'+dirty' if (doc.get('commit') or '').endswith('+dirty') else ''}, "
           f"Triton {doc.get('versions', {}).get('triton', '?')}), bf16, BLOCK_K = {doc['rows'][0]['block_k']}, "
           f"{doc['rows'][0]['num_warps']} warps:", "", _markdown(head, rows), ""]
    out.append(f"Spilled bytes over every dtype compiled (bf16{', ' + ', '.join(others) if others else ''}) and "
               f"architecture: {spill_all}.")
    if bounds:
        h = DEVICES["H200"]
        out.append(f"Static bound, not a measurement: {ROOF_N} tokens whose sets hold at most {bounds[2]} ids "
                   f"(no iteration of the unrolled loops runs) issue at most {bounds[0]:.3f} ms (forward) and "
                   f"{bounds[1]:.3f} ms (backward with entropy) of instructions on an H200 (every instruction "
                   f"outside the loops, each token's {doc['rows'][0]['num_warps']} warps, {h['sms']} SMs x "
                   f"{h['issue']} per clock at {h['clock'] / 1e9:.3f} GHz).")
    return "\n".join(out) + "\n"


def expected(path):
    full = os.path.join(record.ROOT, path)
    if not os.path.exists(full):
        return "Not compiled yet: `python -m bench.aot --save --kernels replay` writes this table's file.\n"
    with open(full) as f:
        return render(json.load(f), path)


def drift(text):
    """Problems of docs/benchmarks.md's replay table: missing, or not the rendering of its file."""
    blocks = BLOCK.findall(text)
    if not blocks:
        return ["docs/benchmarks.md: no <!-- bench.aot:replay ... --> table"]
    return [f"docs/benchmarks.md, bench.aot:replay: the table differs from {path} "
            f"(python -m bench.aot.replay --write rewrites it)" for path, body in blocks if body != expected(path)]


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(prog="python -m bench.aot.replay", description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the table of docs/benchmarks.md from its file")
    a = ap.parse_args(argv)
    with open(DOC) as f:
        text = f.read()
    if a.write:
        new = BLOCK.sub(lambda m: f"<!-- bench.aot:replay {m.group(1)} -->\n{expected(m.group(1))}"
                                  f"<!-- /bench.aot:replay -->", text)
        if new != text:
            with open(DOC, "w") as f:
                f.write(new)
        print(f"rewrote the replay table of {os.path.relpath(DOC, record.ROOT)}")
        return 0
    problems = drift(text)
    print("\n".join(problems) or "docs/benchmarks.md: the replay table matches its file")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
