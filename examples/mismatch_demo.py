"""The rollout/training mismatch, measured (spec 14): a sampler and a trainer that share the same weights,
and what their log-probs of the same tokens differ by, with the head's three settings.

    python examples/mismatch_demo.py              # about a minute on a CPU; prints a table
    python examples/mismatch_demo.py --vocab 32000 --dim 512 --completions 16 --tokens 24

The policy: a one-layer recurrent cell (float32) feeding bfloat16 hidden states to a bfloat16 LM head, as
a trained LLM's last layers would. The sampler (a stand-in for an inference engine) draws `--completions`
completions token by token, all of them in flight at once, computing its head in float32 from the
bfloat16 weights (vLLM's head_dtype=float32) and keeping the log-prob of each drawn token; it is run twice
with the same seed with every completion in flight and with three at a time (does it draw the same
tokens?), and scores its own tokens with three rows per GEMM (do its log-probs depend on its batch?). The trainer then computes, as trainers
do, the old-policy log-probs with `linear_token_logprobs` in micro-batches of 4 completions, and the update
pass with `linear_gtpo_loss` in micro-batches of 2 and tiles of at most 5 rows, passing the sampler's log-probs as `rollout_logps`; it
reports `metrics["rollout_*"]` (the update pass against the sampler) and `rollout_mismatch(update,
old)` (the trainer against itself on identical weights), for the default head, batch_invariant=True,
head_dtype=torch.float32, and both.
"""
from __future__ import annotations

import argparse

import torch

from gtpo_kernels import linear_gtpo_loss, linear_token_logprobs, rollout_mismatch


class Policy:
    def __init__(self, V, D, seed):
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.randn(V, D, generator=g) * 0.5
        self.A = torch.randn(D, D, generator=g) / D ** 0.5
        self.W = (torch.randn(V, D, generator=g) * 0.07).bfloat16()  # the LM head, bfloat16

    def step(self, state, tok):
        """The next hidden state (float32) and the bfloat16 hidden row the head reads."""
        state = torch.tanh(self.emb[tok] + state @ self.A)
        return state, state.bfloat16()


def sample(pol, n, T, in_flight, seed):
    """(completion ids (n, T), the sampler's log-probs (n, T), hidden rows (n, T, D) bf16): `in_flight`
    completions decoded together (one GEMM of that many rows per step), float32 head, temperature 1."""
    g = torch.Generator().manual_seed(seed)
    D = pol.A.shape[0]
    draws = torch.rand(n, T, generator=g)  # one uniform per token: the same tokens whatever the batching
    ids, lps, hs = torch.zeros(n, T, dtype=torch.long), torch.zeros(n, T), torch.zeros(n, T, D, dtype=torch.bfloat16)
    for c0 in range(0, n, in_flight):
        rows = slice(c0, min(n, c0 + in_flight))
        k = rows.stop - rows.start
        state, tok = torch.zeros(k, D), torch.zeros(k, dtype=torch.long)
        for t in range(T):
            state, h = pol.step(state, tok)
            logp = torch.log_softmax(h.float() @ pol.W.float().t(), -1)  # the engine's float32 head
            cdf = logp.exp().cumsum(-1)
            tok = torch.searchsorted(cdf, (draws[rows, t] * cdf[:, -1])[:, None])[:, 0].clamp(max=cdf.shape[1] - 1)
            ids[rows, t], lps[rows, t], hs[rows, t] = tok, logp.gather(-1, tok[:, None])[:, 0], h
    return ids, lps, hs


def score(pol, ids, hs, rows):
    """The sampler's float32 head on recorded hidden rows, `rows` completions per GEMM -> log-probs of ids."""
    out = torch.zeros(ids.shape)
    for c0 in range(0, ids.shape[0], rows):
        for t in range(ids.shape[1]):
            logp = torch.log_softmax(hs[c0:c0 + rows, t].float() @ pol.W.float().t(), -1)
            out[c0:c0 + rows, t] = logp.gather(-1, ids[c0:c0 + rows, t, None])[:, 0]
    return out


