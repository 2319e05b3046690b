"""The measured figures of README.md and docs/*.md, rendered from the committed JSON under bench/results/.

Each table or sentence of measured figures sits between two markers that name its JSON:

    <!-- bench:logits bench/results/latest-cpu.json -->
    ...the table, as its renderer writes it from that file...
    <!-- /bench:logits -->

`tests/test_readme_numbers.py` fails when a table and its JSON disagree (drift), when a JSON a table
names is missing, or when a table is not rendered from its file. A table whose JSON has not been measured
yet holds one line, PLACEHOLDER, instead.

    python -m bench.readme_numbers                # check: exit 1 and say which table drifted
    python -m bench.readme_numbers --write        # rewrite the tables of README.md and docs/ from the JSON
    python -m bench.readme_numbers --run          # measure every table's JSON (--save), then --write
    python -m bench.readme_numbers --run --out bench/results/loaded   # measure into another folder only

--run runs, one after the other (about 10 minutes on an idle 2-core CPU):
    python -m bench --suite logits --no-aot --save                                  # bench:logits
    python -m bench --suite linear --linear-size 4096,1024,32000 --threads 2 --save # bench:linear
    python -m bench --suite parallel --save                                         # bench:parallel
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

from .readme_gpu import RENDER as GPU_RENDER

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
NOT_RENDERED = {"GTPO_SPEC.md"}  # the specification: no measured figures
PLACEHOLDER = "Not measured yet: `python -m bench.readme_numbers --run` writes this table."
BLOCK = re.compile(r"<!-- bench:(\w+) (\S+) -->\n(.*?)<!-- /bench:\1 -->", re.S)
COMMANDS = {
    "logits": ["--suite", "logits", "--no-aot"],
    "linear": ["--suite", "linear", "--linear-size", "4096,1024,32000", "--threads", "2"],
    "parallel": ["--suite", "parallel"],
}


def _mib(b):
    return f"{b / 2**20:,.0f} MiB" if b >= 2**20 else f"{b / 2**10:,.0f} KiB"


def _range(med, lo_hi, fmt="{:.1f}"):
    return fmt.format(med) + (f" ({fmt.format(lo_hi[0])}-{fmt.format(lo_hi[1])})" if lo_hi else "")


def _ratio(v, load=None):
    """ratio_cell of a per-round summary, its '!' decided by bench.runner's rule when the JSON predates it."""
    from .timing.report import ratio_cell
    from .timing.runner import unreliable
    if isinstance(v, dict) and "unreliable" not in v:
        v = dict(v, spread=(v["max"] - v["min"]) / abs(v["median"]))
        v["unreliable"] = unreliable(v, load)
    return ratio_cell(v)


def load_of(doc):
    """The doc's `load` record; built from the older load_average_before/after fields when absent."""
    if doc.get("load") or "load_average_before" not in doc:
        return doc.get("load")
    from .timing.runner import load_record
    cores = doc.get("machine", {}).get("cpu_count") or 1
    return load_record(dict(load_average=doc["load_average_before"], cores=cores),
                       dict(load_average=doc["load_average_after"], cores=cores))


def provenance(doc, path):
    """One line: the file, its date, commit, machine and load."""
    m, load = doc.get("machine", {}), load_of(doc)
    where = f"{m.get('cpu', '?')}, {m.get('cpu_count', '?')} cores"
    if "gpu" in m:
        where = f"{m['gpu']}, {where}"
    if load:
        ld = (f"load average {load['before'][0]:.2f} before, {load['after'][0]:.2f} after"
              + (" (other work shared the machine: every ratio unreliable)" if load["loaded"] else ""))
    else:
        ld = "load not recorded"
    commit = (doc.get("commit") or "?")[:7] + ("+dirty" if (doc.get("commit") or "").endswith("+dirty") else "")
    rounds = f"{doc.get('repeats', '?')} rounds" + (", interleaved" if doc.get("timing") else "")
    return f"From `{path}`: {doc['date'][:10]}, commit {commit}, {where}, {ld}; {rounds}."


def _markdown(head, lines):
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(c) + " |" for c in lines])


