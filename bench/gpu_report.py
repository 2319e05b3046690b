"""The first and last steps of bench/gpu_check.sh: the tree that runs, and what the run's records say.

    python -m bench.gpu_report begin --out DIR [--wheels DIR --peers DIR]   # the peers, the tree, the GPU
                                                   # (DIR/run.json, DIR/tree.txt)
    python -m bench.gpu_report targets --out DIR   # the records checked, the targets PASS / FAIL (DIR/targets.*)

begin: the comparison libraries (Liger-Kernel, TRL and what TRL's head imports) that are not importable
are installed from the wheels in --wheels (no registry: `pip download --no-deps liger-kernel==0.8.5
trl==1.16.0 datasets dill multiprocess -d .whl` where one is reachable) into --peers, which the caller puts
on PYTHONPATH; one missing with no wheel is reported as not installed (its rows then say so). Then the
targets below, and the tree that runs (bench.common.record.tree_state: its hash, the commit, whether it is committed)
and the machine. A tree that git sees as uncommitted, or whose hash is not $GTPO_COMMITTED_TREE (the hash of
the clean checkout, computed where git is: `python -m bench.common.record --tree`), is refused: exit 3,
nothing measured. GPU_CHECK_ALLOW_DIRTY=1 runs it anyway, and every record then says
`tree_committed: false` (bench.common.record.check_records refuses such a record).

targets: every JSON under DIR must name this tree (`tree`) and not be marked uncommitted; then the targets
the GPU check reports against, each a PASS or FAIL line read from the JSON results (a target whose rows
did not run is a FAIL that says why):
- the logits path (`triton`: ours with the run's preset, entropies returned, validate=True) at or under
  Liger-Kernel's `triton_grpo_loss` forward + backward time at every size of the grid, and at most
  LARGE_RATIO of it from LARGE_TOKENS tokens on (the per-round ratio's median, interleaved rounds);
- the fused LM head (`linear_gtpo_loss`, forward + backward) at most HEAD_MS at HEAD_SIZE, per schedule.
Beside them, INFO lines: ours doing Liger's work (`triton-grpo`) and without the checks
(`triton-novalidate`) against Liger, and the heads against TRL's and Liger's. Writes targets.txt and
targets.json (stamped) into DIR. Exit 1 when a record fails its check (a target missed is a result: exit 0).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from .common import record

GRID_RATIO = 1.0
LARGE_TOKENS, LARGE_RATIO = 16384, 0.9
HEAD_SIZE, HEAD_MS = (8192, 4096, 151936), 45.0
HEADS = ("fused", "recompute")


def _load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _why(row):
    if row is None:
        return "no row"
    return f"{row.get('status')}" + (f": {row['note']}" if row.get("note") else "")


def _ratio(row, base, key):
    """(median, min, max) of row's per-round forward+backward time over base's: row[key]['full'] when the
    suite computed it, else the ratio of the medians (min = max = it)."""
    v = row.get(key, {}).get("full")
    if v:
        return v["median"], v["min"], v["max"]
    x = row["time_ms"]["full"] / base["time_ms"]["full"]
    return x, x, x


def grid_targets(doc, path):
    """Results of the logits targets (and INFO lines) from a grid record."""
    out = []
    if doc is None:
        return [dict(name="logits: ours at or under Liger at every grid size", status="FAIL",
                     detail=f"no grid record ({path} missing or unreadable)")]
    rows = {(r["impl"], r["tokens"], r["V"]): r for r in doc["rows"]}
    timed = lambda r: r is not None and r.get("status") == "ok" and "time_ms" in r  # noqa: E731
    for tokens, V in (tuple(s) for s in doc.get("sizes", [])):
        target = LARGE_RATIO if tokens >= LARGE_TOKENS else GRID_RATIO
        name = f"logits {tokens} x {V}: ours (preset {doc.get('preset')}, entropies, validate=True) <= " \
               f"{target:.2f}x Liger's fwd+bwd"
        ours, liger = rows.get(("triton", tokens, V)), rows.get(("liger", tokens, V))
        if not (timed(ours) and timed(liger)):
            out.append(dict(name=name, status="FAIL", target=target,
                            detail=f"not measured (ours: {_why(ours)}; Liger: {_why(liger)})"))
            continue
        med, lo, hi = _ratio(ours, liger, "vs_liger")
        out.append(dict(name=name, status="PASS" if med <= target else "FAIL", value=med, target=target,
                        detail=f"{ours['time_ms']['full']:.3f} ms against {liger['time_ms']['full']:.3f} ms: "
                               f"{med:.2f}x (per round {lo:.2f}-{hi:.2f})"))
        for impl, what in (("triton-novalidate", "validate=False"), ("triton-grpo", "Liger's work (grpo, "
                                                                                   "validate=False)")):
            r = rows.get((impl, tokens, V))
            if timed(r):
                med, lo, hi = _ratio(r, liger, "vs_liger")
                out.append(dict(name=f"logits {tokens} x {V}: ours, {what}", status="INFO", value=med,
                                detail=f"{r['time_ms']['full']:.3f} ms: {med:.2f}x Liger's (per round {lo:.2f}-{hi:.2f})"))
    return out


def head_targets(doc, path):
    """Results of the head target (and INFO lines against TRL's and Liger's heads) from a linear record."""
    key = "x".join(map(str, HEAD_SIZE))
    if doc is None:
        return [dict(name=f"head {key}: <= {HEAD_MS:g} ms", status="FAIL",
                     detail=f"no linear record ({path} missing or unreadable)")]
    rows = {(r["impl"], r["N"], r["D"], r["V"]): r for r in doc["rows"]}
    out = []
    for impl in HEADS:
        r = rows.get((impl, *HEAD_SIZE))
        name = f"head {key} {impl}: linear_gtpo_loss fwd+bwd <= {HEAD_MS:g} ms"
        if r is None or "time_ms" not in r:
            out.append(dict(name=name, status="FAIL", target=HEAD_MS, detail=f"not measured ({_why(r)})"))
            continue
        t = r["time_ms"]["full"]
        rg = r.get("time_range_ms", {}).get("full", [t, t])
        out.append(dict(name=name, status="PASS" if t <= HEAD_MS else "FAIL", value=t, target=HEAD_MS,
                        detail=f"{t:.1f} ms (rounds {rg[0]:.1f}-{rg[1]:.1f})"))
    for (impl, N, D, V), r in rows.items():
        if "time_ms" in r and impl not in ("trl",):
            t = rows.get(("trl", N, D, V))
            vs = f", {r['vs_trl']['full']['median']:.2f}x TRL's" if r.get("vs_trl") else \
                 (f" (TRL's: {_why(t)})" if t is not None and "time_ms" not in t else "")
            out.append(dict(name=f"head {N}x{D}x{V} {r['label']}", status="INFO", value=r["time_ms"]["full"],
                            detail=f"{r['time_ms']['full']:.1f} ms{vs}"))
    return out


def check_records(folder, tree):
    """Every JSON under folder names `tree` and is not marked uncommitted: (ok, lines)."""
    lines, bad = [], 0
    paths = sorted(glob.glob(os.path.join(folder, "**", "*.json"), recursive=True))
    for p in paths:
        doc = _load(p)
        rel = os.path.relpath(p, folder)
        if not isinstance(doc, dict):
            bad += 1
            lines.append(f"FAIL record {rel}: not a JSON object")
        elif doc.get("tree") != tree:
            bad += 1
            lines.append(f"FAIL record {rel}: tree {doc.get('tree')!r}, not the tree that ran ({tree})")
        elif doc.get("tree_committed") is False:
            bad += 1
            lines.append(f"FAIL record {rel}: marked as measured on an uncommitted tree")
    lines.insert(0, f"{'PASS' if not bad else 'FAIL'} records: {len(paths) - bad} of {len(paths)} JSON files "
                    f"name the tree that ran ({tree}) and none is marked uncommitted")
    return not bad, lines


def targets(folder) -> int:
    tree = record.tree_hash()
    ok, lines = check_records(folder, tree)
    grid_path = os.path.join(folder, "latest-cuda.json")
    head_path = os.path.join(folder, "latest-linear-cuda.json")
    results = grid_targets(_load(grid_path), grid_path) + head_targets(_load(head_path), head_path)
    for r in results:
        lines.append(f"{r['status']} {r['name']}: {r['detail']}")
    met = [r for r in results if r["status"] == "PASS"]
    scored = [r for r in results if r["status"] in ("PASS", "FAIL")]
    lines.append(f"targets met: {len(met)} of {len(scored)}")
    text = "\n".join(lines)
    print(text, flush=True)
    with open(os.path.join(folder, "targets.txt"), "w") as f:
        f.write(text + "\n")
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    doc = dict(record.stamp(device), device=device, records_ok=ok, results=results,
               targets=dict(grid_ratio=GRID_RATIO, large_tokens=LARGE_TOKENS, large_ratio=LARGE_RATIO,
                            head_size=list(HEAD_SIZE), head_ms=HEAD_MS))
    with open(os.path.join(folder, "targets.json"), "w") as f:
        json.dump(doc, f, indent=1, default=str)
    return 0 if ok else 1


PEERS = ("liger_kernel", "trl", "datasets", "dill", "multiprocess")  # the last three: what TRL's head imports


def install_peers(wheels, target):
    """Installs the missing PEERS from `wheels` into `target` (one pip call, no index); says what it did."""
    import importlib
    import importlib.util
    import subprocess
    missing = [m for m in PEERS if importlib.util.find_spec(m) is None]
    found = {m: sorted(glob.glob(os.path.join(wheels, f"{m}-*.whl")))[-1:] for m in missing}
    todo = [w for ws in found.values() for w in ws]
    for m in missing:
        if not found[m]:
            print(f"{m} not installed and no wheel in {wheels}: reported as not installed", flush=True)
    if todo:
        print(f"installing {', '.join(os.path.basename(w) for w in todo)} into {target}", flush=True)
        p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                            "--target", target, *todo], capture_output=True, text=True)
        if p.returncode:
            print(f"install failed (those peers are reported as not installed): {p.stderr[-1000:]}", flush=True)
        if target not in sys.path:
            sys.path.insert(0, target)
        importlib.invalidate_caches()


def target_lines():
    return [f"target: the logits path (ours, entropies, validate=True) at or under Liger-Kernel's triton_grpo_loss "
            f"forward + backward at every grid size ({GRID_RATIO:.2f}x), at most {LARGE_RATIO:.2f}x from "
            f"{LARGE_TOKENS} tokens on",
            f"target: the fused LM head at {'x'.join(map(str, HEAD_SIZE))} (bf16) in at most {HEAD_MS:g} ms "
            f"forward + backward"]


def begin(folder, wheels=None, peers=None) -> int:
    if wheels and peers:
        install_peers(wheels, peers)
    import torch
    for line in target_lines():
        print(line, flush=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    doc = dict(record.stamp(device), device=device)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "tree.txt"), "w") as f:
        f.write(f"tree {doc['tree']}\ncommit {doc['commit']}\ntree_committed {doc['tree_committed']}\n"
                + "".join(f"uncommitted {x}\n" for x in doc["uncommitted"]))
    with open(os.path.join(folder, "run.json"), "w") as f:
        json.dump(doc, f, indent=1, default=str)
    v = doc["versions"]
    print(f"tree {doc['tree']} (commit {doc['commit']}, committed: {doc['tree_committed']}); {device}: "
          f"{doc['machine'].get('gpu', doc['machine'].get('cpu'))}; torch {v.get('torch')}, triton {v.get('triton')}, "
          f"liger-kernel {v.get('liger_kernel')}, trl {v.get('trl')}", flush=True)
    if doc["tree_committed"] is None:
        print("no git here and no $GTPO_COMMITTED_TREE: the records name the tree by its hash; check them with "
              "`python -m bench.common.record FILE...` on a clean checkout of the commit", flush=True)
    if doc["tree_committed"] is False:
        shown = "\n  ".join(doc["uncommitted"])
        if os.environ.get("GPU_CHECK_ALLOW_DIRTY") == "1":
            print(f"UNCOMMITTED TREE (GPU_CHECK_ALLOW_DIRTY=1): every record is marked tree_committed=false:\n  {shown}")
            return 0
        print(f"refusing to run: the tree is not a commit's (commit it, or GPU_CHECK_ALLOW_DIRTY=1 to run with "
              f"every record marked):\n  {shown}", flush=True)
        return 3
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("begin", "targets"))
    ap.add_argument("--out", required=True, help="the GPU check's output folder")
    ap.add_argument("--wheels", default=None, help="begin: folder of the peers' wheels")
    ap.add_argument("--peers", default=None, help="begin: where the missing peers are installed (on PYTHONPATH)")
    a = ap.parse_args(argv)
    return begin(a.out, a.wheels, a.peers) if a.what == "begin" else targets(a.out)


if __name__ == "__main__":
    sys.exit(main())
