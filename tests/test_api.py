"""The public contract (spec section 6): errors, awkward but valid inputs, in-place, the torch path's memory,
magnitudes and corner cases. The packed form: tests/test_packed_form.py."""
import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import gtpo_reference as ref
from conftest import assert_grad_close, assert_value_close
from gtpo_kernels import GTPOConfig, gtpo_loss, token_logprobs

BACKENDS = ["triton", "torch"]


def batch(B=4, T=5, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T), generator=g),
            torch.randn(B, generator=g))


# ---------------------------------------------------------------- errors name the argument


def _errors():
    x, ids, adv = batch()
    mask = torch.ones(4, 5)
    nan_row = x.clone()
    nan_row[1, 2, 3] = float("nan")
    neg_inf_target = x.clone()
    neg_inf_target[0, 0, ids[0, 0]] = float("-inf")
    bad_ids = ids.clone()
    bad_ids[2, 1] = 11
    return [
        ("int logits", lambda: gtpo_loss(ids, ids, adv, group_size=2), TypeError, "logits must be float"),
        ("2-D logits", lambda: gtpo_loss(x[0], ids, adv, group_size=2), ValueError, r"logits must be \(B, T_l, V\)"),
        ("float ids", lambda: gtpo_loss(x, ids.float(), adv, group_size=2), TypeError, "completion_ids must be an integer"),
        ("ids batch", lambda: gtpo_loss(x, ids[:3], adv, group_size=2), ValueError, "completion_ids must have shape"),
        ("ids too long", lambda: gtpo_loss(x, torch.zeros(4, 6, dtype=torch.long), adv, group_size=2), ValueError, "logits must hold at least"),
        ("mask shape", lambda: gtpo_loss(x, ids, adv, mask[:, :4], group_size=2), ValueError, "completion_mask must have shape"),
        ("adv shape", lambda: gtpo_loss(x, ids, adv[:3], group_size=2), ValueError, "advantages must have shape"),
        ("adv shape, packed", lambda: gtpo_loss(x.reshape(20, 11), ids.reshape(20), adv,
                                                cu_seqlens=torch.tensor([0, 5, 10, 20]), group_size=1), ValueError,
         r"B = 3 \(the completions cu_seqlens delimits: 4 offsets\), got \(4,\)"),
        ("transposed logits", lambda: gtpo_loss(torch.randn(4, 11, 5), ids, adv, group_size=2), ValueError,
         "their last dimension is T = 5: the vocabulary goes last"),
        ("adv missing", lambda: gtpo_loss(x, ids, None, group_size=2), TypeError, "advantages is required"),
        ("no group_size", lambda: gtpo_loss(x, ids, adv), ValueError, "group_size is required"),
        ("group_size divides", lambda: gtpo_loss(x, ids, adv, group_size=3), ValueError, "must divide"),
        ("ids range", lambda: gtpo_loss(x, bad_ids, adv, group_size=2), ValueError, r"completion_ids must lie in \[0, V\)"),
        ("negative id", lambda: gtpo_loss(x, ids - 20, adv, group_size=2), ValueError, "completion_ids must lie"),
        ("beta without ref", lambda: gtpo_loss(x, ids, adv, group_size=2, config=GTPOConfig(beta=0.1)), ValueError, "ref_logps"),
        ("old shape", lambda: gtpo_loss(x, ids, adv, group_size=2, old_logps=torch.zeros(4, 4)), ValueError, "old_logps must have shape"),
        ("old dtype", lambda: gtpo_loss(x, ids, adv, group_size=2, old_logps=ids), TypeError, "old_logps must be a floating"),
        ("nan row", lambda: gtpo_loss(nan_row, ids, adv, group_size=2), ValueError, r"NaN or \+inf"),
        ("-inf target", lambda: gtpo_loss(neg_inf_target, ids, adv, group_size=2), ValueError, "-inf"),
        ("logits_start", lambda: gtpo_loss(x, ids, adv, group_size=2, logits_start=-1), ValueError, "logits_start"),
        ("backend", lambda: gtpo_loss(x, ids, adv, group_size=2, backend="cuda"), ValueError, "backend must be one of"),
        ("config type", lambda: gtpo_loss(x, ids, adv, group_size=2, config=3), TypeError, "config must be"),
        ("preset", lambda: GTPOConfig.preset("ppo"), ValueError, "unknown preset"),
        ("temperature", lambda: GTPOConfig(temperature=0.0), ValueError, "temperature must be > 0"),
        ("eps", lambda: GTPOConfig(eps_high=1.0), ValueError, r"eps_high must be in \[0, 1\)"),
        ("loss_agg", lambda: GTPOConfig(loss_agg="sum"), ValueError, "loss_agg must be one of"),
        ("nan weight", lambda: GTPOConfig(conflict_pos_weight=math.nan), ValueError, "conflict_pos_weight"),
        ("override", lambda: GTPOConfig.preset("grpo", epsilon=0.3), TypeError, "unknown field"),
        ("packed ids", lambda: gtpo_loss(x[0], ids, adv[:2], cu_seqlens=torch.tensor([0, 2, 5])), ValueError, r"shape \(N,\) in the packed"),
        ("cu_seqlens", lambda: gtpo_loss(x[0], ids[0], adv[:2], cu_seqlens=torch.tensor([0, 2, 4]), group_size=2), ValueError, "cu_seqlens must start at 0"),
        ("inplace stride", lambda: gtpo_loss(x.transpose(1, 2).contiguous().transpose(1, 2), ids, adv, group_size=2, inplace=True), ValueError, "inplace=True needs"),
        ("token_logprobs temp", lambda: token_logprobs(x, ids, 0.0), ValueError, "temperature"),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,call,exc,match", _errors(), ids=[e[0] for e in _errors()])
def test_errors_name_the_argument(name, call, exc, match, backend, monkeypatch):
    import gtpo_kernels.kernels.dispatch as d
    real = d.resolve_backend
    monkeypatch.setattr(d, "resolve_backend", lambda b, dev, dtype=None: real(backend if b == "auto" else b, dev, dtype))
    with pytest.raises(exc, match=match):
        call()


# ---------------------------------------------------------------- awkward but valid inputs


@pytest.mark.parametrize("backend", BACKENDS + ["reference"])
def test_all_masked_batch_gives_zero_loss_and_gradient(backend):
    x, ids, adv = batch()
    for agg in ("seq-mean-token-mean", "token-mean", "gtpo-official", "none"):
        xx = x.clone().requires_grad_()
        out = gtpo_loss(xx, torch.full_like(ids, -100), adv, torch.zeros(4, 5), group_size=2,
                        config=GTPOConfig(loss_agg=agg), backend=backend)
        out.loss.sum().backward()
        assert (out.loss == 0).all() and (xx.grad == 0).all()
        assert all(torch.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_vocabulary_of_one(backend):
    x, ids, adv = batch(V=1)
    xx = x.clone().requires_grad_()
    out = gtpo_loss(xx, torch.zeros_like(ids), adv, group_size=2, backend=backend)
    out.loss.backward()
    assert (out.logps == 0).all() and (out.entropy == 0).all() and (xx.grad == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_rows_are_never_read_and_inputs_never_modified(backend):
    x, ids, adv = batch(B=4, T=6, V=13, seed=3)
    mask = torch.ones(4, 6, dtype=torch.int32)
    mask[1, 3:] = 0
    mask[3] = 0
    x[1, 3:] = float("nan")  # garbage where nothing is counted
    x[3] = float("inf")
    ids = ids.to(torch.int32)
    ids[1, 3:] = -100
    old = torch.randn(4, 6).masked_fill(mask == 0, float("nan"))
    args = [t.clone() for t in (x, ids, adv, mask, old)]
    xx = x.clone().requires_grad_()
    out = gtpo_loss(xx, ids, adv[:, None], mask, group_size=2, old_logps=old, backend=backend,
                    config=GTPOConfig(entropy_threshold=None))
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(xx.grad).all()
    assert (xx.grad[3] == 0).all() and (xx.grad[1, 3:] == 0).all()
    for a, b in zip(args, (x, ids, adv, mask, old)):  # bit for bit, NaN where NaN
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)
    clean = torch.where(torch.isfinite(x), x, torch.zeros(()))
    xr = clean.double().requires_grad_()
    r = ref.gtpo_loss(xr, ids, adv, mask, group_size=2, old_logps=old, entropy_threshold=None)
    r["loss"].backward()
    assert_value_close("loss", out.loss.detach(), r["loss"].detach(), 1e-5)
    assert_grad_close("grad", xx.grad, xr.grad, 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_writes_the_gradient_into_the_logits(backend):
    """inplace=True: the gradient lands in the logits' storage and equals the out-of-place one, zeros
    included: the row before the window, masked tokens and a whole masked completion are overwritten
    with 0 (their logits were not, and they are nonzero before)."""
    x, ids, adv = batch(B=4, T=6, V=9)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1, 3:] = False                         # masked tail of a completion
    mask[2] = False                             # a whole completion masked out
    cfg = GTPOConfig(entropy_threshold=None, entropy_coef=0.01)
    a = x.clone().requires_grad_()
    gtpo_loss(a, ids[:, 1:], adv, mask, group_size=2, logits_start=1, config=cfg,
              backend=backend).loss.backward()
    base = x.clone()
    b = base.clone().requires_grad_()
    storage = b.untyped_storage().data_ptr()
    out = gtpo_loss(b, ids[:, 1:], adv, mask, group_size=2, logits_start=1, config=cfg, backend=backend,
                    inplace=True)
    assert torch.equal(b.detach(), base)  # the forward does not touch them
    inactive = torch.zeros(4, 6, dtype=torch.bool)
    inactive[:, 0] = True                       # the row before the window
    inactive[:, 1:] = ~mask
    assert (base[inactive] != 0).all()          # so a row left as it was cannot pass for a zeroed one
    out.loss.backward()
    assert b.grad.untyped_storage().data_ptr() == storage
    assert (a.grad[~inactive].abs().sum(-1) > 0).all()
    assert (b.grad[inactive] == 0).all(), "an inactive row of the in-place gradient is not zeroed"
    assert_grad_close("inplace grad", b.grad, a.grad, 1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_takes_any_stride_of_a_vocabulary_of_one(backend):
    """A vocabulary dimension of size 1 (or an empty batch) has no stride to speak of: inplace=True takes
    it (its gradient equals the out-of-place one), where a larger vocabulary with stride != 1 is refused.
    (A nightly draw of an empty batch with V = 1 was refused for its stride before the kept sets'
    documented refusal could say why.)"""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 1, 3, generator=g).transpose(1, 2)  # (B, T, 1) with vocabulary stride 3
    ids, adv = torch.zeros(2, 3, dtype=torch.long), torch.tensor([1.0, 0.5])
    old = torch.full((2, 3), -0.1)
    a = gtpo_loss(x.detach().clone(), ids, adv, group_size=2, old_logps=old, config="grpo", backend=backend).loss
    b = x.detach().clone().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    assert b.stride(-1) == 3
    out = gtpo_loss(b, ids, adv, group_size=2, old_logps=old, config="grpo", backend=backend, inplace=True)
    assert out.loss != 0 and torch.equal(out.loss, a)  # (logp = 0 over one entry; the ratio is exp(0.1))
    out.loss.backward()  # its gradient, 0 with one entry, written in place without a complaint
    with pytest.raises(ValueError, match="vocabulary stride 1"):
        wide = torch.randn(2, 4, 3, generator=g).transpose(1, 2)
        gtpo_loss(wide.requires_grad_(), ids, adv, group_size=2, config="grpo", backend=backend, inplace=True)
    empty = torch.zeros(1, 1, 1).expand(2, 0, 1)  # strides (0, 1, 0): no element, so no overlap either
    with pytest.raises(ValueError, match="inplace=True is not taken with sampling_mask"):  # the documented one
        gtpo_loss(empty.requires_grad_(), ids[:, :0], adv, group_size=2, backend=backend, inplace=True,
                  sampling_mask=(torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_views_of_the_model_logits(backend):
    """logits_start on the model's full output, and a vocabulary-strided tensor (copied once)."""
    x, ids, adv = batch(B=2, T=7, V=10, seed=5)
    cfg = GTPOConfig(entropy_threshold=None)
    full = x.clone().requires_grad_()
    out = gtpo_loss(full, ids[:, 2:6], adv, group_size=2, logits_start=1, config=cfg, backend=backend)
    out.loss.backward()
    sliced = x[:, 1:5].clone().requires_grad_()
    out2 = gtpo_loss(sliced, ids[:, 2:6], adv, group_size=2, config=cfg, backend=backend)
    out2.loss.backward()
    assert_value_close("loss", out.loss.detach(), out2.loss.detach(), 1e-6)
    assert torch.equal(full.grad[:, 1:5], sliced.grad) and (full.grad[:, [0, 5, 6]] == 0).all()
    t = x.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # vocabulary stride != 1
    out3 = gtpo_loss(t, ids[:, 2:6], adv, group_size=2, logits_start=1, config=cfg, backend=backend)
    out3.loss.backward()
    assert_grad_close("strided grad", t.grad, full.grad, 1e-6)


# ---------------------------------------------------------------- memory of the torch path

_MEM_SCRIPT = r"""
import json, sys, torch
from gtpo_kernels import gtpo_loss, GTPOConfig
torch.manual_seed(0)
B, T, V = 8, 512, 16384
def run(x, ids, adv, eager):
    x = x.requires_grad_()
    if eager:  # what trainers do today: log_softmax of the whole upcast logits
        lp = torch.log_softmax(x.float(), -1)
        loss = -(lp.gather(-1, ids[..., None]) * adv[:, None, None]).mean() + (lp.exp() * lp).sum(-1).mean()
    else:
        loss = gtpo_loss(x, ids, adv, group_size=8, config=GTPOConfig(entropy_coef=0.01), backend="torch").loss
    loss.backward()
small = (torch.randn(8, 4, 64), torch.randint(0, 64, (8, 4)), torch.randn(8))
run(*small, eager=sys.argv[1] == "eager")  # load every code path first
x = torch.randn(B, T, V); ids = torch.randint(0, V, (B, T)); adv = torch.randn(B)
def status(key):  # kB lines of /proc/self/status
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))
open("/proc/self/clear_refs", "w").write("5")  # reset the resident high-water mark (VmHWM) to now
before = status("VmRSS:")
run(x, ids, adv, eager=sys.argv[1] == "eager")
after = status("VmHWM:")
print(json.dumps({"peak_above_inputs": after - before, "logits_bytes": x.numel() * 4}))
"""


def test_torch_path_peak_memory_stays_within_a_few_chunks():
    from gtpo_kernels.kernels.vocab_torch import CHUNK_ELEMENTS

    def measure(kind):
        # a fixed mmap threshold: glibc then returns every freed chunk at once, and the resident peak
        # measures live memory rather than the allocator's reuse pattern
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576")
        res = subprocess.run([sys.executable, "-c", _MEM_SCRIPT, kind], capture_output=True, text=True,
                             timeout=300, env=env)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout.strip().splitlines()[-1])
    ours = measure("gtpo")
    chunk = CHUNK_ELEMENTS * 4
    # the gradient itself (one logits-sized buffer) plus a few float32 row-chunks
    assert ours["peak_above_inputs"] <= ours["logits_bytes"] + 6 * chunk, ours
    eager = measure("eager")
    assert eager["peak_above_inputs"] > ours["peak_above_inputs"] + ours["logits_bytes"], (eager, ours)


# ---------------------------------------------------------------- magnitudes and corner cases


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale,offset,temperature", [(0.02, 30.0, 0.01), (3.0, 1e4, 1.0), (1.0, -2e3, 0.5)])
def test_accuracy_does_not_depend_on_the_size_of_the_logits(backend, scale, offset, temperature):
    """z / tau of 3000 or logits near 1e4: differences are taken before the scale, and lse is never
    formed, so the spec's tolerances hold at any magnitude (float32 inputs, as given)."""
    g = torch.Generator().manual_seed(7)
    x = (offset + scale * torch.randn(4, 6, 64, generator=g)).float()
    ids = torch.randint(0, 64, (4, 6), generator=g)
    ids[:, 0] = x[:, 0].argmax(-1)  # some confident targets
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    cfg = GTPOConfig.preset("grpo", temperature=temperature, entropy_coef=0.01)
    xx = x.clone().requires_grad_()
    out = gtpo_loss(xx, ids, adv, group_size=2, config=cfg, backend=backend)
    out.loss.backward()
    xr = x.double().requires_grad_()
    r = ref.gtpo_loss(xr, ids, adv, group_size=2, **dataclasses.asdict(cfg))
    r["loss"].backward()
    assert_value_close("logps", out.logps, r["logps"], 1e-5)
    assert_value_close("entropy", out.entropy, r["entropy"], 1e-5)
    assert_value_close("loss", out.loss.detach(), r["loss"].detach(), 1e-5)
    assert_grad_close("grad", xx.grad, xr.grad, 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_entropy_bonus_with_banned_vocabulary_stays_finite(backend):
    """-inf logits with an entropy coefficient whose product with log p would overflow."""
    x = torch.tensor([[[0.0, 1.0, float("-inf"), 0.5]], [[2.0, float("-inf"), 1.0, 0.0]]])
    ids = torch.tensor([[0], [2]])
    cfg = GTPOConfig.preset("grpo", entropy_coef=2.0, loss_agg="seq-mean-token-sum")
    xx = x.clone().requires_grad_()
    out = gtpo_loss(xx, ids, torch.tensor([1.0, -1.0]), config=cfg, backend=backend)
    (out.loss * 3).backward()
    xr = x.double().requires_grad_()
    (ref.gtpo_loss(xr, ids, torch.tensor([1.0, -1.0]), **dataclasses.asdict(cfg))["loss"] * 3).backward()
    assert_grad_close("grad", xx.grad, xr.grad, 1e-5)
    assert (xx.grad[..., [2]][x[..., [2]] == float("-inf")] == 0).all()


def test_weights_given_without_n_conf_when_conflicts_are_off():
    x, ids, adv = batch()
    # random logits sit above the preset's entropy bound: without the filter the loss is not 0
    cfg = GTPOConfig.preset("gtpo-official", use_conflict_mask=False, entropy_threshold=None)
    lam = torch.rand(4, 5) + 0.5
    out = gtpo_loss(x, ids, adv, lam=lam, config=cfg)
    r = ref.gtpo_loss(x.double(), ids, adv, lam=lam, **dataclasses.asdict(cfg))
    assert float(r["loss"]) != 0.0
    assert_value_close("loss", out.loss, r["loss"], 1e-5)


def test_reference_backend_follows_the_contract():
    x, ids, adv = batch(B=2, T=7, V=9)
    lp, ent = token_logprobs(x, ids[:, :5], logits_start=2, backend="reference")
    lp2, ent2 = token_logprobs(x, ids[:, :5], logits_start=2, backend="torch")
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (2, 5)
    assert_value_close("logp", lp, lp2, 1e-5)
    assert_value_close("entropy", ent, ent2, 1e-5)
    out = gtpo_loss(x, ids[:, :5], adv[:2], group_size=2, logits_start=2, backend="reference")
    assert out.loss.dtype == out.seq_entropy.dtype == out.metrics["clip_frac"].dtype == torch.float32


def test_warns_when_the_filter_drops_every_completion():
    x, ids, adv = batch()  # random logits: entropy ~ log V, far above ln 2
    with pytest.warns(UserWarning, match="entropy filter dropped every completion"):
        out = gtpo_loss(x * 0.01, ids, adv, group_size=2)
    assert out.metrics["filtered_frac"] == 1
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gtpo_loss(x * 0.01, ids, adv, group_size=2, config=GTPOConfig(initial_entropy=5.0))  # the gate
        gtpo_loss(x * 0.01, ids, adv, group_size=2, validate=False)  # no host read, no warning
