"""Host syncs of the hot path, counted as they happen (run by bench/gpu_check.sh; without CUDA it runs the
same calls on the CPU, with Triton's interpreter, as a smoke test that counts nothing).

Each call runs once to compile, then once under torch.cuda.set_sync_debug_mode("warn") with every warning
recorded: each "called a synchronizing CUDA operation" warning is one sync (a device-to-host read, a stream
synchronization, a copy from pageable host memory). Spec 8: with validate=False no host read and no
host-to-device copy, with validate=True exactly one host read (the status word). So:
  1. gtpo_loss forward + backward, padded and packed (cu_seqlens, max_seqlen): 0 syncs with validate=False,
     1 with validate=True;
  2. token_logprobs: 0 with validate=False, 1 with validate=True;
  3. linear_gtpo_loss with schedule='fused' and schedule='recompute', validate=False: the head plans its
     tiles on the host by design (spec 11: host syncs only to plan the tiles), so the syncs made inside its
     planning functions (pipeline/tiles.plan_rows, and plan_backward for the recompute backward) are
     counted apart and reported per function; any other sync is a failure.

Prints one line per call with its counts and exits 1 on a failure (0 when every check passes, and on a
machine without CUDA after the smoke run). --out DIR also writes DIR/cuda_sync_check.json (stamped with
the tree, bench.common.record). Usage: python tests/cuda_sync_check.py [--cuda-only] [--out DIR]
"""
import contextlib
import json
import os
import sys
import warnings

os.environ.setdefault("TRITON_INTERPRET", "0" if "--cuda-only" in sys.argv else "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's package and bench/, whatever is installed

import torch  # noqa: E402

SYNC_WARNING = "synchronizing CUDA operation"


class SyncCounter:
    """Counts syncs on CUDA while active (set_sync_debug_mode('warn'), every warning kept); `mark()` is the
    count so far, so a caller can attribute the syncs of a span. On the CPU it counts nothing (None)."""

    def __init__(self, dev):
        self.dev, self.caught = dev, []

    def mark(self):
        return sum(SYNC_WARNING in str(w.message) for w in self.caught) if self.dev.type == "cuda" else None

    @contextlib.contextmanager
    def active(self):
        if self.dev.type != "cuda":
            yield self
            return
        torch.cuda.synchronize()
        old = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.caught = caught
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield self
            finally:
                torch.cuda.set_sync_debug_mode(old)
        torch.cuda.synchronize()


def count(dev, fn):
    """Syncs of one fn() (None on the CPU)."""
    c = SyncCounter(dev)
    with c.active():
        fn()
    return c.mark()


@contextlib.contextmanager
def planning_counted(counter, planned):
    """The head's planning functions, each call's syncs attributed to it in `planned`:
    {name: {'calls': n, 'syncs': m}}."""
    from gtpo_kernels.pipeline import tiles
    saved = {name: getattr(tiles, name) for name in ("plan_rows", "plan_backward")}

    def counted(name, fn):
        def run(*args, **kwargs):
            before = counter.mark()
            try:
                return fn(*args, **kwargs)
            finally:
                p = planned.setdefault(name, dict(calls=0, syncs=0))
                p["calls"] += 1
                after = counter.mark()
                p["syncs"] = None if after is None else p["syncs"] + after - before
        return run
    for name, fn in saved.items():
        setattr(tiles, name, counted(name, fn))
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


def _expect(name, got, want, results):
    """One result: PASS when the count is `want` (or on the CPU, where nothing is counted)."""
    ok = got is None or got == want
    results.append(dict(name=name, syncs=got, expected=want, ok=ok))
    return f"{name}: {'not counted (CPU)' if got is None else f'{got} sync(s)'} (spec: {want})", ok


def check_logits(dev, results):
    from gtpo_kernels import GTPOConfig, gtpo_loss
    h, w, ids, mask, adv = _inputs(dev)
    x = (h @ w.t()).detach()
    B, T = ids.shape
    cu = torch.arange(0, B * T + 1, T, device=dev, dtype=torch.int32)
    cfg = GTPOConfig(entropy_threshold=None, entropy_coef=0.01)
    lines, ok = [], True
    for packed in (False, True):
        xx = (x.reshape(B * T, -1) if packed else x).clone().requires_grad_()
        kw = dict(cu_seqlens=cu, max_seqlen=T) if packed else {}
        args = (ids.reshape(-1), adv, mask.reshape(-1)) if packed else (ids, adv, mask)
        for validate in (False, True):
            def call():
                gtpo_loss(xx, *args, group_size=8, config=cfg, validate=validate, **kw).loss.backward()
            call()  # compiles
            xx.grad = None
            line, good = _expect(f"gtpo_loss {'packed' if packed else 'padded'} validate={validate}",
                                 count(dev, call), int(validate), results)
            lines.append(line)
            ok &= good
    return "; ".join(lines), ok


def check_token_logprobs(dev, results):
    from gtpo_kernels import token_logprobs
    h, w, ids, mask, _ = _inputs(dev)
    x = (h @ w.t()).detach()
    lines, ok = [], True
    for validate in (False, True):
        def call():
            token_logprobs(x, ids, 0.7, mask, validate=validate)
        call()
        line, good = _expect(f"token_logprobs validate={validate}", count(dev, call), int(validate), results)
        lines.append(line)
        ok &= good
    return "; ".join(lines), ok


def check_head(dev, schedule, results):
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
    planned, counter = {}, SyncCounter(dev)
    with counter.active(), planning_counted(counter, planned):
        out = linear_gtpo_loss(h, w, ids, adv, mask, **kw)
        out.loss.backward()
    ran = "fused" if float(out.metrics["grad_in_forward"]) else "recompute"
    total = counter.mark()
    in_planning = None if total is None else sum(p["syncs"] for p in planned.values())
    outside = None if total is None else total - in_planning
    results.append(dict(name=f"linear_gtpo_loss {schedule}", syncs=total, planning=planned,
                        outside_planning=outside, expected_outside=0, ok=ran == schedule and not outside))
    assert ran == schedule, f"schedule={schedule!r} asked, {ran} ran"
    counts = "not counted (CPU)" if total is None else f"{total} sync(s), {in_planning} in the planning"
    return (f"linear_gtpo_loss schedule={schedule!r} forward + backward: {counts} ({planned}), "
            f"{'-' if outside is None else outside} outside it (spec: 0)"), not outside


def main(argv):
    out_dir = argv[argv.index("--out") + 1] if "--out" in argv else None
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu":
        print("cuda_sync_check: no CUDA device: the calls run on the CPU (interpreter), no sync is counted")
    failed, results = 0, []
    checks = [("logits", lambda: check_logits(dev, results)), ("token_logprobs", lambda: check_token_logprobs(dev, results))]
    checks += [(f"head {s}", (lambda s=s: check_head(dev, s, results))) for s in ("fused", "recompute")]
    for name, check in checks:
        try:
            line, ok = check()
            print(f"{'PASS' if ok else 'FAIL'} {name}: {line}", flush=True)
            failed += not ok
        except Exception as e:  # report every check, then fail
            failed += 1
            results.append(dict(name=name, ok=False, error=f"{type(e).__name__}: {e}"[:500]))
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
    if out_dir:
        from bench.common import record
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "cuda_sync_check.json"), "w") as f:
            json.dump(dict(record.stamp(dev.type), device=dev.type, counted_by="set_sync_debug_mode('warn')",
                           results=results, failed=failed), f, indent=1, default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
