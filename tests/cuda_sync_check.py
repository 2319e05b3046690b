"""The hot path under torch.cuda.set_sync_debug_mode("error") (run by bench/gpu_check.sh; without CUDA it
runs the same calls on the CPU, with Triton's interpreter, as a smoke test).

With validate=False, forward + backward of:
  1. gtpo_loss (padded and packed): no host sync at all;
  2. linear_gtpo_loss with schedule='fused' and schedule='recompute': the head plans its tiles on the
     host by design (spec 11: host syncs only to plan the tiles), so its two planning functions
     (pipeline/tiles.plan_rows, and plan_backward for the recompute backward) run with the mode off and
     are counted; any other sync, a host-to-device copy of pageable memory included, is an error.

Prints one line per call and exits non-zero on a failure. Usage: python tests/cuda_sync_check.py
"""
import contextlib
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "0" if "--cuda-only" in sys.argv else "1")

import torch  # noqa: E402


@contextlib.contextmanager
def sync_mode(dev, mode):
    if dev.type != "cuda":
        yield
        return
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)


@contextlib.contextmanager
def planning_allowed(dev, planned):
    """The head's planning functions with the sync check off, each call counted in `planned`."""
    from gtpo_kernels.pipeline import tiles
    saved = {name: getattr(tiles, name) for name in ("plan_rows", "plan_backward")}

    def allowed(name, fn):
        def run(*args, **kwargs):
            planned[name] = planned.get(name, 0) + 1
            with sync_mode(dev, 0):
                out = fn(*args, **kwargs)
            return out
        return run
    for name, fn in saved.items():
        setattr(tiles, name, allowed(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(tiles, name, fn)


def _inputs(dev, seed=0):
    """bf16 (8, 64) tokens, D = 64, V = 4096 on CUDA; small float32 ones on the CPU's interpreter."""
    B, T, D, V, dtype = (8, 64, 64, 4096, torch.bfloat16) if dev.type == "cuda" else (8, 8, 16, 256, torch.float32)
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, D, generator=g).to(dev, dtype)
    w = (torch.randn(V, D, generator=g) / D ** 0.5).to(dev, dtype)
    ids = torch.randint(0, V, (B, T), generator=g).to(dev)
    mask = (torch.rand(B, T, generator=g) > 0.1).to(dev)
    adv = torch.randn(B, generator=g).to(dev)
    return h, w, ids, mask, adv


def check_logits(dev):
    from gtpo_kernels import GTPOConfig, gtpo_loss
    h, w, ids, mask, adv = _inputs(dev)
    x = (h @ w.t()).detach()
    B, T = ids.shape
    cu = torch.arange(0, B * T + 1, T, device=dev, dtype=torch.int32)
    cfg = GTPOConfig(entropy_threshold=None, entropy_coef=0.01)
    for packed in (False, True):
        xx = (x.reshape(B * T, -1) if packed else x).clone().requires_grad_()
        kw = dict(cu_seqlens=cu, max_seqlen=T) if packed else {}
        args = (ids.reshape(-1), adv, mask.reshape(-1)) if packed else (ids, adv, mask)
        gtpo_loss(xx, *args, group_size=8, config=cfg, validate=False, **kw).loss.backward()  # warm-up
        xx.grad = None
        with sync_mode(dev, "error"):
            gtpo_loss(xx, *args, group_size=8, config=cfg, validate=False, **kw).loss.backward()
    return "gtpo_loss forward + backward, padded and packed: no host sync"


def check_head(dev, schedule):
    from gtpo_kernels import linear_gtpo_loss
    from gtpo_kernels.pipeline.head import row_bytes
    h, w, ids, mask, adv = _inputs(dev)
    h.requires_grad_()
    w.requires_grad_()
    budget = ids.numel() // 8 * row_bytes(w.shape[0], w.dtype, dev)  # about 8 tiles
    kw = dict(group_size=8, config="grpo", memory_budget=budget, schedule=schedule, validate=False)
    out = linear_gtpo_loss(h, w, ids, adv, mask, **kw)  # warm-up (compiles)
    out.loss.backward()
    h.grad = w.grad = None
    planned = {}
    with planning_allowed(dev, planned), sync_mode(dev, "error"):
        out = linear_gtpo_loss(h, w, ids, adv, mask, **kw)
        out.loss.backward()
    ran = "fused" if float(out.metrics["grad_in_forward"]) else "recompute"
    assert ran == schedule, f"schedule={schedule!r} asked, {ran} ran"
    return f"linear_gtpo_loss schedule={schedule!r} forward + backward: syncs only in the planning {planned}"


def main():
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        print("cuda_sync_check: no CUDA device: the calls run on the CPU (interpreter), without the sync check")
    failed = 0
    checks = [("logits", lambda: check_logits(dev))]
    checks += [(f"head {s}", (lambda s=s: check_head(dev, s))) for s in ("fused", "recompute")]
    for name, check in checks:
        try:
            print(f"PASS {name}: {check()}", flush=True)
        except Exception as e:  # report every check, then fail
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