def trainer(pol, ids, hs, engine_lp, adv, **head):
    """Old-policy log-probs in micro-batches of 4 (tiles of every row), the update pass in micro-batches of 2
    with tiles of at most 5 rows -> (metrics of the update pass against the sampler, the update pass against the
    old-policy pass)."""
    n = ids.shape[0]
    old = torch.cat([linear_token_logprobs(hs[i:i + 4], pol.W, ids[i:i + 4], **head)[0] for i in range(0, n, 4)])
    new, met = [], []
    V = pol.W.shape[0]
    for i in range(0, n, 2):  # a smaller tile, as a pass with gradients gets: 5 rows of float32 logits and gradient
        out = linear_gtpo_loss(hs[i:i + 2], pol.W, ids[i:i + 2], adv[i:i + 2], config="grpo", old_logps=old[i:i + 2],
                               rollout_logps=engine_lp[i:i + 2], memory_budget=5 * V * 8, **head)
        new.append(out.logps)
        met.append(out.metrics)
    w = 1.0 / len(met)  # equal micro-batches: the mean of their means (the max of their maxima)
    vs_engine = {k: (max(float(m[k]) for m in met) if k == "rollout_max_abs_diff" else sum(float(m[k]) * w for m in met))
                 for k in ("rollout_k3", "rollout_abs_diff", "rollout_max_abs_diff", "rollout_outside_frac")}
    vs_old = {k: float(v) for k, v in rollout_mismatch(torch.cat(new), old).items()}
    return vs_engine, vs_old


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=32000, help="V, the LM head's rows (default: 32000)")
    p.add_argument("--dim", type=int, default=512, help="D, the hidden size (default: 512)")
    p.add_argument("--completions", type=int, default=16, help="completions in the batch (default: 16)")
    p.add_argument("--tokens", type=int, default=24, help="tokens per completion (default: 24)")
    p.add_argument("--seed", type=int, default=0, help="the random inputs' seed (default: 0)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch's CPU threads (default: torch's own; a GEMM's rounding may depend on it)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    pol = Policy(a.vocab, a.dim, a.seed)
    n, T = a.completions, a.tokens
    print(f"policy: V = {a.vocab}, D = {a.dim}, bfloat16 head; {n} completions x {T} tokens; torch "
          f"{torch.__version__}, {torch.get_num_threads()} CPU threads", flush=True)
    ids, lp_all, hs = sample(pol, n, T, n, a.seed + 1)
    ids3, _, _ = sample(pol, n, T, 3, a.seed + 1)
    first = [int((ids[i] != ids3[i]).nonzero()[0, 0]) if (ids[i] != ids3[i]).any() else T for i in range(n)]
    print(f"the sampler again, same seed, 3 completions in flight instead of {n}: "
          f"{sum(f < T for f in first)} of {n} completions drew another token somewhere "
          f"(first at step {min(first)})" if min(first) < T else
          f"the sampler again, same seed, 3 completions in flight instead of {n}: the same tokens")
    lp3 = score(pol, ids, hs, 3)
    d = (lp_all.double() - lp3.double()).abs()
    print(f"the sampler scoring its own tokens with 3 rows per GEMM instead of {n}: max |d logp| = "
          f"{float(d.max()):.3e}, tokens that differ: {float((d > 0).double().mean()):.1%}")
    adv = torch.randn(n, generator=torch.Generator().manual_seed(a.seed + 2))
    print(f"{'trainer head':38s} | vs sampler: {'k3':>9s} {'mean|d|':>9s} {'max|d|':>9s} {'outside':>7s} | "
          f"update vs old: {'max|d|':>9s} {'differ':>7s}")
    for name, head in (("default (bf16 logits)", {}), ("batch_invariant=True", dict(batch_invariant=True)),
                       ("head_dtype=torch.float32", dict(head_dtype=torch.float32)),
                       ("both", dict(batch_invariant=True, head_dtype=torch.float32))):
        ve, vo = trainer(pol, ids, hs, lp_all, adv, **head)
        differ = float((vo["rollout_abs_diff"] > 0))
        print(f"{name:38s} | {'':12s}{ve['rollout_k3']:9.2e} {ve['rollout_abs_diff']:9.2e} "
              f"{ve['rollout_max_abs_diff']:9.2e} {ve['rollout_outside_frac']:7.1%} | {'':15s}"
              f"{vo['rollout_max_abs_diff']:9.2e} {'yes' if differ else 'no':>7s}", flush=True)


if __name__ == "__main__":
    main()
