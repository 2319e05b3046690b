"""Replaying the sampler's recorded kept sets (spec 13): the time of `gtpo_loss` and `token_logprobs` with
`sampling_mask=(token_ids, offsets)` against the same calls over the whole vocabulary, with the bytes each
must move.

    python -m bench.timing.replay --device cuda --tokens 16384 --vocab 151936   # bench/gpu_check.sh step 7
    python -m bench.timing.replay --device cpu --tokens 64 --vocab 512 --rounds 1 --warmup 0   # a smoke run:
                                   # the Triton kernels in the interpreter, times meaningless

The problem (`problem`): B completions of T = min(512, tokens / 8) positions in groups of 8, logits
(B, T + 1, V) in bf16 (the last row predicts nothing), about 10% of positions masked out, advantages
normalized in each group, conflict weights 1 (per-token numbers: the kernels' work does not depend on
them). Each row of the logits is peaked: about 97% of its mass on a head of h ids (h log-uniform in
[16, 512], the row's sampled id among them, each head logit spread by N(0, 0.5)) over N(0, 1) noise on
the rest of the vocabulary. The kept sets are drawn as a sampler with top_k = 512 and top_p = 0.95 keeps
them (gtpo_kernels.kernels.kept_set.kept_sets: vLLM's order) and passed as recorded sets: tens to
hundreds of ids per token (their quantiles are in the JSON). The loss is the GTPO preset with its
entropy filter off (entropy_threshold=None): these heads' entropies (a few nats) are above its ln 2, and
a filtered batch has no gradient to compute. Before timing, the replayed log-probs and entropies of a
sample of tokens are checked against float64 over the same sets.

Timed in interleaved rounds (bench.timing.runner): `gtpo_loss` forward + backward (the gradient w.r.t.
the logits) and `token_logprobs` (forward only), each over the whole vocabulary and replaying the sets
(validating the mask, and with validate=False). Bytes each call must move, counting each byte once
(M counted tokens, K kept ids in all, L = B (T + 1) V logits of e bytes):
- full vocabulary: forward reads M V e; forward + backward reads it twice and writes the whole gradient L e;
- replay: forward reads K (8 + e) (the kept ids and their logits); forward + backward reads them twice
  and writes the gradient, which is dense: L e (its zeros) + K e (the kept entries). `sector_bytes`
  counts each gathered logit (and kept gradient entry) as the 32-byte sector a scattered access moves.
Per-token O(M) traffic (offsets, statistics, outputs) is left out of both. Writes replay-<device>-*.json
and latest-replay-<device>.json into --out (default bench/out/).
"""
from __future__ import annotations

import argparse
import math
import os
import time

import torch

from ..common import record
from . import runner
# .inputs imports gtpo_kernels (and so triton): imported in problem(), after main has set the interpreter

TOP_K, TOP_P = 512, 0.95
RULES = dict(top_k=TOP_K, top_p=TOP_P)  # the rows that rebuild the sets in the call (--rules)
HEAD = (16, 512)  # head sizes, log-uniform
HEAD_MASS = 0.97  # the head's share of each row's probability
SECTOR = 32  # bytes a scattered global access moves
CHECK_TOKENS = 64  # tokens checked against float64 before timing


