"""Validation reads the device on the host in few places, not once per check: a validating gtpo_loss
on the 4-launch path reads once (the epilogue kernel's status word: the input checks, the forward
kernel's flags and the entropy filter's all-dropped test), token_logprobs once (the forward kernel's
status word: the mask values, the ids and its flags), gtpo_loss_from_logps once (the status word of its
prep and epilogue kernels), and an unvalidated call never. The Triton path (in Triton's interpreter here),
the one a GPU runs. Counted on the CPU by the tensor methods that read values on the host, called
from the package's code; on a GPU each such read is a sync that stops the host queueing ahead."""
import contextlib
import os
import traceback

import pytest
import torch

from gtpo_kernels import GTPOConfig, gtpo_loss, gtpo_loss_from_logps, token_logprobs

PACKAGE = os.sep + "gtpo_kernels" + os.sep
READS = ("__bool__", "item", "__int__", "__float__", "tolist", "nonzero", "__index__")


@contextlib.contextmanager
def host_reads():
    """{'file:line': count} of the package's host reads of tensor values inside the block."""
    seen = {}
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name, fn):
        def read(self, *a, **k):
            caller = traceback.extract_stack()[-2]  # the package's own reads (not torch's, nor Triton's)
            if PACKAGE in caller.filename:
                key = f"{caller.filename.split(PACKAGE)[1]}:{caller.lineno}"
                seen[key] = seen.get(key, 0) + 1
            return fn(self, *a, **k)
        return read
    for name, fn in saved.items():
        setattr(torch.Tensor, name, counting(name, fn))
    try:
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def _inputs(seed, B=8, T=6, V=40):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float32) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True
    adv = torch.randn(B, generator=g)
    old = torch.randn(B, T, generator=g) * 0.1 - 3.0
    return logits, ids, mask, adv, old


@pytest.mark.parametrize("validate,most", [(True, 1), (False, 0)])
@pytest.mark.parametrize("seed", [0, 1])
def test_gtpo_loss_reads_the_host_once(validate, most, seed):
    logits, ids, mask, adv, old = _inputs(seed)
    cfg = GTPOConfig(entropy_threshold=5.0, loss_agg="token-mean")  # the filter on: its all-dropped test reads too
    with host_reads() as seen:
        out = gtpo_loss(logits.requires_grad_(), ids, adv, mask, old_logps=old, group_size=4, config=cfg,
                        num_items_in_batch=torch.tensor(float(mask.sum())), validate=validate, backend="triton")
    assert sum(seen.values()) <= most, seen
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("validate,most", [(True, 1), (False, 0)])
def test_from_logps_and_token_logprobs_read_little(validate, most):
    logits, ids, mask, adv, old = _inputs(3)
    with host_reads() as seen:
        lp, ent = token_logprobs(logits, ids, 1.0, mask, validate=validate, backend="triton")
    assert sum(seen.values()) == (1 if validate else 0), seen  # the status word
    with host_reads() as seen:
        gtpo_loss_from_logps(lp.requires_grad_(), ids, adv, mask, entropy=ent, old_logps=old, group_size=4,
                             config=GTPOConfig(entropy_threshold=None), validate=validate, backend="triton")
    assert sum(seen.values()) == most, seen  # the status word


@pytest.mark.parametrize("tau,reads", [(0.7, 0), (torch.tensor(0.7), 1)])
def test_a_call_temperature_rereads_no_config_tensor(tau, reads):
    """A call's temperature= with a config holding 0-d tensor fields (schedules): the config's tensors were read
    when it was built and are not read again per call (before, every one was, each a sync on a GPU); a 0-d
    tensor temperature= itself is read once, to check it."""
    logits, ids, mask, adv, old = _inputs(4)
    cfg = GTPOConfig.preset("grpo", beta=torch.tensor(0.05), eps_high=torch.tensor(0.25))
    with host_reads() as seen:
        out = gtpo_loss(logits, ids, adv, mask, old_logps=old, ref_logps=old + 0.1, config=cfg, temperature=tau,
                        validate=False, backend="triton")
    assert sum(seen.values()) == reads, seen
    assert torch.isfinite(out.loss)
    with pytest.raises(ValueError, match="temperature"):
        gtpo_loss(logits, ids, adv, mask, old_logps=old, config=cfg, temperature=torch.tensor(-0.7), validate=False)


