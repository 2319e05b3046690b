"""One pass in the call (spec 8): the kernel launches, host reads and host-to-device copies of a forward +
backward, counted on the CPU as a GPU would make them (bench/launches.py: Triton launches plus the aten
ops that launch a device kernel; autograd's seed of a scalar loss, `ones_like`, included).

On the Triton backend (run by Triton's interpreter here), with validate=False: gtpo_loss on logits at most
4 launches for GTPO and the TRL-family presets (the forward vocabulary kernel, the epilogue, the seed, the
backward vocabulary kernel), padded and packed, conflict weights given (one launch more computed in the
call); token_logprobs 1; no host read
and no tensor made from host data; validate=True exactly one host read. Every count is the same at two
batch sizes (it grows with neither tokens nor completions).
"""
import os

import pytest
import torch

from bench.launches import batch, counting
from gtpo_kernels import GTPOConfig, gtpo_loss, token_logprobs

# the presets of the three-launch path (pipeline/epilogue.py)
FAST = ["gtpo", "gtpo-official", "grpo", "dapo", "dr-grpo", "bnpo", "gspo", "luspo", "vanilla"]
SIZES = ((4, 5), (16, 9))  # (B, T): completions and tokens per completion


_batch = batch


def _loss_counts(preset, packed, validate, sizes=SIZES, **extra):
    counts = []
    for k, (B, T) in enumerate(sizes):
        logits, ids, adv, mask, kw = _batch(B, T, k, packed)
        x = logits.requires_grad_()
        cfg = GTPOConfig.preset(preset, beta=0.04, entropy_threshold=None) if preset in ("grpo", "dapo") \
            else GTPOConfig.preset(preset)
        with counting() as c:
            out = gtpo_loss(x, ids, adv, mask, config=cfg, validate=validate, backend="triton", **kw, **extra)
            out.loss.backward()
        assert torch.isfinite(out.loss) and x.grad.abs().sum() > 0
        counts.append((c.launches, c.host_reads, c.creations, dict(c.triton_names)))
    return counts


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("preset", FAST)
def test_loss_launches_at_most_four(preset, packed):
    counts = _loss_counts(preset, packed, validate=False)
    assert counts[0] == counts[1], counts  # flat in tokens and completions
    launches, reads, creations, kernels = counts[0]
    assert reads == 0 and creations == 0, counts
    assert launches <= 4, counts
    assert kernels == {"_vocab_fwd_kernel": 1, "_epilogue_kernel": 1, "_vocab_bwd_kernel": 1}


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_validating_reads_the_host_once(packed):
    counts = _loss_counts("gtpo", packed, validate=True)
    assert counts[0] == counts[1], counts
    assert counts[0][1] == 1, counts  # the status word: the input checks are in the kernel
    assert counts[0][0] <= 4, counts  # the same 4 launches as without validation


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_conflict_weights_computed_in_the_call_take_one_kernel(packed):
    """group_size instead of lam / n_conf: the conflict weights are one more launch (spec 8), from the
    call's tensors as given (no derived batch field formed), flat in tokens."""
    counts = []
    for k, (B, T) in enumerate(SIZES):
        logits, ids, adv, mask, kw = _batch(B, T, k, packed)
        kw = {key: v for key, v in kw.items() if key not in ("lam", "n_conf")}
        x = logits.requires_grad_()
        with counting() as c:
            out = gtpo_loss(x, ids, adv, mask, group_size=2, config="gtpo", validate=False, backend="triton", **kw)
            out.loss.backward()
        assert torch.isfinite(out.loss) and x.grad.abs().sum() > 0
        counts.append((c.launches, c.host_reads, c.creations, dict(c.triton_names)))
    assert counts[0] == counts[1], counts
    launches, reads, creations, kernels = counts[0]
    assert reads == 0 and creations == 0 and launches <= 5, counts
    assert kernels == {"_conflict_weights_kernel": 1, "_vocab_fwd_kernel": 1, "_epilogue_kernel": 1,
                       "_vocab_bwd_kernel": 1}, kernels


def test_num_items_tensor_and_per_token_temperature_stay_on_the_path():
    counts = _loss_counts("dapo", False, validate=False, num_items_in_batch=torch.tensor(37.0))
    assert counts[0] == counts[1] and counts[0][0] <= 4 and counts[0][1] == 0, counts


@pytest.mark.parametrize("per", ["completion", "token"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_temperature_per_completion_or_token_takes_at_most_eight(per, packed):
    """A temperature tensor on the 3-launch path (spec 8: at most 8 for any other option): its expansion
    to the tokens, no check launched (the vocabulary kernels read a tau that is not finite and > 0 as NaN)."""
    counts = []
    for k, (B, T) in enumerate(SIZES):
        logits, ids, adv, mask, kw = _batch(B, T, k, packed)
        tau = torch.full((B, 1), 0.7) if per == "completion" else torch.full(ids.shape, 0.7)
        x = logits.requires_grad_()
        with counting() as c:
            out = gtpo_loss(x, ids, adv, mask, config="gtpo", temperature=tau, validate=False, backend="triton", **kw)
            out.loss.backward()
        assert torch.isfinite(out.loss) and x.grad.abs().sum() > 0
        counts.append((c.launches, c.host_reads, c.creations, c.triton_names.get("_epilogue_kernel")))
    assert counts[0] == counts[1], counts
    assert counts[0][0] <= 8 and counts[0][1:] == (0, 0, 1), counts


@pytest.mark.parametrize("validate,reads", [(False, 0), (True, 1)])
def test_token_logprobs_one_launch(validate, reads):
    counts = []
    for k, (B, T) in enumerate(SIZES):
        logits, ids, _, mask, _ = _batch(B, T, k, False)
        with counting() as c:
            token_logprobs(logits, ids, 0.7, mask, validate=validate, backend="triton")
        counts.append((c.launches, c.host_reads, c.creations))
    assert counts[0] == counts[1], counts
    launches, got_reads, creations = counts[0]
    assert got_reads == reads and creations == 0, counts
    if not validate:
        assert launches == 1, counts


def test_counter_sees_launches_and_reads():
    """The counter itself: an eager surrogate's ops are counted, and so is a host read."""
    with counting() as c:
        x = torch.randn(5)
        y = (x * 2).sum()
        bool(y > 0)
    assert c.aten >= 3 and c.host_reads == 0  # bool() here is the test's own, not the package's
    logits, ids, adv, mask, kw = _batch(4, 5, 0, False)
    with counting() as c:
        gtpo_loss(logits.requires_grad_(), ids, adv, mask, config="cispo", backend="triton", validate=False,
                  **kw).loss.backward()
    assert c.launches > 20  # the eager path of another policy term


if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):  # pragma: no cover - conftest sets it
    pytestmark = pytest.mark.skip("needs Triton's interpreter")
