"""python -m bench.aot: the static GPU report (see compiler.py's docstring for the method).

    python -m bench.aot            # the tables; writes bench/out/aot-sm90.json (sm_90 and the peers),
                                   # aot-archs.json (every architecture), aot-replay.json (the kept-set
                                   # replay kernels) and the SASS / AMDGCN under aot/ (--save: into
                                   # bench/results/, from a clean tree only); exit 1 if a kernel fails
    python -m bench.aot --kernels replay   # the replay kernels alone (aot-replay.json only)
"""
import os
import sys

from ..common import HelpFormatter, record
from .compiler import DTYPES, KERNELS, report
from .tables import format_roofline, format_table, write_results


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(
        prog="python -m bench.aot", formatter_class=HelpFormatter,
        description="Compile our kernels (and the installed peers', for sm_90) for sm_90 / sm_80 / sm_100 and "
                    "AMD gfx942 without a GPU and report registers, spills, 16-byte loads, instructions per "
                    "element in the main loop, barriers, occupancy and a roofline estimate (N=16384, V=151936, "
                    "bf16) on the devices whose constants are known (H100 SXM, H200, A100 SXM, B200); the "
                    "kept-set replay kernels (NVIDIA targets): instructions per kept element over their loops.")
    ap.add_argument("--json", action="store_true", help="print the records as JSON instead of the tables")
    ap.add_argument("--save", action="store_true",
                    help="write aot-sm90.json, aot-archs.json, aot-replay.json and the SASS into bench/results/ "
                         "(the committed record)")
    ap.add_argument("--transforms", action="store_true",
                    help="also compile the tile's transforms (scale, soft-cap) in bf16 on every architecture "
                         "(informational rows, not in the records)")
    ap.add_argument("--kernels", default=",".join(KERNELS),
                    help="which kernels: vocab (the vocabulary passes, with the peers' for comparison; "
                         "aot-sm90.json, aot-archs.json), replay (the kept-set replay passes; aot-replay.json)")
    ap.add_argument("--dtypes-elsewhere", default=None, metavar="DTYPES",
                    help="the dtypes compiled on the architectures other than sm_90, comma-separated, e.g. "
                         "bfloat16 (default: all three, as on sm_90)")
    ap.add_argument("--out", default=None,
                    help="where a run without --save writes them (default: bench/out/, git-ignored)")
    args = ap.parse_args(argv)
    if args.save and args.out:
        ap.error("--save writes into bench/results/; give --save or --out DIR, not both")
    root = record.RESULTS if args.save else (args.out or record.SCRATCH)
    if not args.json:
        record.require_clean(root)
    kernels = tuple(k for k in args.kernels.split(",") if k)
    if not kernels or set(kernels) - set(KERNELS):
        ap.error(f"--kernels: a comma-separated subset of {','.join(KERNELS)}")
    elsewhere = None
    if args.dtypes_elsewhere is not None:
        import torch
        names = {str(d).replace("torch.", ""): d for d in DTYPES}
        if not args.dtypes_elsewhere or set(args.dtypes_elsewhere.split(",")) - set(names):
            ap.error(f"--dtypes-elsewhere: a comma-separated subset of {','.join(names)}")
        elsewhere = tuple(getattr(torch, n) for n in args.dtypes_elsewhere.split(","))
    res = report(transforms=args.transforms, kernels=kernels, elsewhere=elsewhere)
    if args.json:
        import json
        print(json.dumps([{k: v for k, v in r.__dict__.items() if k != "sass_text"} for r in res]))
    else:
        print(format_table(res))
        peers = []
        try:  # the peers (optional dependencies): counted for the roofline, never part of the check
            if "vocab" in kernels:
                from .peers import report_peers
                peers = report_peers()
        except Exception as e:
            print(f"peers: not compiled ({type(e).__name__}: {e})")
        if peers:
            print("\npeers (their own launch settings, bf16 sm_90):")
            print(format_table(peers))
        print()
        command = " ".join(["python -m bench.aot"] + (sys.argv[1:] if argv is None else list(argv)))
        recs = write_results(res + peers, root, command)
        if recs:
            print(format_roofline(recs))
        names = (["aot-sm90.json", "aot-archs.json"] if "vocab" in kernels else []) + \
            (["aot-replay.json"] if "replay" in kernels else [])
        print(f"\nwritten into {root}: {', '.join(names)} and the SASS / AMDGCN under {os.path.join(root, 'aot')}"
              + ("" if args.save else " (--save writes bench/results/)"))
    sys.exit(0 if all(r.ok for r in res) else 1)


if __name__ == "__main__":
    main()
