"""`python -m bench.launches_parallel`: bench.launches' count for vocabulary-parallel logits (spec 12):
gtpo_loss(process_group=...) on `--ranks` gloo processes on the CPU (Triton's interpreter), forward +
backward, as rank 0 launches them: 4 x 5 tokens, V = 37 split as evenly as the ranks allow (a config
ending in "-packed": the same tokens packed, cu_seqlens and max_seqlen given, the last token of the last
completion dropped, per-token inputs packed alike and per-completion ones as given; "token_logprobs":
token_logprobs(process_group=...), forward only; "gtpo-official":
lam and n_conf given; "grpo-rollout-token" / "-seq": rollout weights per token / per completion; "grpo-tau-token"
/ "-seq": a temperature tensor per token / per completion; "grpo-top-k" / "token_logprobs-top-k": the sets
rebuilt by top_k = 5 (each rank's candidates gathered; spec 13); "grpo-recorded": recorded sets
(sampling_mask, each token's id and about half the vocabulary); "head-3" and
"head-6": linear_gtpo_loss(process_group=...), dapo, D = 8, the recompute schedule with tiles of 3 and 6
rows; "linear_token_logprobs": linear_token_logprobs(process_group=...), D = 8, one tile, forward only).
Launches, of them Triton, host reads, tensors made from host data (each a host-to-device copy on a GPU), per
config and validate."""
import os
import sys
import tempfile
import traceback

import torch


CONFIGS = ("grpo", "gtpo", "clip-cov", "grpo-packed", "token_logprobs", "gtpo-official", "grpo-rollout-token",
           "grpo-rollout-seq", "grpo-rollout-seq-packed", "grpo-tau-token", "grpo-tau-seq", "grpo-tau-seq-packed",
           "head-3", "head-6", "linear_token_logprobs", "grpo-top-k", "token_logprobs-top-k", "grpo-recorded")


def counts(rank, world, B=4, T=5, configs=CONFIGS, validates=(False, True), warm=True):
    """On each rank of a gloo group (Triton's interpreter): [(config, validate, launches, of them Triton,
    host reads, tensors made from host data)] of one gtpo_loss(process_group=...) forward + backward (after a first call, unless not
    `warm`) at B x T tokens, V = 37 split as evenly as the ranks allow."""
    import torch.distributed as dist
    from bench.launches import counting
    from gtpo_kernels import GTPOConfig, gtpo_loss, linear_gtpo_loss, linear_token_logprobs, token_logprobs
    g = torch.Generator().manual_seed(7)
    V = 37
    x = torch.randn(B, T, V, generator=g) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.linspace(-1.0, 1.0, B)
    old = -torch.rand(B, T, generator=g) * 3 - 1.5
    sizes = [V // world + (r < V % world) for r in range(world)]
    start = sum(sizes[:rank])
    rows = []
    keep = torch.ones(B * T, dtype=torch.bool)
    keep[-1] = False
    cu = torch.tensor([T * i for i in range(B)] + [B * T - 1])
    more = {"gtpo-official": dict(config=GTPOConfig(loss_agg="gtpo-official"), lam=torch.rand(B, T, generator=g) + 0.5,
                                  n_conf=torch.arange(1.0, B + 1)),
            "grpo-rollout-token": dict(config="grpo", rollout_is_weights=torch.rand(B, T, generator=g) + 0.5),
            "grpo-rollout-seq": dict(config="grpo", rollout_is_weights=torch.rand(B, 1, generator=g) + 0.5),
            "grpo-tau-token": dict(config="grpo", temperature=torch.rand(B, T, generator=g) + 0.5),
            "grpo-tau-seq": dict(config="grpo", temperature=torch.rand(B, 1, generator=g) + 0.5),
            "grpo-top-k": dict(config="grpo", top_k=5),
            "grpo-recorded": dict(config="grpo", sampling_mask=_recorded(ids, V))}
    D = 8
    h, w = torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g)
    for cfg in configs:
        name, packed = cfg.removesuffix("-packed"), cfg.endswith("-packed")
        for validate in validates:
            part = x[..., start:start + sizes[rank]]
            part = (part.reshape(B * T, -1)[keep] if packed else part).clone().requires_grad_()
            form = dict(completion_ids=ids.reshape(-1)[keep], old_logps=old.reshape(-1)[keep], cu_seqlens=cu,
                        max_seqlen=T) if packed else dict(completion_ids=ids, old_logps=old)
            kw = more.get(name, dict(config=name))
            if packed:  # per-token inputs on the packed tokens; per-completion ones as given
                kw = {k: v.reshape(-1)[keep] if isinstance(v, torch.Tensor) and v.shape == (B, T) else v
                      for k, v in kw.items()}
            call = lambda: gtpo_loss(part, advantages=adv, group_size=2,  # noqa: E731
                                     backend="triton", validate=validate, process_group=dist.group.WORLD,
                                     **form, **kw).loss.backward()
            if cfg.startswith("head-"):
                part = w[start:start + sizes[rank]].clone().requires_grad_()
                call = lambda: linear_gtpo_loss(  # noqa: E731
                    h, part, ids, adv, group_size=2, old_logps=old, config="dapo", backend="triton",
                    validate=validate, process_group=dist.group.WORLD, schedule="recompute",
                    memory_budget=2 * 20 * 4 * int(cfg[5:])).loss.backward()
            if cfg == "linear_token_logprobs":
                call = lambda: linear_token_logprobs(h, w[start:start + sizes[rank]], ids, 1.0,  # noqa: E731
                                                     backend="triton", validate=validate,
                                                     process_group=dist.group.WORLD)
            if cfg.startswith("token_logprobs"):
                rules = dict(top_k=5) if cfg.endswith("-top-k") else {}
                call = lambda: token_logprobs(part.detach(), ids, 1.0, backend="triton",  # noqa: E731
                                              validate=validate, process_group=dist.group.WORLD, **rules)
            if warm:
                call()
                part.grad = None
            with counting() as c:
                call()
            rows.append((cfg, validate, c.launches, c.triton, c.host_reads, c.creations))
    return rows