@pytest.mark.parametrize("what", ["ids", "old", "mask", "adv", "flags"])
def test_each_check_still_raises_its_own_error(what):
    """One read for all of them, and still the error of the check that failed (the first one made)."""
    logits, ids, mask, adv, old = _inputs(5)
    want = {"ids": "completion_ids must lie in", "old": "old_logps must be finite", "adv": "advantages must be finite",
            "mask": "completion_mask must hold only 0 and 1", "flags": "contains NaN or \\+inf"}[what]
    mask = mask.float()
    if what == "ids":
        ids[2, 1] = 40
        mask[2, 1] = 1
    elif what == "old":
        old[1, 0] = float("nan")
    elif what == "mask":
        mask[0, 0] = 0.5
    elif what == "adv":
        adv[3] = float("inf")
    else:
        logits[4, 0, 7] = float("nan")
        mask[4, 0] = 1
    with pytest.raises(ValueError, match=want):
        gtpo_loss(logits, ids, adv, mask, old_logps=old, group_size=4, backend="torch")


@pytest.mark.parametrize("what", ["mask", "ids", "negative id", "flags", "target -inf", "mask and ids"])
def test_token_logprobs_checks_in_the_kernel_raise_their_own_errors(what):
    """token_logprobs validating on the Triton backend checks in its one launch; a failed check gives the
    host checks' error, as the torch backend raises it (the mask's before the ids', both before the flags)."""
    logits, ids, mask, _, _ = _inputs(7, B=4, T=3)
    mask = mask.float()
    want = {"mask": "completion_mask must hold only 0 and 1", "ids": "completion_ids must lie in .*position 4 holds 40",
            "negative id": "completion_ids must lie in .*position 11 holds -1", "flags": "token \\(2, 0\\) contains NaN",
            "target -inf": "token \\(3, 1\\) gives its own target token a logit of -inf",
            "mask and ids": "completion_mask must hold only 0 and 1"}[what]
    if what in ("mask", "mask and ids"):
        mask[3, 2] = 2.0
    if what in ("ids", "mask and ids"):
        ids[1, 1], mask[1, 1] = 40, 1
    if what == "negative id":
        ids[3, 2], mask[3, 2] = -1, 1
    if what == "flags":
        logits[2, 0, 7], mask[2, 0] = float("nan"), 1
    if what == "target -inf":
        logits[3, 1, ids[3, 1]], mask[3, 1] = float("-inf"), 1
    for backend in ("triton", "torch"):
        with pytest.raises(ValueError, match=want):
            token_logprobs(logits, ids, 0.7, mask, backend=backend)
    # the kernel's counter is left ready: the same call with the inputs fixed passes, with the float64 values
    fixed = (mask != 0).float()
    ids = ids.clamp(0, 39)
    logits = torch.nan_to_num(logits, nan=0.0, neginf=-30.0)
    with host_reads() as seen:
        lp, ent = token_logprobs(logits, ids, 0.7, fixed, backend="triton")
    assert sum(seen.values()) == 1, seen
    ref = torch.log_softmax(logits.double() / 0.7, -1)
    want_lp = ref.gather(-1, ids[..., None])[..., 0] * fixed
    want_ent = -(ref.exp() * ref).sum(-1) * fixed
    torch.testing.assert_close(lp.double(), want_lp, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(ent.double(), want_ent, atol=2e-5, rtol=2e-5)


def test_token_logprobs_masked_out_invalid_ids_pass():
    """A masked-out id out of range, a 0 / 1 mask of any dtype: nothing to raise, one read, the values."""
    logits, ids, mask, _, _ = _inputs(8, B=3, T=4)
    ids[0, 2], mask[0, 2] = 99, False
    for m in (mask, mask.float(), mask.to(torch.int32)):
        with host_reads() as seen:
            lp, _ = token_logprobs(logits, ids, 1.0, m, backend="triton")
        assert sum(seen.values()) == 1, seen
        ref = torch.log_softmax(logits.double(), -1).gather(-1, ids.clamp(max=39)[..., None])[..., 0] * mask
        torch.testing.assert_close(lp.double(), ref, atol=2e-5, rtol=2e-5)


def _head(seed, B=4, T=6, D=8, V=40):
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True
    return h, w, ids, mask, torch.randn(B, generator=g), torch.randn(B, T, generator=g) * 0.1 - 3.0


@pytest.mark.parametrize("validate", [True, False])
def test_the_lm_head_reads_its_arguments_checks_with_its_tile_plan(validate):
    """One process: the LM head reads the host to plan its tiles (the recompute backward its rows with a
    gradient once more) and, validating, its flags once after the tiles; the arguments' value checks ride on
    the plan's read (core.host_read.carried), where they took a read of their own (3 / 4 / 3 validated)."""
    from gtpo_kernels import linear_gtpo_loss, linear_token_logprobs
    h, w, ids, mask, adv, old = _head(3)
    for what, most in (("fused", 1), ("recompute", 2), ("logprobs", 1)):
        wp = w.clone().requires_grad_()
        with host_reads() as seen:
            if what == "logprobs":
                linear_token_logprobs(h, w, ids, torch.rand(4, 6) + 0.5, mask, backend="triton", validate=validate)
            else:
                linear_gtpo_loss(h, wp, ids, adv, mask, group_size=2, old_logps=old, config="grpo", schedule=what,
                                 backend="triton", validate=validate, memory_budget=2 * 12 * 40 * 4).loss.backward()
        assert sum(seen.values()) == most + validate, (what, seen)


@pytest.mark.parametrize("later", ["group_size", "backend", "schedule"])
def test_a_carried_check_s_error_comes_before_a_later_one(later):
    """A value check carried to the tile plan's read raises its own error even where the call raises another
    before the plan (conflict weights without group_size, a backend name, the fused schedule's refusal): its
    error comes first, as when it was read at the end of the checks' block."""
    from gtpo_kernels import linear_gtpo_loss
    h, w, ids, mask, adv, old = _head(5)
    adv[2] = float("nan")
    kw = {"group_size": dict(config="gtpo"), "backend": dict(config="grpo", backend="foo"),
          "schedule": dict(config=GTPOConfig.preset("dapo", top_entropy_quantile=0.5), schedule="fused")}[later]
    with pytest.raises(ValueError, match="advantages must be finite"):
        linear_gtpo_loss(h, w, ids, adv, mask, **kw)


@pytest.mark.parametrize("what", ["advantage", "old_logps", "mask", "id", "temperature", "two"])
def test_the_lm_head_s_carried_checks_raise_their_own_errors(what):
    """The checks read with the tile plan raise the error each raised on its own read (the first made where
    two fail), before any tile is projected; a bad value at a masked-out token is no error."""
    from bench.launches import counting
    from gtpo_kernels import linear_gtpo_loss, linear_token_logprobs
    h, w, ids, mask, adv, old = _head(4)
    mask = mask.long()
    tau = torch.rand(4, 6) + 0.5
    expect = {"advantage": "advantages must be finite", "old_logps": "old_logps must be finite at counted positions",
              "mask": "completion_mask must hold only 0 and 1", "id": "flat position 9 holds 40",
              "temperature": "temperature must be finite and > 0", "two": "completion_mask must hold only 0 and 1"}
    if what in ("advantage", "two"):
        adv[2] = float("nan")
    if what == "old_logps":
        old[1, 3] = float("inf")
    if what in ("mask", "two"):
        mask[0, 2] = 2
    if what == "id":
        ids[1, 3] = 40
        mask[1, 3] = 1
    if what == "temperature":
        tau[2, 1], mask[2, 1] = -1.0, 1
    for call in ("loss", "logprobs"):
        if call == "logprobs" and what in ("advantage", "old_logps"):
            continue
        with counting() as c, pytest.raises(ValueError, match=expect[what]):
            if call == "loss":
                linear_gtpo_loss(h, w, ids, adv, mask, group_size=2, old_logps=old, config="grpo", temperature=tau,
                                 backend="triton")
            else:
                linear_token_logprobs(h, w, ids, tau, mask, backend="triton")
        kernels = [k for k in c.triton_names if "vocab" in k or "epilogue" in k]  # (the checks' own may run)
        assert not kernels and "mm" not in c.ops, (what, call, kernels, dict(c.ops))  # (nothing projected)
    out = mask.clone()
    out[mask != 1] = 0
    if what in ("advantage", "two"):
        return  # (an advantage counts at every completion)
    bad_at = {"old_logps": (1, 3), "mask": (0, 2), "id": (1, 3), "temperature": (2, 1)}[what]
    out[bad_at] = 0  # the bad value masked out: no error
    linear_gtpo_loss(h, w, ids, adv, out, group_size=2, old_logps=old, config="grpo", temperature=tau,
                     backend="triton")
