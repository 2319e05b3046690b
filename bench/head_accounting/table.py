"""bench.head_accounting's table: one row per (case, head, validate), each cell 'before -> now' when an
earlier result is given (the README renders it from bench/results/head-accounting-{before,after}.json)."""
from __future__ import annotations


COLUMNS = (  # header, value of a row
    ("auto runs it", lambda r: "-" if "auto" not in r else ("yes" if r["auto"] == r["provider"] else "no")),
    ("tiles", lambda r: str(r["tiles_planned"])),
    ("projections", lambda r: str(r["projections"])),
    ("tile passes / floor", lambda r: f"{r['tile_passes']} / {r['tile_pass_floor']}"),
    ("host syncs (per tile fwd, bwd)", lambda r: f"{r['host_syncs']} ({_pair(r['host_syncs_per_tile'])})"),
    ("allocs > budget (> half)", lambda r: f"{r['allocs_over_budget']} ({r['allocs_over_half_budget']})"),
    ("V x D allocs", lambda r: str(r["vd_allocs"])),
    ("GEMM MFLOP / floor", lambda r: f"{r['gemm_flops'] / 1e6:.0f} / {r['gemm_flops_floor'] / 1e6:.0f}"),
    ("N-sized allocs per tile (fwd, bwd)", lambda r: _pair(r["n_allocs_per_tile"])),
    ("N-sized ops per tile (fwd, bwd)", lambda r: _pair(r["n_ops_per_tile"])),
)


def _pair(d):
    return ", ".join("-" if d[p] is None else f"{d[p]:g}" for p in ("forward", "backward"))


def _key(r):
    return r["case"], r["provider"], r.get("validate")


def markdown(result, before=None):
    """The table of `result`; with `before` (an earlier result), each cell reads 'before -> now'."""
    old = {_key(r): r for r in (before or {}).get("rows", [])}
    head = ["case", "head", "validate", "N (N_nz)"] + [c for c, _ in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        v = "-" if r.get("validate") is None else ("on" if r["validate"] else "off")
        cells = [r["case"], r["provider"], v, f"{r['N']} ({r['N_nz']})"]
        for c, f in COLUMNS:
            if c == "auto runs it":  # today's choice: no earlier one to compare with
                cells.append(f(r))
                continue
            now = "n/a" if "unavailable" in r else f(r)
            b = old.get(_key(r))
            if b is not None:
                was = "n/a" if "unavailable" in b else f(b)
                now = now if was == now else f"{was} -> {now}"
            cells.append(now)
        lines.append("| " + " | ".join(cells) + " |")
    notes = list(dict.fromkeys(f"- {r['case']} / {r['provider']}: {r['unavailable']}" for r in result["rows"]
                               if "unavailable" in r))
    return "\n".join(lines + ([""] + notes if notes else []))