def problem(tokens, V, dtype=torch.bfloat16, device="cpu", seed=0, head=HEAD):
    """The batch of the docstring, built one completion at a time (no float32 copy of the whole logits)."""
    from .inputs import G, T_MAX, Inputs
    T = max(1, min(T_MAX, tokens // G))
    B = max(G, tokens // T) // G * G
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=gen, device=dev)
    lengths = T - (0.2 * T * torch.rand(B, generator=gen, device=dev)).long()
    mask = torch.arange(T, device=dev)[None, :] < lengths[:, None]
    ids = torch.where(mask, ids, torch.zeros_like(ids))
    rewards = torch.rand(B // G, G, generator=gen, device=dev)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).reshape(B)
    lo, hi = math.log(head[0]), math.log(min(head[1], max(head[0], V // 4)))
    logits = torch.empty(B, T + 1, V, dtype=dtype, device=dev)
    for i in range(B):
        row = torch.randn(T + 1, V, generator=gen, device=dev)
        h = torch.exp(lo + (hi - lo) * torch.rand(T + 1, generator=gen, device=dev)).long().clamp(1, V)
        hid = torch.randint(0, V, (T + 1, int(h.max())), generator=gen, device=dev)
        hid[:T, 0] = ids[i]  # the sampled id is in its row's head
        # h head logits of about equal size carry HEAD_MASS against the noise's ~V e^(1/2)
        bump = math.log(HEAD_MASS / (1 - HEAD_MASS)) + math.log(V) + 0.5 - 0.125 - torch.log(h.float())
        val = bump[:, None] + 0.5 * torch.randn(hid.shape, generator=gen, device=dev)
        val = torch.where(torch.arange(hid.shape[1], device=dev)[None, :] < h[:, None], val,
                          torch.full_like(val, float("-inf")))
        logits[i] = row.scatter_reduce_(1, hid, val, reduce="amax").to(dtype)
    ones = torch.ones(B, T, device=dev)
    return Inputs(logits.requires_grad_(), ids, mask, adv.float(), ones, torch.ones(B, device=dev), B * T, V)


def kept_sets_of(inp, top_k=TOP_K, top_p=TOP_P):
    """(token_ids, offsets) of the counted tokens (row-major), as the sampler keeps them."""
    from gtpo_kernels.kernels.kept_set import kept_sets
    rows_b, rows_t = inp.mask.nonzero(as_tuple=True)
    y = inp.ids[rows_b, rows_t]
    ids, offsets, restored, _, mass = kept_sets(inp.logits.detach(), rows_b, rows_t, y, 1.0, top_k=top_k,
                                                top_p=top_p)
    return ids, offsets, dict(restored=int(restored.sum()), kept_mass=float(mass.float().mean()))


def check(inp, mask, n=CHECK_TOKENS):
    """Worst error of token_logprobs' replayed log-probs and entropies over the first n counted tokens
    against float64 over the same kept sets."""
    from gtpo_kernels import token_logprobs
    ids, offsets = mask
    with torch.no_grad():
        logps, ent = token_logprobs(inp.logits, inp.ids, completion_mask=inp.mask, logits_start=0,
                                    sampling_mask=mask, backend="triton")
        rows_b, rows_t = inp.mask.nonzero(as_tuple=True)
        err = dict(logp=0.0, entropy=0.0, tokens=min(n, rows_b.numel()))
        for m in range(err["tokens"]):
            b, t = int(rows_b[m]), int(rows_t[m])
            kept = ids[int(offsets[m]):int(offsets[m + 1])]
            lp = torch.log_softmax(inp.logits[b, t, kept].double(), -1)
            ref_lp = lp[(kept == inp.ids[b, t]).nonzero()[0, 0]]
            ref_h = -(lp.exp() * lp).sum()
            err["logp"] = max(err["logp"], abs(float(logps[b, t]) - float(ref_lp)) / max(1.0, abs(float(ref_lp))))
            err["entropy"] = max(err["entropy"], abs(float(ent[b, t]) - float(ref_h)) / max(1.0, abs(float(ref_h))))
    return err


def traffic(inp, K):
    """{call: (bytes, sector_bytes)}: what each timed call must move (the docstring's model; the rules: the
    full vocabulary's bytes plus one read of the counted rows, a floor: the kept sets' kernel reads each row
    once per step of its searches, from L2 where the rows stay there)."""
    e = inp.logits.element_size()
    M, V, L = int(inp.mask.sum()), inp.V, inp.logits.numel()
    fwd = (K * (8 + e), K * (8 + SECTOR))
    return {("loss", "full"): (2 * M * V * e + L * e,) * 2, ("logprobs", "full"): (M * V * e,) * 2,
            ("loss", "replay"): (2 * fwd[0] + L * e + K * e, 2 * fwd[1] + L * e + K * SECTOR),
            ("logprobs", "replay"): fwd, ("loss", "rules"): (3 * M * V * e + L * e,) * 2,
            ("logprobs", "rules"): (2 * M * V * e,) * 2}


def steps(inp, mask, cfg, rules=False):
    """{label: (call, sets, validate, fn)} of the timed calls; rules: the same sets rebuilt by top_k and top_p
    in the calls (kernels/kept_rule_triton.py) as well."""
    from gtpo_kernels import gtpo_loss, token_logprobs
    z = inp.logits

    def loss(**kw):
        return lambda: torch.autograd.grad(gtpo_loss(z, inp.ids, inp.adv, inp.mask, logits_start=0, lam=inp.lam,
                                                     n_conf=inp.n_conf, config=cfg, backend="triton", **kw).loss, z)

    def logprobs(**kw):
        def run():
            with torch.no_grad():
                return token_logprobs(z, inp.ids, completion_mask=inp.mask, logits_start=0, backend="triton", **kw)
        return run
    return {"gtpo_loss full vocabulary": ("loss", "full", True, loss()),
            "gtpo_loss replay": ("loss", "replay", True, loss(sampling_mask=mask)),
            "gtpo_loss replay, validate=False": ("loss", "replay", False, loss(sampling_mask=mask, validate=False)),
            "token_logprobs full vocabulary": ("logprobs", "full", True, logprobs()),
            "token_logprobs replay": ("logprobs", "replay", True, logprobs(sampling_mask=mask)),
            "token_logprobs replay, validate=False": ("logprobs", "replay", False,
                                                      logprobs(sampling_mask=mask, validate=False)),
            **({"gtpo_loss rules, validate=False": ("loss", "rules", False, loss(validate=False, **RULES)),
                "token_logprobs rules, validate=False": ("logprobs", "rules", False,
                                                         logprobs(validate=False, **RULES))} if rules else {})}


def rules_check(inp, mask):
    """Worst absolute difference of token_logprobs' log-probs and entropies with the sets rebuilt by the
    rules in the call against the same sets recorded (rebuilt by torch's sort: kernels/kept_set.py), over the
    counted tokens, and the number of tokens that differ at all."""
    from gtpo_kernels import token_logprobs
    kw = dict(completion_mask=inp.mask, logits_start=0, backend="triton")
    with torch.no_grad():
        a = token_logprobs(inp.logits, inp.ids, sampling_mask=mask, **kw)
        b = token_logprobs(inp.logits, inp.ids, **RULES, **kw)
    m = inp.mask
    d_lp, d_h = (a[0] - b[0])[m].abs(), (a[1] - b[1])[m].abs()
    return dict(logp=float(d_lp.max()), entropy=float(d_h.max()), tokens_differing=int(((d_lp > 0) | (d_h > 0)).sum()))


def run(tokens, V, device, dtype=torch.bfloat16, rounds=10, warmup=2, seed=0, log=print, rules=False):
    """The measurement: a dict for record.write_json (rows, set sizes, check, load); rules: the calls that
    rebuild the sets by top_k and top_p too, and their check against the recorded sets."""
    from gtpo_kernels import GTPOConfig
    cfg = GTPOConfig(entropy_threshold=None)
    t0 = time.perf_counter()
    inp = problem(tokens, V, dtype, device, seed)
    ids, offsets, kept_info = kept_sets_of(inp)
    mask = (ids, offsets)
    sizes = (offsets[1:] - offsets[:-1]).float().cpu()
    K = int(offsets[-1])
    q = torch.quantile(sizes, torch.tensor([0.1, 0.5, 0.9]))
    sets = dict(top_k=TOP_K, top_p=TOP_P, head=list(HEAD), head_mass=HEAD_MASS, kept_ids=K,
                mean=float(sizes.mean()), p10=float(q[0]), p50=float(q[1]), p90=float(q[2]), max=int(sizes.max()),
                **kept_info)
    log(f"{tokens} x {V} {str(dtype).replace('torch.', '')} on {device}: kept sets mean {sets['mean']:.1f} ids "
        f"(p10 {sets['p10']:.0f}, median {sets['p50']:.0f}, p90 {sets['p90']:.0f}, max {sets['max']}), "
        f"kept mass {sets['kept_mass']:.3f}; set-up {time.perf_counter() - t0:.1f} s")
    err = check(inp, mask)
    log(f"replayed log-probs / entropies against float64 on {err['tokens']} tokens: {err['logp']:.1e} / "
        f"{err['entropy']:.1e} (worst relative error)")
    if rules:
        err["rules"] = rules_check(inp, mask)
        log(f"the sets rebuilt in the call against the recorded ones: log-probs {err['rules']['logp']:.1e}, "
            f"entropies {err['rules']['entropy']:.1e} apart at most, {err['rules']['tokens_differing']} tokens differ")
    todo = steps(inp, mask, cfg, rules)
    before = runner.load_snapshot(settle=False)
    errors = {}
    times = runner.interleaved({k: v[3] for k, v in todo.items()}, rounds, warmup, device,
                               on_error=lambda k, e: errors.setdefault(k, f"{type(e).__name__}: {e}"[:300]))
    load = runner.load_record(before, runner.load_snapshot(settle=False))
    moved = traffic(inp, K)
    rows = []
    for label, (call, kind, validate, _) in todo.items():
        row = dict(label=label, call=call, sets=kind, validate=validate)
        if label in errors:
            rows.append(dict(row, status="error", error=errors[label]))
            continue
        s = runner.summary(times[label])
        b, b_sec = moved[(call, kind)]
        row.update(status="ok", time_ms=s, bytes=b, sector_bytes=b_sec, gbps=b / s["median"] / 1e6,
                   sector_gbps=b_sec / s["median"] / 1e6)
        full = f"{'gtpo_loss' if call == 'loss' else 'token_logprobs'} full vocabulary"
        if kind in ("replay", "rules") and full in times:
            row["vs_full"] = runner.per_round_ratio(times[label], times[full])
            row["vs_full"]["unreliable"] = runner.unreliable(row["vs_full"], load)
        rows.append(row)
        vs = f", {row['vs_full']['median']:.3f}x the full call" if "vs_full" in row else ""
        log(f"  {label:<40} {s['median']:9.3f} ms ({s['min']:.3f}-{s['max']:.3f}){vs}; {_mb(b)} "
            f"({_mb(b_sec)} in 32-byte sectors): {row['gbps']:.1f} GB/s")
    return dict(device=device, tokens=inp.tokens, B=inp.B, T=inp.T, V=V, dtype=str(dtype).replace("torch.", ""),
                counted=int(inp.mask.sum()),
                rounds=rounds, warmup=warmup, sets=sets, check=err, rows=rows, load=load,
                interpreted=device == "cpu", seconds=time.perf_counter() - t0)


def _mb(b):
    return f"{b / 1e6:,.1f} MB"


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.timing.replay", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rules", action="store_true", help="time the calls that rebuild the sets from top_k and "
                                                           "top_p too, and check them against the recorded sets")
    ap.add_argument("--out", default=None, help="folder of the JSON (default bench/out/; bench/results/ only "
                                                 "from a clean tree)")
    a = ap.parse_args(argv)
    if a.device == "cpu":  # the Triton kernels run in the interpreter: a smoke run, its times mean nothing
        os.environ.setdefault("TRITON_INTERPRET", "1")
    out = a.out or record.SCRATCH
    record.require_clean(out)
    res = run(a.tokens, a.vocab, a.device, getattr(torch, a.dtype), a.rounds, a.warmup, rules=a.rules)
    path = record.write_json(res, out, prefix="replay-")
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
