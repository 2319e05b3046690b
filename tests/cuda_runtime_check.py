"""Runtime checks that need a CUDA device (run by bench/gpu_check.sh; skipped elsewhere):

1. with validate=False, gtpo_loss forward + backward (padded and packed) makes no device-to-host copy:
   torch.cuda.set_sync_debug_mode("error") turns any sync into an error;
2. no recompilation as lengths change: after the first of several sequence lengths and batch sizes, no
   kernel's JIT cache gains a compiled variant (one per dtype and switch combination, not one per length);
3. CUDA graphs: forward and backward are captured once and replayed on new inputs, matching eager.

Prints one line per check and exits non-zero on a failure. Usage: python tests/cuda_runtime_check.py
"""
import sys

import torch


def _batch(B, T, V, dev, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(B, T, V, generator=g) * 2).to(dev, dtype)
    ids = torch.randint(0, V, (B, T), generator=g).to(dev)
    mask = (torch.rand(B, T, generator=g) > 0.1).to(dev)
    adv = torch.randn(B, generator=g).to(dev)
    return x, ids, mask, adv


def check_no_sync(dev):
    from gtpo_kernels import GTPOConfig, gtpo_loss
    cfg = GTPOConfig(entropy_threshold=None, entropy_coef=0.01)
    x, ids, mask, adv = _batch(8, 64, 4096, dev)
    cu = torch.arange(0, 8 * 64 + 1, 64, device=dev, dtype=torch.int32)
    gtpo_loss(x.requires_grad_(), ids, adv, mask, group_size=8, config=cfg, validate=False).loss.backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for packed in (False, True):
            xx = x.detach().reshape(-1, x.shape[-1]) if packed else x.detach()
            xx.requires_grad_()
            kw = dict(cu_seqlens=cu, max_seqlen=64) if packed else {}
            out = gtpo_loss(xx, ids.reshape(-1) if packed else ids, adv, mask.reshape(-1) if packed else mask,
                            group_size=8, config=cfg, validate=False, **kw)
            out.loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return "no host sync in forward+backward with validate=False (padded and packed)"


def check_jit_cache(dev):
    from gtpo_kernels import GTPOConfig, gtpo_loss
    from gtpo_kernels.kernels import conflict_triton, vocab_triton
    kernels = {"fwd": vocab_triton._vocab_fwd_kernel, "bwd": vocab_triton._vocab_bwd_kernel,
               "conflict": conflict_triton._raw_conflicts_kernel}
    cfg = GTPOConfig(entropy_threshold=None)
    V = 4096  # a multiple of 16: every row stride is too, whatever the length

    def variants():
        out = {}
        for name, k in kernels.items():
            caches = getattr(k, "device_caches", None) or getattr(k, "cache", {})
            out[name] = sum(len(v[0] if isinstance(v, tuple) else v) for v in caches.values())
        return out

    # the first shape may compile (an earlier check's other switches are in the cache too); the next four
    # lengths and batch sizes must not add a variant
    sizes = None
    for B, T in ((8, 37), (8, 64), (16, 129), (8, 1000), (24, 3)):
        x, ids, mask, adv = _batch(B, T, V, dev, seed=T)
        gtpo_loss(x.requires_grad_(), ids, adv, mask, group_size=8, config=cfg).loss.backward()
        torch.cuda.synchronize()
        sizes = sizes or variants()
    after = variants()
    assert after == sizes, f"compiled variants per kernel after the first shape {sizes}, after 4 more {after}"
    return f"no new compiled variant over 4 more (B, T) shapes: {after}"


def check_cuda_graphs(dev):
    from gtpo_kernels import GTPOConfig, gtpo_loss
    cfg = GTPOConfig(entropy_threshold=None, entropy_coef=0.01)
    B, T, V = 8, 128, 8192
    x, ids, mask, adv = _batch(B, T, V, dev, seed=1)
    static_x = x.clone().requires_grad_()

    def step():
        static_x.grad = None
        out = gtpo_loss(static_x, ids, adv, mask, group_size=8, config=cfg, validate=False)
        out.loss.backward()
        return out.loss

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up (compiles) outside the capture
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    static_x.grad = None
    with torch.cuda.graph(graph):
        static_loss = gtpo_loss(static_x, ids, adv, mask, group_size=8, config=cfg, validate=False).loss
        static_loss.backward()
    x2 = _batch(B, T, V, dev, seed=2)[0]
    with torch.no_grad():
        static_x.copy_(x2)
    graph.replay()
    torch.cuda.synchronize()
    ref_x = x2.clone().requires_grad_()
    ref = gtpo_loss(ref_x, ids, adv, mask, group_size=8, config=cfg)
    ref.loss.backward()
    err = float((static_loss - ref.loss).abs())
    gerr = float((static_x.grad.float() - ref_x.grad.float()).norm() / ref_x.grad.float().norm())
    assert err < 1e-5 and gerr < 1e-2, (err, gerr)
    return f"CUDA graph captured and replayed on new logits: loss error {err:.1e}, grad error {gerr:.1e}"


def main():
    if not torch.cuda.is_available():
        print("cuda_runtime_check: no CUDA device, skipped")
        return 0
    failed = 0
    for check in (check_no_sync, check_jit_cache, check_cuda_graphs):
        try:
            print(f"PASS {check.__name__}: {check('cuda')}", flush=True)
        except Exception as e:  # report every check, then fail
            failed += 1
            print(f"FAIL {check.__name__}: {type(e).__name__}: {e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