def _footer(doc, lines):
    from .timing.runner import RULE
    flagged = any(c.endswith(" !") for row in lines for c in row)
    return ["", f"{doc.get('rule', RULE)}."] if flagged else []


def render_logits(doc, path):
    head = ["implementation", "tokens x V", "fwd+bwd ms (min-max)", "fwd ms (min-max)",
            "fwd+bwd vs eager (per round)", "peak above inputs", "saved for backward"]
    lines = []
    for r in doc["rows"]:
        if r["status"] != "ok" or "time_ms" not in r:
            continue
        rg = r.get("time_range_ms", {})
        lines.append([r["label"], f"{r['tokens']} x {r['V']}", _range(r["time_ms"]["full"], rg.get("full")),
                      _range(r["time_ms"]["fwd"], rg.get("fwd")) if "fwd" in r["time_ms"] else "-",
                      _ratio(r.get("vs_eager", {}).get("full"), load_of(doc)),
                      _mib(r["peak_bytes"]) if "peak_bytes" in r else "-",
                      f"{r['saved_bytes_per_token']:,.0f} B/token"])
    out = [provenance(doc, path), "", _markdown(head, lines)] + _footer(doc, lines)
    t = doc.get("traffic")
    if t:
        r = t["ratios"]
        out.append("")
        out.append(f"Bytes moved by the Triton kernels (counted in the interpreter at {t['tokens']} x {t['V']} "
                   f"{t['dtype']}) over the ideal: forward read {r['fwd_read']:.4f}, backward read "
                   f"{r['bwd_read']:.4f}, backward write {r['bwd_write']:.4f}.")
    return "\n".join(x for x in out if x is not None) + "\n"


def render_linear(doc, path):
    head = ["implementation", "N x D x V", "fwd+bwd s (min-max)", "time vs TRL (per round)",
            "peak above inputs and gradients", "peak vs TRL"]
    lines = []
    for r in doc["rows"]:
        if r["status"] != "ok" or not r.get("times_ms"):
            continue
        ts = [t / 1e3 for t in r["times_ms"]]
        v = r.get("vs_trl", {})
        v = v.get("full") if isinstance(v.get("full"), dict) else (  # before interleaved rounds were recorded
            dict(median=v["per_round_median"], min=v["per_round_min"], max=v["per_round_max"]) if v else None)
        lines.append([r["label"], f"{r['N']} x {r['D']} x {r['V']}",
                      _range(r["time_ms"]["full"] / 1e3, (min(ts), max(ts)), "{:.2f}"), _ratio(v, load_of(doc)),
                      _mib(r["peak_bytes"]) if "peak_bytes" in r else "-",
                      f"{r['peak_vs_trl']:.2f}x" if "peak_vs_trl" in r else "-"])
    out = [provenance(doc, path), "", _markdown(head, lines)] + _footer(doc, lines)
    return "\n".join(x for x in out if x is not None) + "\n"


def render_parallel(doc, path):
    b = doc["bytes"]
    bytes_rows = [[r["label"], f"{r['allgather_per_token']:,}", f"{r['ours_per_token']:.0f}", f"{r['ratio']:,.0f}x"]
                  for r in b["rows"]]
    time_rows = [[k, str(t["threads"]), _range(t["median"], (t["min"], t["max"]))] for k, t in doc["time"].items()]
    speed = "; ".join(f"{doc['world']} ranks over {k}: {_ratio(v)}" for k, v in doc["speedup_of_ranks_over"].items())
    out = [provenance(doc, path), "",
           _markdown(["logits", "all-gather bytes per token", "ours", "ratio"], bytes_rows), "",
           f"Plus one shape check of {b['shape_check_bytes_per_call']} bytes per call. Forward + backward, "
           f"{doc['tokens']} tokens x V = {doc['V']} {doc['dtype']}:", "",
           _markdown(["run", "threads per rank", "ms (min-max)"], time_rows), "",
           f"Speed-up per round: {speed}. The {doc['world']}-rank loss and gradient slices are within "
           f"{doc['max_rel_err']:.1e} of one process."] + _footer(doc, [[c] for c in speed.split("; ")])
    return "\n".join(x for x in out if x is not None) + "\n"


