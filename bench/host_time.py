"""`python -m bench.host_time`: the host's own time for one call on logits, forward + backward, with the
kernels' launches stubbed out (Triton's interpreter, each launch returning at once; the aten ops around
them still run, on the CPU), so what is timed is the package's Python and torch's per-op overhead, the
part of a call a GPU's host pays before and between launches (spec 8: the loss is host-bound below ~16k
tokens). Two paths: the custom ops called eagerly (kernels/eager.py, what an eager call runs) and through
torch.library's dispatch (the registered ops, as a compiled graph calls them; forced here by making
torch.compiler.is_compiling() true). A GPU host adds the launcher's own time per launch (not counted).
Times are CPU times on the machine that runs it; the 10th percentile and the median of `--reps` calls
of each path, the two paths interleaved in 10 blocks."""
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

CALLS = ("gtpo_loss, grpo", "gtpo_loss, gtpo", "gtpo_loss, gtpo, packed", "gtpo_loss, top_k replay",
         "token_logprobs", "gtpo_loss_from_logps, grpo")


def _call(name, B=16, T=64, V=64):
    """A function running one forward + backward of `name` (validate=False) on fixed random inputs."""
    from gtpo_kernels import gtpo_loss, gtpo_loss_from_logps, token_logprobs
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(B, T, V, generator=g) * 4).requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=g)
    adv, old = torch.randn(B, generator=g), -torch.rand(B, T, generator=g)
    kw = dict(group_size=4, old_logps=old, backend="triton", validate=False)
    if name == "token_logprobs":
        return lambda: token_logprobs(x.detach(), ids, 1.0, backend="triton", validate=False)
    if name.startswith("gtpo_loss_from_logps"):
        lp = (-torch.rand(B, T, generator=g)).requires_grad_()
        return lambda: torch.autograd.grad(gtpo_loss_from_logps(lp, ids, adv, config="grpo", **kw).loss, lp)
    if name.endswith("packed"):
        cu = torch.arange(0, B * T + 1, T)
        return lambda: torch.autograd.grad(gtpo_loss(
            x.reshape(B * T, V), ids.reshape(-1), adv, config="gtpo", cu_seqlens=cu, max_seqlen=T,
            **{**kw, "old_logps": old.reshape(-1)}).loss, x)
    extra = dict(config="dapo", top_k=8) if name.endswith("replay") else dict(config=name.split(", ")[1])
    return lambda: torch.autograd.grad(gtpo_loss(x, ids, adv, **kw, **extra).loss, x)


def _percentiles(ts):
    ts = sorted(ts)
    return 1e6 * ts[len(ts) // 10], 1e6 * ts[len(ts) // 2]


def measure(calls=CALLS, reps=200, rounds=10):
    """[(call, eager (10th percentile, median) us, registered ops (same))]: `reps` calls of each path,
    interleaved in `rounds` blocks (a load that comes and goes weighs on both alike)."""
    from bench import interpreter
    interpreter.install()
    from triton.runtime import interpreter as ti
    rows = []
    for name in calls:
        run = _call(name)
        run()  # warm: the kernels run once (interpreted), the caches fill
        saved_run, saved_compiling = ti.InterpretedFunction.run, torch.compiler.is_compiling
        ti.InterpretedFunction.run = lambda self, *a, **k: None
        times = {False: [], True: []}
        try:
            for _ in range(rounds):
                for registered in (False, True):
                    torch.compiler.is_compiling = (lambda: True) if registered else saved_compiling
                    for _ in range(max(1, reps // rounds)):
                        t0 = time.perf_counter()
                        run()
                        times[registered].append(time.perf_counter() - t0)
        finally:
            ti.InterpretedFunction.run, torch.compiler.is_compiling = saved_run, saved_compiling
        rows.append((name, _percentiles(times[False]), _percentiles(times[True])))
    return rows


def main(argv=None):
    import argparse
    ap = argparse.ArgumentParser(prog="python -m bench.host_time", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)
    print("| call (forward + backward, validate=False; 16 x 64 tokens, V = 64; launches stubbed, CPU host) | "
          "eager ops: p10 / median us | registered ops: p10 / median us |")
    print("|---|---|---|")
    for name, e, r in measure(reps=args.reps):
        print(f"| {name} | {e[0]:.0f} / {e[1]:.0f} | {r[0]:.0f} / {r[1]:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
