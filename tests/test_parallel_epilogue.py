"""Vocabulary-parallel logits where the epilogue kernel finishes the merge itself (spec 8, 12;
pipeline/epilogue_attached.py): the merged sums go straight into the epilogue, which forms each token's logp,
H and flags and the backward's statistics in its first pass. On 2 gloo ranks (V = 37 split 20 / 17, not at
VOCAB_BLOCK: the all-reduce merge), the Triton backend under the interpreter, against one process on the whole
vocabulary: clip_cov and kl_cov (the epilogue runs twice around their sort, each finishing the merge), with
the top-entropy mask too, loss_agg='none' (a gradient per token), conflict weights computed in the call,
packed (rollout weights and a temperature per completion too, validated or not); a NaN logit in one rank's slice gives NaN at its token on every rank, unvalidated, and the same
error on every rank, validated; the top-entropy mask alone (its key reads H before the epilogue: the merge's
own finish runs, `vp_forward`) too."""
import torch
import torch.distributed as dist

from gloo import rel_nan as _rel, run_ranks_ok
from gtpo_kernels import GTPOConfig, gtpo_loss

SIZES = [20, 17]
CONFIGS = {
    "clip-cov": GTPOConfig.preset("clip-cov", clip_cov_ratio=0.2),
    "clip-cov+top-entropy": GTPOConfig.preset("clip-cov", clip_cov_ratio=0.2, top_entropy_quantile=0.5),
    "kl-cov": GTPOConfig.preset("kl-cov", kl_cov_ratio=0.2),
    "grpo-none": GTPOConfig.preset("grpo", loss_agg="none", beta=0.04),
    "gtpo-weights": GTPOConfig(entropy_threshold=3.2, entropy_coef=0.01),
    "dapo-top-entropy": GTPOConfig.preset("dapo", top_entropy_quantile=0.5),
}
PACKED = ("clip-cov+top-entropy", "grpo-none")


def _case(packed):
    g = torch.Generator().manual_seed(11)
    B, T, V = 4, 5, 37
    x = torch.randn(B, T, V, generator=g) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[1, :3] = ids[0, :3]  # shared prefixes: conflict tokens
    ids[3, 2:] = ids[2, 2:]
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[3, 4] = False
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    old = -torch.rand(B, T, generator=g) * 3 - 1.5
    if not packed:
        return x, ids, mask, adv, old, {}
    keep = mask.reshape(-1)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(1).cumsum(0)])
    return (x.reshape(B * T, V)[keep], ids.reshape(-1)[keep], None, adv, old.reshape(-1)[keep],
            dict(cu_seqlens=cu, max_seqlen=T))


def _call(x, ids, adv, mask, old, cfg, kw, **more):
    torch.manual_seed(5)  # clip_cov's draws: the same in both calls
    out = gtpo_loss(x, ids, adv, mask, group_size=2, old_logps=old, ref_logps=old + 0.1, config=cfg,
                    backend="triton", **kw, **more)
    (out.loss.sum() if cfg.loss_agg == "none" else out.loss).backward()
    return out


def _ranks(rank, world):
    sl = slice(sum(SIZES[:rank]), sum(SIZES[:rank + 1]))
    errs = {}
    for packed in (False, True):
        for name, cfg in CONFIGS.items():
            if packed and name not in PACKED:
                continue  # CI time: the packed form with two of them
            x, ids, mask, adv, old, kw = _case(packed)
            full = x.clone().requires_grad_()
            one = _call(full, ids, adv, mask, old, cfg, kw)
            part = x[..., sl].clone().requires_grad_()
            out = _call(part, ids, adv, mask, old, cfg, kw, process_group=dist.group.WORLD)
            e = {f: _rel(getattr(out, f), getattr(one, f)) for f in ("loss", "logps", "entropy", "per_token_loss",
                                                                       "lam", "seq_entropy")}
            e["metrics"] = max(_rel(out.metrics[k], v) for k, v in one.metrics.items())
            ref = full.grad[..., sl].double()
            e["grad"] = float((part.grad.double() - ref).norm() / ref.norm())
            e["grad_norm"] = float(ref.norm())
            e["value"] = out.loss.detach().sum().item()
            errs[f"{'packed' if packed else 'padded'}/{name}"] = e
    # per completion, packed (completions of 5, 5, 5 and 4 tokens): rollout weights and a temperature, each
    # read at its token's completion in the given cu_seqlens by the agreement's row and the merge's kernels
    x, ids, mask, adv, old, kw = _case(True)
    g = torch.Generator().manual_seed(3)
    seq = dict(rollout_is_weights=torch.rand(4, 1, generator=g) + 0.5, temperature=torch.rand(4, generator=g) + 0.5)
    strided = dict(kw, cu_seqlens=torch.stack([kw["cu_seqlens"], kw["cu_seqlens"]], 1)[:, 0])  # (a strided view)
    for validate, name, how in ((True, "grpo-none", kw), (False, "grpo-none", kw), (False, "dapo-top-entropy", kw),
                                (False, "grpo-none", strided)):
        full = x.clone().requires_grad_()  # (the top-entropy mask's key reads H first: the tau spread for it)
        one = _call(full, ids, adv, mask, old, CONFIGS[name], kw, **seq)
        part = x[..., sl].clone().requires_grad_()
        out = _call(part, ids, adv, mask, old, CONFIGS[name], how, process_group=dist.group.WORLD,
                    validate=validate, **seq)
        e = {f: _rel(getattr(out, f), getattr(one, f)) for f in ("loss", "logps", "entropy", "per_token_loss")}
        ref = full.grad[..., sl].double()
        e.update(grad=float((part.grad.double() - ref).norm() / ref.norm()), grad_norm=float(ref.norm()),
                 value=out.loss.detach().sum().item())
        errs[f"packed/per completion, {name}, validate={validate}{', strided' if how is strided else ''}"] = e
    # a NaN logit in rank 0's slice: NaN at its token on every rank (unvalidated), the same error (validated)
    x, ids, mask, adv, old, kw = _case(False)
    x[2, 1, 3] = float("nan")
    out = gtpo_loss(x[..., sl].clone(), ids, adv, mask, group_size=2, config=CONFIGS["clip-cov"], backend="triton",
                    validate=False, process_group=dist.group.WORLD)
    nan_at = torch.isnan(out.logps).nonzero().tolist()
    try:
        gtpo_loss(x[..., sl].clone(), ids, adv, mask, group_size=2, config="grpo", backend="triton",
                  process_group=dist.group.WORLD)
        raised = None
    except ValueError as err:
        raised = str(err)
    return {"errs": errs, "nan_at": nan_at, "nan_loss": bool(torch.isnan(out.loss)), "raised": raised}


def test_the_epilogue_finishes_the_merge_as_one_process():
    results = run_ranks_ok(_ranks, 2)
    for r, res in enumerate(results):
        for key, e in res["errs"].items():
            for f, v in e.items():
                if f not in ("grad", "grad_norm", "value"):
                    assert v <= 1e-5, (r, key, f, v)  # spec 6: float32 logits
            assert e["grad_norm"] > 0, (r, key, "the single-process gradient is all zero on this slice")
            assert e["grad"] <= 1e-5, (r, key, e["grad"])
            assert e["value"] == results[0]["errs"][key]["value"], (r, key)  # identical on every rank
        assert res["nan_at"] == [[2, 1]] and res["nan_loss"], (r, res["nan_at"])
        assert res["raised"] is not None and "(2, 1)" in res["raised"], (r, res["raised"])
        assert res["raised"] == results[0]["raised"], r