_DEVICE = {"sm_90": "H200", "sm_80": "A100 SXM", "sm_100": "B200", "gfx942": None}


def _aot_cell(r):
    unit = " VGPRs" if r["arch"].startswith("gfx") else ""
    return f"{r['instr_per_elem']:.2f}, {r['regs']}{unit}"


def _estimate(r):
    if r.get("est_ms") is None:
        return None
    return f"{r['est_ms']:.3f} {'memory' if r['bound'] == 'mem' else r['bound']}-bound"


def render_aot(doc, path):
    """Our vocabulary kernels per architecture (bench.aot --save's aot-archs.json), bf16."""
    ours = [r for r in doc if r["provider"] == "gtpo_kernels" and r["dtype"] == "bfloat16"]
    lines = []
    for arch, device in _DEVICE.items():
        rs = [r for r in ours if r["arch"] == arch and r.get("device") in (device, None)]
        if not rs:
            continue
        fwd = next(r for r in rs if r["kernel"] == "_vocab_fwd_kernel")
        no_e = next(r for r in rs if r["kernel"] == "_vocab_bwd_kernel" and r["variant"] == "no E")
        has_e = next(r for r in rs if r["kernel"] == "_vocab_bwd_kernel" and r["variant"] == "HAS_E")
        spills = sum(sum(r["spill"]) if "spill" in r else r["spill_bytes"] for r in (fwd, no_e, has_e))
        bars = max(r["bar_per_iter"] for r in (fwd, no_e, has_e))
        est = (f"{_estimate(fwd)} / {_estimate(no_e)}" if _estimate(fwd) else "no estimate")
        lines.append([f"{arch} ({device or 'MI300'})", _aot_cell(fwd), f"{_aot_cell(no_e)} / {_aot_cell(has_e)}",
                      str(spills), str(bars), est])
    head = ["arch (device)", "forward instr/elem, regs", "backward instr/elem, regs (no entropy / with)",
            "spilled bytes", "barriers / iteration", "estimate fwd / bwd ms (static model)"]
    out = f"From `{path}` (`python -m bench.aot --save`), bf16, V = 151936, N = 16384:\n\n" + _markdown(head, lines)
    peers = [r for r in doc if r["arch"] == "sm_90" and r.get("device") == "H200" and r["dtype"] == "bfloat16"]
    if any(r["provider"] != "gtpo_kernels" for r in peers):  # the installed peers' kernels, compiled the same way
        rows = [[f"{r['provider']} {r['kernel'].strip('_')}" + (f" ({r['variant']})" if r["variant"] != "-" else ""),
                 f"{r['instr_per_elem']:.2f}", str(r["regs"]), str(r["spill_bytes"]), f"{r['bar_per_iter']}",
                 str(r["warps_per_sm"]), _estimate(r)] for r in peers]
        out += "\n\nsm_90 against the peers' kernels (H200 estimate):\n\n" + _markdown(
            ["kernel", "instr/elem", "registers", "spilled bytes", "barriers / iteration", "warps / SM",
             "estimate ms (static model)"], rows)
    return out + "\n"


def render_head(doc, path):
    """The fused head's accounting (bench.head_accounting --save), each cell 'before -> after' against
    bench/results/head-accounting-before.json (the head before its rewrite) where that file exists."""
    from .head_accounting.table import markdown
    meta = doc["meta"]
    before_path = os.path.join(ROOT, "bench", "results", "head-accounting-before.json")
    before = json.load(open(before_path)) if os.path.exists(before_path) else None
    line = (f"From `{path}`: {meta['date'][:10]}, commit {meta['commit'][:7]}{'+dirty' if meta.get('dirty') else ''}"
            + (f"; 'a -> b' cells: before (commit {before['meta']['commit'][:7]}) -> now" if before else "") + ".")
    return line + "\n\n" + markdown(doc, before) + "\n"


def _short(doc):
    """date, commit, machine and load in a few words (for the one-sentence summaries)."""
    m, load = doc.get("machine", {}), load_of(doc)
    commit = (doc.get("commit") or "?")[:7] + ("+dirty" if (doc.get("commit") or "").endswith("+dirty") else "")
    ld = f", load average {load['before'][0]:.2f}" if load else ""
    return f"{doc['date'][:10]}, commit {commit}, {m.get('cpu', '?')}, {m.get('cpu_count', '?')} cores{ld}"


