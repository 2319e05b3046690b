"""The static GPU report's outputs: the per-kernel table, the JSON records with the roofline estimate
per device, the per-architecture rows the README renders, and the files written (JSON, SASS/AMDGCN)."""
from __future__ import annotations

import os

from ..common.record import RESULTS, ROOT, require_clean
from .sass import ARCHS, DEVICES, ROOF_N, ROOF_V, V_REAL, arch_name, clean_sass, roofline


def format_table(results):
    """One row per compiled kernel. spill: bytes stored / loaded (NVIDIA, ptxas -v); for gfx942 the
    VGPR + SGPR spill count / scratch bytes (amd.py); LDG.128: 16-byte loads (dwordx4 on AMD)."""
    lines = [f"{'kernel':<22} {'variant':<10} {'dtype':<9} {'arch':<6} {'V':>7} {'regs':>5} {'spill':>7} "
             f"{'LDG.128':>7} {'narrow':>6} {'instr/el':>8} {'BAR/it':>6} {'MUFU/el':>7} {'warps/SM':>8}  verdict"]
    for r in results:
        verdict = "ok" if r.ok else "FAIL: " + "; ".join(r.problems())
        if not r.expect_vector and not r.error and r.family == "vocab":
            verdict = ("info: odd V, no 16-byte alignment possible" if r.ldg128 == 0 else "info") + \
                ("" if r.ok else f" ({verdict})")
        if r.loop_note:
            verdict += f" [loop: {r.loop_note}]"
        if isinstance(r.arch, str) and not r.error:
            verdict = ("ok" if r.ok else verdict) + " (AMD: load widths informational)"
        if r.family == "replay" and not r.error:  # instr/el and MUFU/el: per kept id, every loop summed
            verdict += (" (per kept element: " + " + ".join(f"{x['instr']}/{x['unroll']}" for x in r.loops)
                        + f"; {r.other_instr} outside the loops)")
        lines.append(f"{r.kernel:<22} {r.variant:<10} {r.dtype:<9} {arch_name(r.arch):<6} {r.V:>7} {r.registers:>5} "
                     f"{r.spill_stores:>3}/{r.spill_loads:<3} {r.ldg128:>7} {r.narrow_ldg:>6} "
                     f"{r.instr_per_elem:>8.2f} {r.bar_per_iter:>6} {r.mufu_per_elem:>7.3f} {r.warps_per_sm:>8}"
                     f"  {verdict}")
    return "\n".join(lines)


def summary_line(results):
    """The report in one line: how many kernels compiled for which targets, how many pass the checks (no
    spill, 16-byte logits loads), and the sm_90 bf16 main loop's instructions per element."""
    archs = ", ".join(dict.fromkeys(arch_name(r.arch) for r in results))
    bad = [r for r in results if not r.ok]
    verdict = "all ok (no spill, 16-byte logits loads)" if not bad else \
        f"{len(bad)} FAILED ({', '.join(sorted({f'{r.kernel} {arch_name(r.arch)}' for r in bad}))})"
    head = {(r.kernel, r.variant): r for r in _headline(results)}
    loop = ", ".join(f"{'fwd' if 'fwd' in k else 'bwd'}{' ' + v if v else ''} {r.instr_per_elem:.2f}"
                     for (k, v), r in head.items())
    return (f"static GPU report (compiled ahead of time, no GPU used): {len(results)} kernels for {archs}: "
            f"{verdict}" + (f"; sm_90 bf16 instructions per logit element: {loop}" if loop else "")
            + ". Full report: python -m bench.aot")


def _headline(results, archs=(90,)):
    """The rows of the roofline: bf16, V = V_REAL, each kernel variant of the default path (no transform),
    on the given architectures."""
    return [r for r in results if r.arch in archs and r.dtype == "bfloat16" and r.V == V_REAL and not r.error
            and "+" not in r.variant and r.family == "vocab"]


def _kind(kernel):
    return "bwd" if "bwd" in kernel else "fwd"


def records(results):
    """One record per kernel variant and device of DEVICES, from the counts of the device's architecture
    (ours, then any peers'; aot-sm90.json holds the sm_90 ones, aot-archs.json all); a peer's record
    carries ours / theirs for the same pass (forward: our forward; backward: our backward without the
    entropy term, the peers have none)."""
    out = []
    for r in _headline(results, ARCHS):
        sass = os.path.join("aot", _sass_name(r))  # under the folder holding the JSON
        for dev in (d for d, c in DEVICES.items() if c["arch"] == r.arch):
            out.append(dict(provider=r.provider, kernel=r.kernel, variant=r.variant or "-", dtype=r.dtype,
                            arch=arch_name(r.arch), V=r.V, block=r.block, num_warps=r.num_warps,
                            elems_per_thread=r.elems_per_thread, loop_instr=r.loop_instr,
                            instr_per_elem=round(r.instr_per_elem, 3), bar_per_iter=r.bar_per_iter,
                            mufu_per_elem=round(r.mufu_per_elem, 4), regs=r.registers,
                            spill_bytes=r.spill_stores + r.spill_loads, ldg128=r.ldg128,
                            ldg128_in_loop=r.ldg128_in_loop, shared=r.shared, warps_per_sm=r.warps_per_sm,
                            device=dev, N=ROOF_N, roof_V=ROOF_V,
                            **{k: (round(v, 4) if isinstance(v, float) else v)
                               for k, v in roofline(r, dev).items()},
                            sass=sass))
    ours = {(c["device"], _kind(c["kernel"])): c for c in out
            if c["provider"] == "gtpo_kernels" and c["variant"] in ("-", "no E")}
    for c in out:
        o = ours.get((c["device"], _kind(c["kernel"])))
        if c["provider"] != "gtpo_kernels" and o is not None:
            c["ours"] = f"{o['kernel']} {o['variant']}".strip(" -")
            c["ours_over_theirs_est"] = round(o["est_ms"] / c["est_ms"], 3)
            c["ours_over_theirs_instr"] = round(o["instr_per_elem"] / c["instr_per_elem"], 3)
    return out


