"""Tests only: run a function on W gloo processes on the CPU and collect what each rank returns."""
import json
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank, world, init_file, out_dir, fn):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        res = fn(rank, world)
    except Exception:
        res = {"exception": traceback.format_exc()}
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def run_ranks(fn, world):
    """fn(rank, world) -> a JSON-able dict, run on every rank of a fresh gloo group (fn must be a module-level
    function); returns the ranks' dicts in rank order, {'exception': traceback} where one raised."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank, args=(world, os.path.join(d, "init"), d, fn), nprocs=world, join=True)
        return [json.load(open(os.path.join(d, f"{r}.json"))) for r in range(world)]
