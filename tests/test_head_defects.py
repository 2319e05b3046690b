"""The fused LM head on inputs that once went wrong (spec 6, 11): gtpo-official without n_conf on the
fused schedule, torch.autocast around float32 inputs, a max_seqlen that lies about the longest
completion (validate=False) planning the tiles, and the head's errors (a transposed weight, hidden
states with the prompt's rows, gtpo_loss's logits_start and inplace). Each against the float64
reference on the materialized logits."""
import pytest
import torch

from conftest import assert_grad_close, assert_value_close
from gtpo_kernels import GTPOConfig, gtpo_loss, linear_gtpo_loss, linear_token_logprobs
from gtpo_kernels.pipeline.head import row_bytes

pytestmark = pytest.mark.filterwarnings(  # random batches here may sit above the entropy threshold (tested apart)
    "ignore:gtpo_loss. the entropy filter dropped every completion:UserWarning")

GRAD_TOL = 1e-4  # gradients of hidden and weight in float32 (GEMMs over V), as tests/test_linear.py


def _inputs(B, T, D=8, V=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, T, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.7
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, generator=g)
    return h, w, ids, adv


def _reference(h, w, ids, adv, mask=None, **kw):
    """gtpo_loss's float64 reference on the materialized logits, gradients by autograd through them."""
    hh, ww = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    z = hh.reshape(-1, hh.shape[-1]) @ ww.t()
    z = z.reshape(*hh.shape[:-1], -1)
    out = gtpo_loss(z, ids, adv, mask, backend="reference", **kw)
    gh, gw = torch.autograd.grad(out.loss, (hh, ww))
    assert gh.abs().sum() > 0 and gw.abs().sum() > 0
    return out, gh, gw


def _head(h, w, ids, adv, mask=None, **kw):
    hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = linear_gtpo_loss(hh, ww, ids, adv, mask, **kw)
    gh, gw = torch.autograd.grad(out.loss, (hh, ww))
    return out, gh, gw


def _close(got, ref, what):
    (out, gh, gw), (rout, rgh, rgw) = got, ref
    assert_value_close(f"{what}: loss", out.loss.detach(), rout.loss.detach(), 1e-5)
    assert_value_close(f"{what}: logps", out.logps, rout.logps.detach(), 1e-5)
    assert_grad_close(f"{what}: grad hidden", gh, rgh, GRAD_TOL)
    assert_grad_close(f"{what}: grad weight", gw, rgw, GRAD_TOL)


@pytest.mark.parametrize("schedule", ["fused", "recompute"])
def test_gtpo_official_without_n_conf(schedule):
    """gtpo-official with no conflict mask (n_conf = 1) on tiles of two of the four completions."""
    h, w, ids, adv = _inputs(4, 3)
    cfg = GTPOConfig.preset("gtpo-official", use_conflict_mask=False, entropy_threshold=10.0)
    budget = 6 * row_bytes(w.shape[0], w.dtype, w.device)  # 6 rows: two completions a tile
    got = _head(h, w, ids, adv, group_size=2, config=cfg, memory_budget=budget, schedule=schedule, backend="torch")
    assert float(got[0].metrics["grad_in_forward"]) == (schedule == "fused")
    _close(got, _reference(h, w, ids, adv, group_size=2, config=cfg), f"gtpo-official, {schedule}")


@pytest.mark.parametrize("schedule", ["fused", "recompute"])
def test_autocast_leaves_float32_inputs_float32(schedule):
    """Inside torch.autocast (bf16), float32 hidden states and weight give the float32 results: the
    inputs' dtypes decide, forward and backward. One token is masked out, so that a tile's gradient rows
    are not consecutive and go through the scattered write (with every row counted, the GEMM writes them
    in place, which autocast leaves alone, and the test could not fail)."""
    h, w, ids, adv = _inputs(4, 3)
    mask = torch.ones(4, 3, dtype=torch.bool)
    mask[1, 1] = False
    kw = dict(group_size=2, config="grpo", schedule=schedule, backend="torch")
    plain = _head(h, w, ids, adv, mask, **kw)
    with torch.autocast("cpu", torch.bfloat16):
        got = _head(h, w, ids, adv, mask, **kw)
    assert got[1].dtype == got[2].dtype == torch.float32
    for a, b, name in zip(got[1:], plain[1:], ("hidden", "weight")):
        assert torch.equal(a, b), f"grad {name} under autocast differs from the float32 run"
    _close(got, _reference(h, w, ids, adv, mask, group_size=2, config="grpo"), f"autocast, {schedule}")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_backward_inside_autocast_is_the_float32_one(backend):
    """backward() run inside torch.autocast (bf16), as _head does: the reference backend's GEMMs ran their
    backward in bf16 there (weight gradient 2.6e-3 off); every backend gives the float32 run's gradients."""
    h, w, ids, adv = _inputs(4, 3)
    kw = dict(group_size=2, config=GTPOConfig(entropy_threshold=None), backend=backend)
    plain = _head(h, w, ids, adv, **kw)
    with torch.autocast("cpu", torch.bfloat16):
        got = _head(h, w, ids, adv, **kw)
    for a, b, name in zip(got[1:], plain[1:], ("hidden", "weight")):
        assert a.dtype == torch.float32 and torch.equal(a, b), f"grad {name} under autocast differs"