def _recorded(ids, V):
    """Recorded kept sets (token_ids, offsets) of every token: its sampled id and about half the vocabulary
    (the same on every rank: a generator of their own)."""
    keep = torch.rand(ids.numel(), V, generator=torch.Generator().manual_seed(11)) < 0.5
    keep[torch.arange(ids.numel()), ids.reshape(-1)] = True
    return keep.nonzero()[:, 1], torch.cat([torch.zeros(1, dtype=torch.long), keep.sum(1).cumsum(0)])


def _rank(rank, world, path, queue, configs=CONFIGS):
    os.environ["TRITON_INTERPRET"] = "1"
    from bench import interpreter
    interpreter.install()
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    torch.manual_seed(0)  # clip-cov draws from the default generator: alike on every rank (spec 12, compared)
    try:
        rows = counts(rank, world, configs=configs)
        if rank == 0:
            queue.put(rows)
    except Exception:  # every rank raises alike (failure is collective): rank 0 tells main at once
        if rank == 0:
            queue.put(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(prog="python -m bench.launches_parallel", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="which rows, comma-separated (default: all)")
    args = ap.parse_args(argv)
    configs = tuple(args.configs.split(","))
    if not set(configs) <= set(CONFIGS):
        ap.error(f"--configs: expected some of {','.join(CONFIGS)}")
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_rank, args=(r, args.ranks, os.path.join(d, "store"), queue, configs))
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        rows = queue.get(timeout=600)
        for p in procs:
            p.join()
    if isinstance(rows, str):  # rank 0's error
        print(rows, file=sys.stderr)
        return 1
    print(f"| the call (config; module docstring), process_group=..., {args.ranks} ranks, rank 0 | launches | "
          "of them Triton | host reads | tensors from host data |")
    print("|---|---|---|---|---|")
    for cfg, validate, n, tr, reads, made in rows:
        print(f"| {cfg}, validate={validate} | {n} | {tr} | {reads} | {made} |")
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
