"""A vocabulary-parallel loss's first launch (spec 8, 12; kernels/vp_first_triton.py): this rank's forward pass over
its slice runs before the agreement, in one launch with the agreement row's program, and the merge's sums kernel
reads the target logit the forward pass could not (the slice's first id comes with the agreement). On 2 gloo
ranks, Triton under the interpreter, grpo / gtpo / clip_cov, padded and packed, validating and not:

- the same bits as the call whose agreement comes first (every rank alike, each taking either path: a per-rank
  choice that changes no number), and within spec 7 of the single-process call (values 1e-5, gradients 1e-4);
- a slice at a multiple of VOCAB_BLOCK runs the agreement first; where every boundary is one (the block merge)
  but the last rank's slice is not, that rank's pass is spent and the block merge gives the single-process bits;
- a rank whose checks fail does not run the pass, and every rank raises the same error; so too where the first
  launch itself fails on a rank while another runs the agreement first (it was left waiting in the agreement)."""
import os

import pytest
import torch

from conftest import assert_grad_close, assert_value_close
from gloo import run_ranks_ok

CONFIGS = {"grpo": dict(temperature=0.7), "gtpo": dict(entropy_threshold=None), "clip-cov": {}}  # (gtpo: its filter would drop
# every completion of these logits, and the gradient would be 0)


def _inputs(V, packed):
    g = torch.Generator().manual_seed(11)
    B, T = 4, 5
    x = torch.randn(B, T, V, generator=g) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    kw = dict(advantages=torch.linspace(-1.0, 1.0, B), group_size=2, old_logps=-torch.rand(B, T, generator=g) * 3 - 1.5)
    if packed:  # the counted tokens packed, their logits rows alike
        kw.update(cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(1).cumsum(0)]),
                  max_seqlen=int(mask.sum(1).max()), old_logps=kw["old_logps"][mask])
        return x[mask], ids[mask], None, kw
    return x, ids, mask, kw


def _calls(rank, world):
    import torch.distributed as dist

    from bench.launches import counting
    from gtpo_kernels import GTPOConfig, gtpo_loss
    from gtpo_kernels.distributed import vocab_parallel
    from gtpo_kernels.pipeline import epilogue_attached
    sizes = [int(s) for s in os.environ["GTPO_TEST_SIZES"].split(",")]
    start = sum(sizes[:rank])
    first, real_first, real_sums = [], epilogue_attached.first, vocab_parallel.vp_sums

    def sums(*a, **k):  # which path ran: the pending agreement (the first launch) or not
        first.append(k.get("pending") is not None)
        return real_sums(*a, **k)
    vocab_parallel.vp_sums = sums
    out = {"first": [], "cases": []}
    for packed in (False, True):
        x, ids, mask, kw = _inputs(sum(sizes), packed)
        for name, over in CONFIGS.items():
            cfg = GTPOConfig.preset(name, **over)
            for validate in (False, True):
                runs = {}
                for way in ("first", "agreement first", "one process"):
                    epilogue_attached.first = real_first if way == "first" else (lambda b, c: False)
                    part = (x if way == "one process" else x[..., start:start + sizes[rank]]).clone().requires_grad_()
                    torch.manual_seed(0)  # (clip_cov's draws, alike)
                    first.clear()
                    with counting() as c:
                        o = gtpo_loss(part, ids, completion_mask=mask, config=cfg, backend="triton", validate=validate,
                                      process_group=None if way == "one process" else dist.group.WORLD, **kw)
                        o.loss.backward()
                    if way == "first" and name == "grpo" and not validate:
                        out["launches_packed" if packed else "launches"] = c.launches
                    grad = part.grad if way != "one process" else part.grad[..., start:start + sizes[rank]]
                    runs[way] = [o.loss.tolist(), o.logps.tolist(), o.entropy.tolist(), grad.tolist()]
                    if way == "first":
                        out["first"].append(any(first))
                out["cases"].append(dict(packed=packed, cfg=name, validate=validate, **runs))
    # a rank that fails its checks (completion_ids of another shape) does not run the pass; every rank raises alike
    epilogue_attached.first = real_first
    x, ids, mask, kw = _inputs(sum(sizes), False)
    first.clear()
    try:
        gtpo_loss(x[..., start:start + sizes[rank]], ids[:, :3] if rank == 0 else ids, completion_mask=mask,
                  config="grpo", backend="triton", process_group=dist.group.WORLD, **kw)
        out["refused"] = None
    except ValueError as e:
        out["refused"], out["ran_first"] = str(e), any(first)
    # ranks that pass different advantages: the row formed in the first launch tells them apart
    first.clear()
    try:
        gtpo_loss(x[..., start:start + sizes[rank]], ids, completion_mask=mask, config="grpo", backend="triton",
                  process_group=dist.group.WORLD, **dict(kw, advantages=kw["advantages"] + rank))
        out["disagree"] = None
    except ValueError as e:
        out["disagree"], out["disagree_first"] = str(e), any(first)
    # the first launch itself fails on rank 0 (a compile or resource error, say): held as rank 0's failure, so
    # that a rank which runs the agreement first is not left waiting in it
    from gtpo_kernels.kernels import vp_first_triton
    real_launch = vp_first_triton.vp_first

    def broken(*a, **k):
        raise RuntimeError("the first launch failed")
    vp_first_triton.vp_first = broken if rank == 0 else real_launch
    try:
        gtpo_loss(x[..., start:start + sizes[rank]], ids, completion_mask=mask, config="grpo", backend="triton",
                  process_group=dist.group.WORLD, **kw)
        out["launch_failed"] = None
    except ValueError as e:
        out["launch_failed"] = str(e)
    vp_first_triton.vp_first = real_launch
    return out