def render_logits_summary(doc, path):
    """One line: the largest logits size of the grid, our torch path against the eager loss, memory and
    saved bytes (what repeats from run to run), and the kernels' bytes over the ideal."""
    ok = [r for r in doc["rows"] if r["status"] == "ok" and "peak_bytes" in r]
    size = max(((r["tokens"], r["V"]) for r in ok), key=lambda x: x[0] * x[1])
    row = {r["impl"]: r for r in ok if (r["tokens"], r["V"]) == size}
    ours, eager = row["torch"], row["eager"]
    out = (f"- loss on logits, {size[0]} tokens x V = {size[1]} {doc['dtype']} on the CPU: peak memory above "
           f"the inputs {_mib(ours['peak_bytes'])} against {_mib(eager['peak_bytes'])} for the eager loss "
           f"(`log_softmax` in autograd), {ours['saved_bytes_per_token']:,.0f} bytes per token saved for "
           f"backward against {eager['saved_bytes_per_token']:,.0f}")
    t = doc.get("traffic")
    if t:
        r = t["ratios"]
        out += (f"; the Triton kernels move {r['fwd_read']:.4f} / {r['bwd_read']:.4f} / {r['bwd_write']:.4f} "
                f"times the ideal bytes (forward read / backward read / backward write, {t['tokens']} x {t['V']})")
    aot = "" if doc.get("aot") else " without its static GPU report (`--no-aot`)"
    return out + f"; printed by `python -m bench`, whose logits suite took {_took(doc)}{aot}" \
        f" (`{path}`: {_short(doc)});\n"


def _took(doc):
    """A suite's recorded wall time in words ('2.0 min')."""
    return f"{doc['wall_s'] / 60:.1f} min" if doc.get("wall_s") else "a time not recorded"


def render_linear_summary(doc, path):
    """One line: the fused head's peak memory against TRL's at the same tile budget."""
    row = {r["impl"]: r for r in doc["rows"] if r["status"] == "ok" and "peak_bytes" in r}
    fused, trl, mat = row.get("fused"), row.get("trl"), row.get("materialized")
    if not (fused and trl):
        return PLACEHOLDER + "\n"
    out = (f"- from hidden states, N x D x V = {fused['N']} x {fused['D']} x {fused['V']} {doc['dtype']}, both heads "
           f"with a {_mib(doc['tile_bytes'])} logits tile: `linear_gtpo_loss` peaks at {_mib(fused['peak_bytes'])} "
           f"above the inputs and gradients, TRL 1.16's chunked head at {_mib(trl['peak_bytes'])} "
           f"({fused['peak_vs_trl']:.2f}x)")
    if mat:
        out += f", the materialized logits at {_mib(mat['peak_bytes'])}"
    v = fused.get("vs_trl", {}).get("full")
    if isinstance(v, dict):  # a CPU time: quoted with its per-round range and its '!' when unreliable
        out += f"; forward + backward CPU time {_ratio(v, load_of(doc))} TRL's (per round)"
    from .__main__ import CPU_LINEAR
    point = f"{fused['N']},{fused['D']},{fused['V']}"
    cmd = "python -m bench --suite linear" + ("" if point == CPU_LINEAR else f" --linear-size {point}") \
        + (f" --threads {doc['threads']}" if doc.get("threads") else "")
    out += f"; measured by `{cmd}` in {_took(doc)}" + ("" if point == CPU_LINEAR else
                                                       f" (`python -m bench` measures {CPU_LINEAR} only)")
    return out + f" (`{path}`: {_short(doc)}).\n"