def format_roofline(recs):
    lines = [f"roofline: N={ROOF_N} V={ROOF_V} bf16; memory = bytes / bw, issue = instr / (SMs * 4 * clock), "
             f"MUFU = ops / (SMs * 16 * clock); " + "; ".join(
                 f"{k} ({arch_name(d['arch'])}): {d['sms']} SMs, {d['clock'] / 1e9:.3f} GHz, "
                 f"{d['bw'] / 1e12:.2f} TB/s [{d['basis']}]" for k, d in DEVICES.items())
             + "; gfx942: no estimate (constants not established)",
             f"{'provider':<13} {'kernel':<22} {'variant':<6} {'block':>5} {'warps':>5} {'instr/el':>8} "
             f"{'BAR/it':>6} {'regs':>4} {'device':<9} {'mem ms':>7} {'issue ms':>8} {'MUFU ms':>7} "
             f"{'est ms':>7}  bound  ours/theirs (est, instr)"]
    for c in recs:
        ratio = (f"  {c['ours_over_theirs_est']:.2f}, {c['ours_over_theirs_instr']:.2f} ({c['ours']})"
                 if "ours" in c else "")
        lines.append(f"{c['provider']:<13} {c['kernel']:<22} {c['variant']:<6} {c['block']:>5} "
                     f"{c['num_warps']:>5} {c['instr_per_elem']:>8.2f} {c['bar_per_iter']:>6} {c['regs']:>4} "
                     f"{c['device']:<9} {c['mem_ms']:>7.3f} {c['issue_ms']:>8.3f} {c['mufu_ms']:>7.3f} "
                     f"{c['est_ms']:>7.3f}  {c['bound']:<5}{ratio}")
    return "\n".join(lines)


def _sass_name(r):
    v = {"": "", "-": "", "no E": "-noE", "HAS_E": "-E"}.get(r.variant, "-" + r.variant.replace(" ", ""))
    who = "" if r.provider == "gtpo_kernels" else r.provider + "-"
    ext = "amdgcn" if isinstance(r.arch, str) else "sass"
    return f"{who}{r.kernel.strip('_')}{v}-{r.dtype}-{arch_name(r.arch).replace('_', '')}.{ext}"


def write_results(results, root=RESULTS, command="python -m bench.aot --save"):
    """aot-sm90.json (the sm_90 records, ours and the peers'), aot-archs.json (every architecture's) and
    the headline kernels' SASS (AMDGCN for gfx942) under bench/results/aot/, when `results` holds the
    vocabulary kernels; aot-replay.json and its SASS (replay.write) when it holds the replay kernels.
    Returns the vocabulary records."""
    import json

    from . import replay
    require_clean(root)
    replay.write(results, root, command)
    if not any(r.family == "vocab" for r in results):
        return []
    os.makedirs(os.path.join(root, "aot"), exist_ok=True)
    for r in _headline(results, ARCHS):
        if r.sass_text:
            with open(os.path.join(root, "aot", _sass_name(r)), "w") as f:
                f.write(clean_sass(r.sass_text))
    recs = records(results)
    for rec in recs:  # the SASS path as written, from the repository's root (bench/results/aot/... with --save)
        rec["sass"] = os.path.relpath(os.path.join(root, rec["sass"]), ROOT)
    for name, keep in (("aot-sm90.json", [c for c in recs if c["arch"] == "sm_90"]),
                       ("aot-archs.json", recs + arch_rows(results))):
        with open(os.path.join(root, name), "w") as f:
            json.dump(keep, f, indent=1)
            f.write("\n")
    return recs


def arch_rows(results):
    """The architectures without a device in DEVICES (gfx942): their counts, no estimate."""
    known = {c["arch"] for c in DEVICES.values()}
    return [dict(provider=r.provider, kernel=r.kernel, variant=r.variant or "-", dtype=r.dtype,
                 arch=arch_name(r.arch), V=r.V, block=r.block, num_warps=r.num_warps,
                 elems_per_thread=r.elems_per_thread, loop_instr=r.loop_instr,
                 instr_per_elem=round(r.instr_per_elem, 3), bar_per_iter=r.bar_per_iter,
                 mufu_per_elem=round(r.mufu_per_elem, 4), regs=r.registers, spill=[r.spill_stores, r.spill_loads],
                 warps_per_sm=r.warps_per_sm, device=None, est_ms=None,
                 estimate="none: the device's constants are not established here",
                 sass=os.path.join("aot", _sass_name(r)))
            for r in _headline(results, ARCHS) if r.arch not in known]