def test_reference_head_backward_twice_and_second_order():
    """backend='reference': backward(retain_graph=True) then backward() doubles the gradients, and a
    second-order gradient flows (nonzero, never silently 0), with and without autocast."""
    h, w, ids, adv = _inputs(4, 3)
    kw = dict(group_size=2, config=GTPOConfig(entropy_threshold=None), backend="reference")
    for cast in (False, True):
        hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16, enabled=cast):
            loss = linear_gtpo_loss(hh, ww, ids, adv, **kw).loss
            loss.backward(retain_graph=True)
            once = ww.grad.clone()
            loss.backward()
        torch.testing.assert_close(ww.grad, 2 * once)
        hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        with torch.autocast("cpu", torch.bfloat16, enabled=cast):
            gw, = torch.autograd.grad(linear_gtpo_loss(hh, ww, ids, adv, **kw).loss, ww, create_graph=True)
            assert torch.autograd.grad(gw.pow(2).sum(), ww)[0].norm() > 0


@pytest.mark.parametrize("preset", ["gtpo", "gspo"])
def test_lying_max_seqlen_does_not_plan_the_tiles(preset):
    """Packed, validate=False, max_seqlen = 2 while completions hold up to 6 tokens, tiles of 3 rows:
    the statistics of a whole completion (entropy filter and shaping, sequence-level ratio) must not be
    computed from a tile's part of it. Results equal the reference."""
    B, T = 4, 6
    h, w, ids, adv = _inputs(B, T, seed=3)
    # no conflict mask: its weights come from a padded layout of max_seqlen columns (a separate matter)
    cfg = GTPOConfig.preset(preset, entropy_threshold=10.0, use_conflict_mask=False) if preset == "gtpo" else \
        GTPOConfig.preset(preset)
    lengths = torch.tensor([6, 2, 5, 3])
    mask = torch.arange(T)[None] < lengths[:, None]
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    hp, idp = h[mask], ids[mask]
    budget = 3 * row_bytes(w.shape[0], w.dtype, w.device)
    noise = torch.randn(int(lengths.sum()), generator=torch.Generator().manual_seed(4)) * 1e-4
    old = linear_token_logprobs(hp, w, idp, cu_seqlens=cu)[0] + noise  # ratios near 1: nothing clipped
    kw = dict(group_size=2, config=cfg, cu_seqlens=cu, old_logps=old)
    ref = _reference(hp, w, idp, adv, **kw)
    for schedule in ("auto", "recompute"):
        got = _head(hp, w, idp, adv, max_seqlen=2, memory_budget=budget, validate=False, schedule=schedule,
                    backend="torch", **kw)
        assert float(got[0].metrics["clip_frac"]) == 0
        _close(got, ref, f"{preset}, max_seqlen=2 unvalidated, schedule={schedule!r}")


def test_head_errors_name_the_argument():
    h, w, ids, adv = _inputs(2, 3)
    with pytest.raises(ValueError, match=r"weight must be .*\(V, D\).*looks transposed.*weight\.t\(\)"):
        linear_gtpo_loss(h, w.t(), ids, adv, group_size=2)
    prompt = torch.randn(2, 7, h.shape[-1])
    with pytest.raises(ValueError, match=r"hidden must have shape \(2, 3, 8\).*hidden\[:, 3:6\]"):
        linear_gtpo_loss(prompt, w, ids, adv, group_size=2)
    with pytest.raises(ValueError, match="logits_start=3: .*slice them"):
        linear_gtpo_loss(h, w, ids, adv, group_size=2, logits_start=3)
    with pytest.raises(ValueError, match="inplace=True: .*nothing to overwrite"):
        linear_gtpo_loss(h, w, ids, adv, group_size=2, inplace=True)
    out = linear_gtpo_loss(h, w, ids, adv, group_size=2, logits_start=None, inplace=False)  # the defaults pass
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("schedule", ["fused", "recompute"])
def test_bf16_weight_gradient_accumulates_tiles_in_float32(schedule):
    """The default head on bfloat16 inputs: dL/dW and dL/db sum the tiles' products in float32 and round once
    (spec 11), so 8 tiles give the one tile's bf16 gradient but for float32's own summation order (measured:
    under 1% of the entries move). Rounding each tile's product to 16 bits before the sum moves far more."""
    g = torch.Generator().manual_seed(5)
    B, T, D, V = 4, 16, 32, 160
    h = torch.randn(B, T, D, generator=g).bfloat16()
    w = (torch.randn(V, D, generator=g) * 0.3).bfloat16()
    bias = (torch.randn(V, generator=g) * 0.1).bfloat16()
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    old = torch.randn(B, T, generator=g) * 0.3 - 4.0
    grads = []
    for rows in (B * T, 8):  # one tile, then eight
        leaves = [x.clone().requires_grad_() for x in (h, w, bias)]
        linear_gtpo_loss(leaves[0], leaves[1], ids, adv, bias=leaves[2], config="grpo", old_logps=old,
                         schedule=schedule, memory_budget=rows * row_bytes(V, torch.bfloat16, "cpu"),
                         backend="torch").loss.backward()
        grads.append([leaves[1].grad, leaves[2].grad])
    for one, many in zip(*grads):
        assert one.dtype == torch.bfloat16 and one.abs().sum() > 0
        moved = float((one != many)[one != 0].double().mean())
        assert moved <= 0.01, moved
