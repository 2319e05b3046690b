"""The float32 head (spec 14, `head_dtype=torch.float32`) against the default on bfloat16 inputs: each
token's logp and entropy against float64 of the exact product of the 16-bit hidden states and LM head, and
the CPU time of one linear_token_logprobs call (the PyTorch backend, one thread; a CPU timing, not a GPU
one). The default rounds each logit to bfloat16 before the softmax.

    python -m bench.head_dtype                      # 128 tokens, D = 2048, V = 151936 (Qwen's vocabulary)
    python -m bench.head_dtype --size 64,1024,32000
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="128,2048,151936", help="N,D,V (default: 128,2048,151936)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    for line in measure(*(int(x) for x in a.size.split(","))):
        print(line, flush=True)


if __name__ == "__main__":
    main()
