"""The float32 head (spec 14, `head_dtype=torch.float32`) against the default on bfloat16 inputs: each
token's logp and entropy against float64 of the exact product of the 16-bit hidden states and LM head, and
the CPU time of one linear_token_logprobs call (the PyTorch backend, one thread; a CPU timing, not a GPU
one). The default rounds each logit to bfloat16 before the softmax.

    python -m bench.head_dtype                      # 128 tokens, D = 2048, V = 151936 (Qwen's vocabulary)
    python -m bench.head_dtype --size 64,1024,32000
    python -m bench.head_dtype --time --device cuda --size 4096,2048,151936   # the cost of each setting
"""
from __future__ import annotations

import argparse
import time

import torch


def measure(N, D, V, seed=0):
    from gtpo_kernels import linear_token_logprobs
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(1, N, D, generator=g).bfloat16()
    w = (torch.randn(V, D, generator=g) * 0.05).bfloat16()  # logits of std ~2 at D = 2048: a spread-out policy
    z64 = h.double()[0] @ w.double().t()
    ids = torch.multinomial(torch.softmax(z64.float(), -1), 1, generator=g)[:, 0]  # sampled from the policy
    lp64 = torch.log_softmax(z64, -1)
    ref_lp, ref_h = lp64.gather(-1, ids[:, None])[:, 0], -(lp64.exp() * lp64).sum(-1)
    rows = [f"N x D x V = {N} x {D} x {V}, bfloat16 inputs; logit std {float(z64.std()):.2f}, mean entropy "
            f"{float(ref_h.mean()):.2f} nats"]
    for hdt in (None, torch.float32):
        t = time.perf_counter()
        lp, ent = linear_token_logprobs(h, w, ids[None], backend="torch", head_dtype=hdt)
        sec = time.perf_counter() - t
        d = lp.double().reshape(-1) - ref_lp
        e_h = (ent.double().reshape(-1) - ref_h).abs()
        rows.append(f"head_dtype={hdt}: logp error max {float(d.abs().max()):.2e}, mean {float(d.abs().mean()):.2e}; "
                    f"entropy error max {float(e_h.max()):.2e}; tokens whose exp(error) is off 1 by more than 1%: "
                    f"{float(((d.exp() - 1).abs() > 0.01).double().mean()):.1%}; {sec:.2f} s on the CPU")
    return rows


SETTINGS = (("default", {}), ("batch_invariant", dict(batch_invariant=True)),
            ("head_dtype=float32", dict(head_dtype=torch.float32)),
            ("both", dict(batch_invariant=True, head_dtype=torch.float32)))


def timing(N, D, V, device, reps=5, seed=0):
    """Forward + backward of linear_gtpo_loss (bf16, GRPO, 256 MiB tiles) for each head setting: the median
    of `reps` runs after one warm-up, in seconds (CUDA: synchronized around each run), and the peak memory
    above the inputs on CUDA. -> rows of text."""
    from gtpo_kernels import linear_gtpo_loss
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N // 8, 8, D, generator=g).bfloat16().to(device)
    w = (torch.randn(V, D, generator=g) * 0.05).bfloat16().to(device)
    ids = torch.randint(0, V, (N // 8, 8), generator=g).to(device)
    adv = torch.randn(N // 8, generator=g).to(device)
    cuda = torch.device(device).type == "cuda"
    rows = [f"linear_gtpo_loss fwd+bwd, N x D x V = {N} x {D} x {V} bf16, {device}, median of {reps}"]
    for name, kw in SETTINGS:
        times = []
        for r in range(reps + 1):
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t = time.perf_counter()
            linear_gtpo_loss(hh, ww, ids, adv, config="grpo", memory_budget=256 << 20, **kw).loss.backward()
            if cuda:
                torch.cuda.synchronize()
            if r:
                times.append(time.perf_counter() - t)
        peak = f", peak {(torch.cuda.max_memory_allocated() - base) / 2**20:.0f} MiB above the inputs" if cuda else ""
        rows.append(f"{name}: {sorted(times)[len(times) // 2] * 1e3:.1f} ms{peak}")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="128,2048,151936", help="N,D,V (default: 128,2048,151936)")
    p.add_argument("--time", action="store_true",
                   help="instead: time linear_gtpo_loss fwd+bwd with each head setting (default, batch_invariant, "
                        "head_dtype=float32, both) at --size")
    p.add_argument("--device", default="cpu", help="cpu or cuda (with --time)")
    a = p.parse_args(argv)
    size = [int(x) for x in a.size.split(",")]
    if a.device == "cpu":
        torch.set_num_threads(1)
    for line in (timing(*size, a.device) if a.time else measure(*size)):
        print(line, flush=True)


if __name__ == "__main__":
    main()