def render_toy(doc, path):
    """The toy RL run (examples/toy_rl.py): the last 10 steps of each arm, mean and range over seeds."""
    a = doc["args"]
    n = min(10, a["steps"])

    def tail(xs):
        return sum(xs[-n:]) / len(xs[-n:])

    def arm(name):
        d = doc["arms"][name]
        per = [tail(c["answer_acc"]) for c in d["per_seed"]]
        return (f"{name.upper()} reward {tail(d['reward']):.3f} (format {tail(d['format_acc']):.3f}, correct "
                f"{tail(d['answer_acc']):.3f}; correct per seed {min(per):.2f}-{max(per):.2f})")
    load = doc.get("load")
    ld = f", load average {load['before']:.2f} before, {load['after']:.2f} after" if load else ""
    m = doc.get("machine", {})
    return (f"From `{path}`: {doc['date'][:10]}, commit {(doc.get('commit') or '?')[:7]}"
            f"{'+dirty' if (doc.get('commit') or '').endswith('+dirty') else ''}, {m.get('cpu', '?')}, "
            f"{m.get('cpu_count', '?')} cores{ld}; {len(a['seeds'])} seeds x {a['steps']} steps, "
            f"{a['prompts']} prompts x {a['group_size']} completions, {doc['seconds']} s. Over the last {n} steps, "
            f"mean over seeds: {arm('gtpo')}; {arm('grpo')}.\n")


RENDER = {"logits": render_logits, "linear": render_linear, "parallel": render_parallel, "aot": render_aot,
          "head": render_head, "logits_summary": render_logits_summary, "linear_summary": render_linear_summary,
          "toy": render_toy, **GPU_RENDER}


def documents():
    """The files whose figures are rendered: README.md and docs/*.md (the specification aside)."""
    docs = sorted(os.path.join(DOCS, f) for f in os.listdir(DOCS) if f.endswith(".md") and f not in NOT_RENDERED)
    return [README] + docs


def blocks(text):
    """[(name, json path, body)] of a document's marked tables."""
    return [(m.group(1), m.group(2), m.group(3)) for m in BLOCK.finditer(text)]


def expected(name, path):
    """The body a table should hold: rendered from its JSON, or PLACEHOLDER when there is no file yet."""
    full = os.path.join(ROOT, path)
    if not os.path.exists(full):
        return PLACEHOLDER + "\n"
    with open(full) as f:
        return RENDER[name](json.load(f), path)


def drift(text, where="README.md"):
    """Problems: a table that differs from its JSON's rendering, an unknown table name."""
    out = []
    for name, path, body in blocks(text):
        if name not in RENDER:
            out.append(f"bench:{name}: no renderer (expected one of {sorted(RENDER)})")
        elif body != expected(name, path):
            out.append(f"{where}, bench:{name}: the table differs from {path} "
                       f"(python -m bench.readme_numbers --write rewrites it)")
    return out


def write(text):
    return BLOCK.sub(lambda m: f"<!-- bench:{m.group(1)} {m.group(2)} -->\n{expected(m.group(1), m.group(2))}"
                               f"<!-- /bench:{m.group(1)} -->", text)


def run(out=None):
    """Measures every table's JSON, one suite after the other (into bench/results/, or `out`)."""
    for name, args in COMMANDS.items():
        cmd = [sys.executable, "-m", "bench", *args, *(["--out", out] if out else ["--save"])]
        print("$ " + " ".join(["python"] + cmd[1:]), flush=True)
        subprocess.run(cmd, cwd=ROOT, check=True)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.readme_numbers", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--write", action="store_true", help="rewrite the tables of README.md and docs/ from their JSON")
    ap.add_argument("--run", action="store_true",
                    help="measure every table's JSON into bench/results/ (--save), then rewrite the tables")
    ap.add_argument("--out", default=None,
                    help="with --run: measure into this folder instead, and leave README.md and docs/ as they are")
    a = ap.parse_args(argv)
    if a.run:
        run(a.out)
        if a.out:
            return 0
    problems, n = [], 0
    for doc in documents():
        with open(doc) as f:
            text = f.read()
        n += len(blocks(text))
        if a.write or a.run:
            new = write(text)  # rendered before the file is opened: an error leaves the file as it was
            if new != text:
                with open(doc, "w") as f:
                    f.write(new)
        else:
            problems += drift(text, os.path.relpath(doc, ROOT))
    if a.write or a.run:
        print(f"rewrote {n} tables in README.md and docs/")
        return 0
    print("\n".join(problems) or f"README.md and docs/: {n} tables match their JSON")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
