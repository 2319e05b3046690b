"""The sampler's kept sets over a vocabulary split (spec 12, 13), three inputs that went wrong:
- unvalidated, a sampled id outside [0, V) with top_k gave a finite logp, entropy and loss (no rank owns
  it, so its target term was 0): NaN at that token, as on one process, the other tokens as before;
- a top_k above the vocabulary made each rank gather (rows, top_k) candidates (1.6 GB a rank at 3e6,
  V = 23): they are at most the largest slice wide, the values as with top_k = V;
- a recorded sampling_mask whose token_ids or offsets is a strided int64 view: the Triton kernels read it
  at stride 1 (a false "target id outside [0, V)" on one process, every token NaN on the split head)."""
import torch
import torch.distributed as dist

from gloo import run_ranks_ok

V, D, B, T = 23, 6, 4, 5


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g), torch.randint(0, V, (B, T), generator=g)


def _same(a, b, tol=1e-5):
    return bool(a.shape == b.shape and torch.equal(torch.isnan(a), torch.isnan(b))
                and ((a - b).abs().nan_to_num(0.0) <= tol).all())


def _checks(rank, world):
    from gtpo_kernels import GTPOConfig, linear_gtpo_loss, linear_token_logprobs, token_logprobs
    grp = dist.group.WORLD
    sl = slice(0, 9) if rank == 0 else slice(9, V)
    res = {}
    h, w, ids = _data(5)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    cfg = GTPOConfig(entropy_threshold=None)
    for bad in (V + 2, -1):
        i = ids.clone()
        i[0, 1] = bad
        for backend in ("torch", "triton"):
            out = linear_gtpo_loss(h, w[sl], i, adv, group_size=2, config=cfg, backend=backend, process_group=grp,
                                   validate=False, top_k=6)
            one = linear_gtpo_loss(h, w, i, adv, group_size=2, config=cfg, backend=backend, validate=False, top_k=6)
            lz, _ = token_logprobs((h @ w.t())[..., sl], i, 1.0, backend=backend, process_group=grp, validate=False,
                                   top_k=6)
            lone, _ = token_logprobs(h @ w.t(), i, 1.0, backend=backend, validate=False, top_k=6)
            res[f"bad id {bad} {backend}"] = (
                bool(torch.isnan(out.logps[0, 1]) and torch.isnan(out.entropy[0, 1]) and torch.isnan(out.loss))
                and int(torch.isnan(out.logps).sum()) == 1 and _same(out.logps, one.logps)
                and _same(lz, lone) and int(torch.isnan(lz).sum()) == 1)
    # a top_k above the vocabulary: the gathered candidates at most the largest slice wide
    widths = []
    real = dist.all_gather

    def gather(tensors, tensor, *a, **k):
        widths.append(tensor.shape[-1] if tensor.dim() == 2 else 0)
        return real(tensors, tensor, *a, **k)
    dist.all_gather = gather
    try:
        for k in (V, 10 ** 7):
            lp, en = linear_token_logprobs(h, w[sl], ids, 0.8, top_k=k, top_p=0.9, memory_budget=4096,
                                           process_group=grp)
            res[f"top_k {k}"] = (lp, en)
    finally:
        dist.all_gather = real
    one, _ = linear_token_logprobs(h, w, ids, 0.8, top_k=V, top_p=0.9, memory_budget=4096)
    res["top_k above V"] = (_same(res["top_k 10000000"][0], res[f"top_k {V}"][0], 0)
                            and _same(res[f"top_k {V}"][0], one) and max(widths) <= 14)
    res["widths"] = max(widths)
    # a recorded set as strided int64 views
    z = h @ w.t()
    sets = [sorted(set(torch.topk(z[b, t], 6).indices.tolist()) | {int(ids[b, t])}) for b in range(B) for t in range(T)]
    tid = torch.tensor([x for s in sets for x in s])
    off = torch.tensor([0] + [len(s) for s in sets]).cumsum(0)
    strided_t, strided_o = torch.stack([tid, tid], 1)[:, 0], torch.stack([off, off], 1)[:, 0]
    assert strided_t.stride() == (2,) and torch.equal(strided_t, tid)
    for backend in ("torch", "triton"):
        good, _ = linear_token_logprobs(h, w, ids, 1.0, sampling_mask=(tid, off), backend=backend)
        assert torch.isfinite(good).all()
        for name, mask in (("ids", (strided_t, off)), ("offsets", (tid, strided_o))):
            one, _ = linear_token_logprobs(h, w, ids, 1.0, sampling_mask=mask, backend=backend)
            split, _ = linear_token_logprobs(h, w[sl], ids, 1.0, sampling_mask=mask, backend=backend,
                                             process_group=grp)
            lz, _ = token_logprobs(z[..., sl], ids, 1.0, sampling_mask=mask, backend=backend, process_group=grp)
            res[f"strided {name} {backend}"] = _same(one, good, 0) and _same(split, good) and _same(lz, good)
    return {k: v for k, v in res.items() if not k.startswith("top_k 1") and not k.startswith(f"top_k {V}")}


def test_replay_inputs_over_a_split():
    for r, res in enumerate(run_ranks_ok(_checks, 2)):
        widths = res.pop("widths")
        assert all(v is True for v in res.values()), (r, widths, res)
