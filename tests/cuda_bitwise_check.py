"""Spec 14 on a GPU, without a process group: the vocabulary-parallel block merge is bitwise the
single-process forward kernel on the compiled kernels (the gloo tests check it under Triton's interpreter,
where no compiler can contract or reorder anything).

For each vocabulary and split (slices starting at multiples of gtpo_kernels.VOCAB_BLOCK), every slice's
per-block statistics come from vocab_triton.vocab_blocks, are concatenated in global block order and
merged by vocab_triton.vocab_merge (what every rank runs after the all-gather), and logp, entropy and the
stats must equal (torch.equal) vocab_triton.vocab_fwd on the whole vocabulary. bf16 and float32 logits,
one temperature and one per token, with and without the tile's transforms.

Prints one line per case and exits non-zero on a failure. Usage: python tests/cuda_bitwise_check.py
(on the CPU it runs under TRITON_INTERPRET=1 with small vocabularies: GTPO_VOCAB_BLOCK=64).
"""
import os
import sys

import torch


def _splits(V, vb, ranks):
    """Slice sizes over `ranks` ranks, every slice starting at a multiple of vb (uneven, the last partial)."""
    nb = -(-V // vb)
    cuts = sorted({min(nb, (i * nb) // ranks + (i % 2)) for i in range(1, ranks)})
    edges = [0, *[min(V, c * vb) for c in cuts], V]
    return [edges[i + 1] - edges[i] for i in range(len(edges) - 1)]


def check(V, ranks, dtype, per_token, transforms, dev):
    from gtpo_kernels import VOCAB_BLOCK
    from gtpo_kernels.kernels import vocab_triton as vt
    g = torch.Generator().manual_seed(V + ranks)
    n = 64
    x = (torch.randn(1, n, V, generator=g) * 4).to(dev, dtype)
    ids = torch.randint(0, V, (n,), generator=g).to(dev)
    x[0, :8].index_put_((torch.arange(8, device=dev), ids[:8]), torch.tensor(60.0, device=dev, dtype=dtype))
    counted = (torch.rand(n, generator=g) > 0.1).to(dev)
    tau = (torch.rand(n, generator=g) * 0.8 + 0.5).to(dev) if per_token else torch.full((1,), 0.7, device=dev)
    scale, softcap = (0.5, 30.0) if transforms else (1.0, None)
    one = vt.vocab_fwd(x, ids, counted, tau, 0, scale, softcap)
    sizes = _splits(V, VOCAB_BLOCK, ranks)
    parts, zy, start = [], torch.full((n,), float("nan"), device=dev), 0
    for size in sizes:
        local = ids - start
        blocks, z = vt.vocab_blocks(x[..., start:start + size].contiguous(), local, counted, tau, 0, V, scale,
                                    softcap)
        parts.append(blocks)
        zy = torch.where((ids >= start) & (ids < start + size), z, zy)
        start += size
    merged = vt.vocab_merge(torch.cat(parts, 1), zy, ids, counted, tau, V)
    ok = all(torch.equal(a[counted], b[counted]) for a, b in zip(one[:3], merged[:3])) and \
        torch.equal(one[3], merged[3])
    print(f"V={V} slices={sizes} {str(dtype).replace('torch.', '')} tau={'per token' if per_token else 'one'} "
          f"transforms={transforms}: {'bitwise' if ok else 'DIFFERS'}")
    return ok


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        os.environ.setdefault("GTPO_VOCAB_BLOCK", "64")
        vocabs = [(300, 2), (300, 4)]
    else:
        vocabs = [(151936, 2), (151936, 4), (196608, 8), (50257, 3)]
    ok = True
    for V, ranks in vocabs:
        for dtype in (torch.bfloat16, torch.float32):
            for per_token in (False, True):
                for transforms in (False, True):
                    ok &= check(V, ranks, dtype, per_token, transforms, dev)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
