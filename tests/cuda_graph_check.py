"""CUDA-graph capture and replay of every call spec 8 says can be captured, each replay equal to the eager
call on the same inputs (run by bench/gpu_check.sh).

The calls (validate=False unless named; forward + backward, the gradient w.r.t. the logits among the
outputs; token_logprobs forward only):
  - gtpo_loss with every preset of GTPOConfig (dro with dro_beta=0.1), off-policy (old_logps given),
    conflict weights computed in the call (group_size=4), padded and packed (cu_seqlens, max_seqlen);
  - grpo with beta and ref_logps; a per-completion temperature tensor; validate=True (its checks are
    skipped inside a capture); top_k = 5 rebuilt from the logits;
  - replaying recorded kept sets (sampling_mask=(token_ids, offsets)), padded and packed, and sets rebuilt by
    top_k / top_p / min_p in the call (the kept sets' kernel);
  - token_logprobs, padded and packed, over the whole vocabulary and over the recorded sets.
Each call: two warm-up calls on a side stream (they compile), one capture, then new values copied into the
captured inputs (logits, advantages, old / ref log-probs, temperature: the same ids, mask and kept sets),
one replay, and the eager call on copies of the same values. Every output (loss, per-token values,
metrics, gradient) must match: values within 1e-5 relative, the 16-bit gradient within 1e-2 of its norm
(in practice the replay runs the same kernels: the line says when every output is bitwise equal). The
random draw of clip_cov uses the default CUDA generator, seeded alike before the replay and the eager call.

Prints one PASS / FAIL line per call and exits 1 when any fails. Without CUDA it prints that it skipped and
exits 0; --dry-run then runs the same calls eagerly twice on the CPU (Triton's interpreter, tiny sizes: the
call list, the inputs and the comparison, not the capture). --out DIR writes DIR/cuda_graph_check.json
(stamped with the tree, bench.common.record), rewritten after each call. --only SUBSTRING runs the calls
whose names contain it.
    python tests/cuda_graph_check.py [--dry-run] [--out DIR] [--only NAME]
"""
import json
import math
import os
import sys
import time

DRY = "--dry-run" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's package and bench/, whatever is installed

import torch  # noqa: E402

SEED = 1234  # the default generators' seed before each replay and eager call (clip_cov's draw)
VALUE_TOL, GRAD_TOL = 1e-5, 1e-2


def batch(dev, packed, sets=False):
    """Structure (ids, mask or cu_seqlens, kept sets) fixed; values(seed) -> the float inputs."""
    if dev.type == "cuda":
        B, T, V, dtype = 8, 64, 4096, torch.bfloat16
    else:
        B, T, V, dtype = 8, 6, 24, torch.float32
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    s = dict(B=B, T=T, V=V, dtype=dtype, packed=packed, ids_bt=ids)
    if packed:
        lengths = mask.sum(1)
        keep = mask.reshape(-1)
        s.update(ids=ids.reshape(-1)[keep].to(dev), mask=None, keep=keep.to(dev), N=int(keep.sum()),
                 cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(dev),
                 max_seqlen=int(lengths.max()))
        counted_ids = ids.reshape(-1)[keep]
    else:
        s.update(ids=ids.to(dev), mask=mask.to(dev))
        counted_ids = ids[mask]
    if sets:  # each counted token's kept set: its id and up to 7 other distinct ids, in the packed order
        tids, offs = [], [0]
        for y in counted_ids.tolist():
            k = int(torch.randint(1, 9, (1,), generator=g))
            others = torch.randperm(V, generator=g)[:k]
            kept = torch.unique(torch.cat([torch.tensor([y]), others]))
            tids.append(kept[torch.randperm(kept.numel(), generator=g)])
            offs.append(offs[-1] + kept.numel())
        s["sampling_mask"] = (torch.cat(tids).to(dev), torch.tensor(offs, dtype=torch.int64).to(dev))
    return s