def _run(sizes, monkeypatch, block=None):
    monkeypatch.setenv("GTPO_TEST_SIZES", ",".join(map(str, sizes)))
    if block is not None:
        monkeypatch.setenv("GTPO_VOCAB_BLOCK", str(block))
    return run_ranks_ok(_calls, len(sizes), watchdog=300)


def _check(results, expect_first, merged_sums=True):
    for r, res in enumerate(results):
        assert all(f == expect_first[r] for f in res["first"]), (r, res["first"])
        # grpo, unvalidated, forward + backward, the merged sums (not the block merge): 8 with the first launch
        # (spec 8), 9 where the agreement comes first (its row's kernel and the forward kernel)
        assert not merged_sums or res["launches"] == res["launches_packed"] == (8 if expect_first[r] else 9), \
            (r, res["launches"], res["launches_packed"])
        for c in res["cases"]:
            assert c["first"] == c["agreement first"], (r, c["cfg"], c["packed"], c["validate"])
            one = [torch.tensor(v, dtype=torch.float64) for v in c["one process"]]
            got = [torch.tensor(v, dtype=torch.float64) for v in c["first"]]
            for name, a, b in zip(("loss", "logps", "entropy"), got, one):
                assert_value_close(f"rank {r} {c['cfg']} {name}", a, b, 1e-5)
            assert one[3].abs().sum() > 0
            assert_grad_close(f"rank {r} {c['cfg']} grad", got[3].reshape(-1, got[3].shape[-1]),
                              one[3].reshape(-1, one[3].shape[-1]), 1e-4)
        assert res["refused"] and "rank(s) [0]" in res["refused"] and "every rank" in res["refused"], res["refused"]
        assert res["ran_first"] == (expect_first[r] and r != 0), r  # (rank 0 failed its checks)
        assert res["disagree"] and "disagree on advantages" in res["disagree"], res["disagree"]
        assert res["disagree_first"] == expect_first[r]
        if expect_first[0]:  # (rank 0 ran the first launch)
            assert res["launch_failed"] and "rank(s) [0] refused" in res["launch_failed"], res["launch_failed"]
    assert len({res["refused"] for res in results}) == 1 and len({res["disagree"] for res in results}) == 1
    assert len({res["launch_failed"] for res in results}) == 1


@pytest.mark.parametrize("sizes", [(20, 17)])
def test_the_first_launch_gives_the_bits_of_the_agreement_first(sizes, monkeypatch):
    _check(_run(sizes, monkeypatch), expect_first=[True, True])


def test_a_slice_at_a_multiple_of_the_block_runs_the_agreement_first(monkeypatch):
    """VOCAB_BLOCK = 16, slices 21 | 16: rank 1's slice is a multiple of it (the agreement first, then its forward
    kernel), rank 0's is not (the first launch); the merged sums alike, the same numbers on both."""
    _check(_run((21, 16), monkeypatch, block=16), expect_first=[True, False])


def test_a_spent_first_pass_falls_back_to_the_block_merge(monkeypatch):
    """VOCAB_BLOCK = 16, slices 16 | 21: every boundary at a multiple of it (the block merge); rank 0's slice
    is one (the agreement first), rank 1's is not (its first pass is spent, then the blocks merge)."""
    _check(_run((16, 21), monkeypatch, block=16), expect_first=[False, True], merged_sums=False)