def values(s, dev, seed):
    """The float inputs of structure s drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    B, T, V = s["B"], s["T"], s["V"]
    logits = torch.randn(B, T, V, generator=g)
    # each completion's sampled ids stand out by its own margin: some confident (kept by GTPO's entropy
    # filter), some not (dropped), so the filter, the conflict weights and the clip all have work
    margin = math.log(V) + torch.empty(B, 1).uniform_(0.0, 10.0, generator=g)
    logits.scatter_add_(-1, s["ids_bt"][..., None], margin.expand(B, T)[..., None])
    logp = torch.log_softmax(logits, -1).gather(-1, s["ids_bt"][..., None])[..., 0]
    old = logp + torch.randn(B, T, generator=g) * 0.1
    ref = logp + torch.randn(B, T, generator=g) * 0.1
    v = dict(logits=logits, adv=torch.randn(B, generator=g), old=old, ref=ref,
             tau=torch.rand(B, 1, generator=g) * 0.5 + 0.6)
    if s["packed"]:
        keep = s["keep"].cpu()
        v.update(logits=logits.reshape(B * T, V)[keep], old=old.reshape(-1)[keep], ref=ref.reshape(-1)[keep])
    out = {k: x.to(dev) for k, x in v.items()}
    out["logits"] = out["logits"].to(s["dtype"]).requires_grad_()
    return out


def loss_call(config, extras=(), **kw):
    """fn(s, v) -> outputs of gtpo_loss forward + backward."""
    def fn(s, v):
        from gtpo_kernels import gtpo_loss
        a = dict(old_logps=v["old"], group_size=4, config=config, validate=False, backend="triton")
        if "ref" in extras:
            a["ref_logps"] = v["ref"]
        if "tau" in extras:
            a["temperature"] = v["tau"]
        if "sets" in extras:
            a["sampling_mask"] = s["sampling_mask"]
        if s["packed"]:
            a.update(cu_seqlens=s["cu_seqlens"], max_seqlen=s["max_seqlen"])
        a.update(kw)
        out = gtpo_loss(v["logits"], s["ids"], v["adv"], s["mask"], **a)
        grad, = torch.autograd.grad(out.loss, v["logits"])
        metrics = {f"metric {k}": m for k, m in sorted(out.metrics.items()) if isinstance(m, torch.Tensor)}
        return dict(loss=out.loss, logps=out.logps, entropy=out.entropy, grad=grad, **metrics)
    return fn


def logprobs_call(sets=False, **rules):
    def fn(s, v):
        from gtpo_kernels import token_logprobs
        a = dict(validate=False, backend="triton", **rules)
        if sets:
            a["sampling_mask"] = s["sampling_mask"]
        if s["packed"]:
            a.update(cu_seqlens=s["cu_seqlens"], max_seqlen=s["max_seqlen"])
        with torch.no_grad():
            lp, ent = token_logprobs(v["logits"], s["ids"], 0.7, s["mask"], **a)
        return dict(logps=lp, entropy=ent)
    return fn


def calls():
    """[(name, packed, sets, fn)] in the order run: the most used first."""
    from gtpo_kernels import GTPOConfig
    from gtpo_kernels.core.config import PRESETS
    out = []
    first = ["gtpo", "grpo"]
    for preset in first + [p for p in PRESETS if p not in first]:
        cfg = GTPOConfig.preset(preset, dro_beta=0.1) if preset == "dro" else preset
        for packed in (False, True):
            out.append((f"gtpo_loss {preset} {'packed, max_seqlen' if packed else 'padded'}", packed, False,
                        loss_call(cfg)))
        if preset == "grpo":
            out += [("token_logprobs padded", False, False, logprobs_call()),
                    ("token_logprobs packed, max_seqlen", True, False, logprobs_call()),
                    ("gtpo_loss gtpo replay of recorded sets, padded", False, True, loss_call("gtpo", ("sets",))),
                    ("gtpo_loss gtpo replay of recorded sets, packed", True, True, loss_call("gtpo", ("sets",))),
                    ("token_logprobs replay of recorded sets, padded", False, True, logprobs_call(sets=True)),
                    ("token_logprobs replay of recorded sets, packed", True, True, logprobs_call(sets=True)),
                    ("gtpo_loss grpo beta=0.04 with ref_logps, padded", False, False,
                     loss_call(GTPOConfig.preset("grpo", beta=0.04), ("ref",))),
                    ("gtpo_loss gtpo per-completion temperature, padded", False, False, loss_call("gtpo", ("tau",))),
                    ("gtpo_loss gtpo validate=True (checks skipped in a capture), padded", False, False,
                     loss_call("gtpo", validate=True)),
                    ("gtpo_loss gtpo top_k=5 rebuilt, padded", False, False, loss_call("gtpo", top_k=5)),
                    ("gtpo_loss grpo top_k=8, top_p=0.9, min_p=0.02 rebuilt, packed", True, False,
                     loss_call("grpo", top_k=8, top_p=0.9, min_p=0.02)),
                    ("token_logprobs top_k=8, top_p=0.9 rebuilt, packed", True, False,
                     logprobs_call(top_k=8, top_p=0.9))]
    return out


def compare(got, ref):
    """(ok, worst, bitwise, detail) of two output dicts."""
    worst, bitwise, bad = 0.0, True, []
    for k, r in ref.items():
        g = got.get(k)
        if r is None or g is None:
            if (r is None) != (g is None):
                bad.append(f"{k}: one side is None")
            continue
        bitwise &= bool(torch.equal(g, r) or (g.isnan().equal(r.isnan()) and torch.equal(g.nan_to_num(), r.nan_to_num())))
        gd, rd = g.detach().double(), r.detach().double()
        if not torch.equal(gd.isnan(), rd.isnan()):
            bad.append(f"{k}: NaN in different places")
            continue
        gd, rd = gd.nan_to_num(), rd.nan_to_num()
        if k == "grad":
            err = float((gd - rd).norm() / rd.norm().clamp(min=1e-30))
            tol = GRAD_TOL if r.element_size() < 4 else VALUE_TOL
        else:
            err = float(((gd - rd).abs() / rd.abs().clamp(min=1)).max()) if rd.numel() else 0.0
            tol = VALUE_TOL
        worst = max(worst, err)
        if err > tol:
            bad.append(f"{k}: error {err:.1e} > {tol:.0e}")
    return not bad, worst, bitwise, "; ".join(bad)


def _seed(dev):
    torch.manual_seed(SEED)
    if dev.type == "cuda":
        torch.cuda.manual_seed(SEED)


def graph_vs_eager(dev, s, fn):
    """The replay's outputs on new values, and the eager call's on copies of them."""
    static = values(s, dev, 1)
    new = values(s, dev, 2)
    if dev.type == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles, and the allocator's warm-up outside the capture
                fn(s, static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = fn(s, static)
    else:  # --dry-run: the same call, eagerly
        fn(s, static)
    with torch.no_grad():
        for k, x in new.items():
            static[k].copy_(x)
    _seed(dev)
    if dev.type == "cuda":
        graph.replay()
        torch.cuda.synchronize()
    else:
        outs = fn(s, static)
    got = {k: (x.detach().clone() if isinstance(x, torch.Tensor) else x) for k, x in outs.items()}
    eager_in = {k: (x.detach().clone().requires_grad_(x.requires_grad)) for k, x in new.items()}
    _seed(dev)
    ref = fn(s, eager_in)
    return got, ref


def main(argv):
    out_dir = argv[argv.index("--out") + 1] if "--out" in argv else None
    only = argv[argv.index("--only") + 1] if "--only" in argv else None
    if not torch.cuda.is_available() and not DRY:
        print("cuda_graph_check: no CUDA device: skipped (exit 0; --dry-run runs the calls eagerly on the CPU)")
        return 0
    dev = torch.device("cuda" if torch.cuda.is_available() and not DRY else "cpu")
    if dev.type == "cpu":
        print("cuda_graph_check --dry-run: each call eagerly twice on the CPU (interpreter), no capture")
    results, failed, t0 = [], 0, time.perf_counter()
    structures = {}
    for name, packed, sets, fn in calls():
        if only and only not in name:
            continue
        t = time.perf_counter()
        try:
            s = structures.get((packed, sets)) or structures.setdefault((packed, sets), batch(dev, packed, sets))
            got, ref = graph_vs_eager(dev, s, fn)
            ok, worst, bitwise, detail = compare(got, ref)
            line = (f"{'bitwise equal' if bitwise else f'worst error {worst:.1e}'} over {len(ref)} outputs"
                    + (f": {detail}" if detail else ""))
            res = dict(name=name, ok=ok, bitwise=bitwise, worst=worst, outputs=sorted(ref), detail=detail)
        except Exception as e:  # report every call, then fail
            ok, line = False, f"{type(e).__name__}: {str(e)[:300]}"
            res = dict(name=name, ok=False, error=line)
        res["seconds"] = round(time.perf_counter() - t, 2)
        results.append(res)
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}: {line} ({res['seconds']:.1f} s)", flush=True)
        if out_dir:
            _write(out_dir, dev, results, failed, time.perf_counter() - t0)
    print(f"{len(results) - failed} of {len(results)} calls {'replayed' if dev.type == 'cuda' else 'ran'} equal to "
          f"eager ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 1 if failed else 0


_STAMP = {}


def _write(out_dir, dev, results, failed, seconds):
    if not _STAMP:  # once: hashing the tree takes a moment
        from bench.common import record
        _STAMP.update(record.stamp(dev.type))
    os.makedirs(out_dir, exist_ok=True)
    doc = dict(_STAMP, device=dev.type, dry_run=dev.type != "cuda", results=results, failed=failed,
               seconds=round(seconds, 1))
    with open(os.path.join(out_dir, "cuda_graph_check.json"), "w") as f:
        json.dump(doc, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
