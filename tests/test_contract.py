"""Contract holes closed by the hardening issue (12): compile with the defaults, invalid input that is not
checked on the host gives NaN, per-token upstream gradients at uncounted tokens are ignored,
num_items_in_batch only where it means something, in-place writes only where they are safe, float64
on the Triton backend, mask values."""
import dataclasses

import pytest
import torch

import gtpo_reference as ref
from conftest import assert_grad_close, assert_value_close
from gtpo_kernels import GTPOConfig, gtpo_loss, token_logprobs
from gtpo_kernels.kernels import dispatch

BACKENDS = ["triton", "torch"]


def batch(B=4, T=6, V=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[1, :3] = ids[0, :3]  # a shared prefix: some conflict tokens
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    old = torch.randn(B, T, generator=g) * 0.1 - 3
    return x, ids, adv, old


def _packed(x, ids, old):
    B, T, V = x.shape
    return x.reshape(B * T, V), ids.reshape(-1), old.reshape(-1), dict(
        cu_seqlens=torch.arange(0, B * T + 1, T), max_seqlen=T)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("validate", [None, False])
def test_compile_fullgraph_matches_eager(backend, packed, validate):
    """torch.compile(fullgraph=True) of a step that calls gtpo_loss, with validate left at its default
    (the first thing users try: no graph break from the host-side checks) and with validate=False:
    no graph break, the same numbers as eager."""
    torch._dynamo.reset()
    x, ids, adv, old = batch()
    kw = dict(group_size=2, backend=backend, config=GTPOConfig(entropy_threshold=2.75, entropy_coef=0.01))
    if validate is not None:
        kw["validate"] = validate
    if packed:
        x, ids, old, extra = _packed(x, ids, old)
        kw.update(extra)

    def step(x, ids, adv, old):
        out = gtpo_loss(x, ids, adv, old_logps=old, **kw)
        return out.loss, out.logps, out.entropy, out.metrics["clip_frac"], out.metrics["filtered_frac"]

    xe = x.clone().requires_grad_()
    le, lpe, ee, ce, fe = step(xe, ids, adv, old)
    le.backward()
    xc = x.clone().requires_grad_()
    lc, lpc, ec, cc, fc = torch.compile(step, fullgraph=True)(xc, ids, adv, old)
    lc.backward()
    assert 0 < float(fe) < 1, "the filter should keep some completions and drop others here"
    assert_value_close("loss", lc.detach(), le.detach(), 1e-6)
    assert_value_close("logps", lpc, lpe, 1e-6)
    assert_value_close("entropy", ec, ee, 1e-6)
    assert_value_close("clip_frac", cc, ce, 1e-6)
    assert_value_close("filtered_frac", fc, fe, 1e-6)
    assert_grad_close("grad", xc.grad, xe.grad, 1e-6)
    assert xe.grad.abs().sum() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_step_with_an_invalid_id_gives_nan_not_a_wrong_number(backend):
    torch._dynamo.reset()
    x, ids, adv, old = batch()
    ids[2, 3] = 10_000  # outside [0, V), counted: validation cannot run inside the graph

    def step(x):
        out = gtpo_loss(x, ids, adv, old_logps=old, group_size=2, backend=backend)
        return out.loss, out.logps

    loss, logps = torch.compile(step, fullgraph=True)(x.clone())
    assert torch.isnan(loss) and torch.isnan(logps[2, 3])
    assert torch.isfinite(logps[~torch.isnan(logps)]).all() and torch.isnan(logps).sum() == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("on_policy", [False, True])
@pytest.mark.parametrize("bad_id", [-5, 24, 10**9])
@pytest.mark.parametrize("preset", ["grpo", "gtpo"])
def test_out_of_range_id_without_validation_gives_nan(backend, packed, on_policy, bad_id, preset):
    """grpo: only that token is NaN; gtpo: its completion's mean entropy is NaN, which shapes (and so
    makes NaN) that completion's every token; other completions stay finite."""
    x, ids, adv, old = batch()
    ids[1, 2] = bad_id
    kw = dict(group_size=2, backend=backend, validate=False,
              config=preset if preset == "grpo" else GTPOConfig(entropy_threshold=None))
    where = (1, 2)
    if packed:
        x, ids, old, extra = _packed(x, ids, old)
        kw.update(extra)
        where = (1 * 6 + 2,)
    x = x.requires_grad_()
    out = gtpo_loss(x, ids, adv, old_logps=None if on_policy else old, **kw)
    assert torch.isnan(out.loss), "the loss must be NaN, never a finite wrong value"
    row = 1 * 6 + 2
    nan_tokens = torch.zeros(24, dtype=torch.bool)
    nan_tokens[row if preset == "grpo" else slice(6, 12)] = True
    for name in ("logps", "entropy", "per_token_loss"):
        v = getattr(out, name).reshape(-1)
        assert torch.isnan(v[row]), name
        expect = nan_tokens if name == "per_token_loss" else (torch.arange(24) == row)
        assert torch.equal(torch.isnan(v), expect), f"{name}: NaN at {torch.isnan(v).nonzero().tolist()}"
    out.loss.backward()  # no index error
    g = x.grad.reshape(-1, x.shape[-1])
    assert torch.isnan(g[row]).all()
    assert torch.equal(torch.isnan(g).any(-1), nan_tokens)
    assert torch.isfinite(g[~nan_tokens]).all() and g[~nan_tokens].abs().sum() > 0
    lp, ent = token_logprobs(x.detach(), ids, 1.0, validate=False, backend=backend,
                             **({} if not packed else dict(cu_seqlens=kw["cu_seqlens"])))
    assert torch.isnan(lp[where]) and torch.isnan(ent[where]) and torch.isnan(lp).sum() == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_none_aggregation_ignores_upstream_at_uncounted_tokens(backend):
    x, ids, adv, old = batch()
    mask = torch.ones(ids.shape, dtype=torch.bool)
    mask[0, 4:] = False
    mask[3, :2] = False
    cfg = GTPOConfig(loss_agg="none", entropy_threshold=None, entropy_coef=0.01)
    up = torch.rand(ids.shape) + 0.5
    poisoned = torch.where(mask, up, torch.tensor(float("inf")))
    poisoned[3, 0] = float("nan")
    grads = []
    for u in (poisoned, torch.where(mask, up, torch.zeros(()))):
        xx = x.clone().requires_grad_()
        out = gtpo_loss(xx, ids, adv, mask, old_logps=old, group_size=2, config=cfg, backend=backend)
        (out.loss * u).sum().backward()
        grads.append(xx.grad)
    assert torch.isfinite(grads[0]).all(), "0 * inf at an uncounted token"
    assert grads[1].abs().sum() > 0
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                                 "gtpo-official", "none"])
def test_num_items_in_batch_is_refused_where_it_means_nothing(agg):
    x, ids, adv, _ = batch()
    with pytest.raises(ValueError, match="num_items_in_batch is the denominator of loss_agg='token-mean'"):
        gtpo_loss(x, ids, adv, group_size=2, config=GTPOConfig(loss_agg=agg), num_items_in_batch=100)


@pytest.mark.parametrize("num_items", [57, 57.0, torch.tensor(57.0), torch.tensor([57])])
def test_num_items_in_batch_is_the_token_mean_denominator(num_items):
    x, ids, adv, old = batch()
    cfg = GTPOConfig.preset("dapo")
    local = gtpo_loss(x, ids, adv, old_logps=old, group_size=2, config=cfg)
    glob = gtpo_loss(x, ids, adv, old_logps=old, group_size=2, config=cfg, num_items_in_batch=num_items)
    assert_value_close("loss", glob.loss * 57, local.loss * ids.numel(), 1e-6)
    assert abs(float(local.loss)) > 0
    with pytest.raises(ValueError, match="num_items_in_batch must be a positive"):
        gtpo_loss(x, ids, adv, group_size=2, config=cfg, num_items_in_batch=torch.ones(2))


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_on_overlapping_rows_is_refused(backend):
    x, ids, adv, _ = batch()
    shared = x[:1].expand(4, -1, -1)  # four completions reading one row of memory
    with pytest.raises(ValueError, match="rows do not overlap"):
        gtpo_loss(shared, ids, adv, group_size=2, inplace=True, backend=backend)
    zero_stride = torch.randn(4, 1, 24).expand(4, 6, 24)
    with pytest.raises(ValueError, match="rows do not overlap"):
        gtpo_loss(zero_stride, ids, adv, group_size=2, inplace=True, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_on_a_strided_view_writes_the_gradient_there(backend):
    """A non-contiguous but non-overlapping view (columns 1..6 of a wider buffer) is accepted with
    inplace=True: the loss and the gradient equal the float64 reference, and the columns around the
    view are not written."""
    x, ids, adv, old = batch()
    cfg = GTPOConfig(entropy_threshold=None)  # random logits: the ln 2 filter would drop every completion
    buf = torch.randn(4, 9, 24, generator=torch.Generator().manual_seed(7))
    buf[:, 1:7] = x
    before = buf.clone()
    view = buf[:, 1:7].detach().requires_grad_()  # a leaf over buf's storage, strides of buf
    assert not view.is_contiguous() and view.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    xr = x.double().requires_grad_()
    r = ref.gtpo_loss(xr, ids, adv, group_size=2, old_logps=old, **dataclasses.asdict(cfg))
    r["loss"].backward()
    assert xr.grad.abs().sum() > 0 and (r["lam"] != 1).any()
    out = gtpo_loss(view, ids, adv, group_size=2, old_logps=old, config=cfg, inplace=True, backend=backend)
    assert torch.equal(buf, before)  # the forward does not touch them
    out.loss.backward()
    assert_value_close("loss", out.loss.detach(), r["loss"].detach(), 1e-5)
    assert_grad_close("inplace grad", view.grad, xr.grad, 1e-5)
    assert torch.equal(buf[:, 1:7], view.grad)  # written over the view's logits (then copied by autograd)
    assert torch.equal(buf[:, 0], before[:, 0]) and torch.equal(buf[:, 7:], before[:, 7:])


def test_inplace_inside_torch_compile_says_it_cannot():
    torch._dynamo.reset()
    x, ids, adv, _ = batch()

    def step(x):
        return gtpo_loss(x, ids, adv, group_size=2, inplace=True, backend="torch").loss

    with pytest.raises(Exception, match="inplace=True is not supported inside torch.compile"):
        torch.compile(step, fullgraph=True)(x.clone().requires_grad_())


def test_float64_logits_on_the_triton_backend_are_refused_and_auto_takes_torch():
    x, ids, adv, _ = batch()
    with pytest.raises(TypeError, match="float64"):
        gtpo_loss(x.double(), ids, adv, group_size=2, backend="triton")
    assert dispatch.resolve_backend("auto", torch.device("cuda"), torch.float64) == "torch"
    assert dispatch.resolve_backend("auto", torch.device("cuda"), torch.bfloat16) == "triton"
    out = gtpo_loss(x.double(), ids, adv, group_size=2,  # auto on CPU: the torch path, in float64
                    config=GTPOConfig(entropy_threshold=None))  # random logits: above any entropy bound
    assert out.loss.dtype == torch.float64


@pytest.mark.parametrize("bad", [torch.tensor(0.5), torch.tensor(2), torch.tensor(-1.0)])
def test_completion_mask_values_other_than_0_and_1_are_refused(bad):
    x, ids, adv, _ = batch()
    mask = torch.ones(ids.shape, dtype=bad.dtype)
    mask[2, 3] = bad
    with pytest.raises(ValueError, match="completion_mask must hold only 0 and 1"):
        gtpo_loss(x, ids, adv, mask, group_size=2)
    # without validation any nonzero value counts as 1 (documented)
    a = gtpo_loss(x, ids, adv, mask, group_size=2, validate=False, config="grpo")
    b = gtpo_loss(x, ids, adv, mask != 0, group_size=2, config="grpo")
    assert torch.equal(a.loss, b.loss)


@pytest.mark.parametrize("preset", ["grpo", "dapo"])
def test_unused_group_size_that_does_not_divide_the_batch_is_named_in_a_warning(preset):
    """The TRL-family presets compute no conflict weights, so group_size is unused there: one that does
    not divide B (a micro-batch across groups) is accepted, with a warning naming it and the preset; one
    that is not a positive int is refused; with GTPO's conflict weights it must divide B."""
    x, ids, adv, _ = batch()
    x, ids, adv = x[:3], ids[:3], adv[:3]
    with pytest.warns(UserWarning, match=rf"^group_size = 2 does not divide the number of completions B = 3, "
                                         rf"and is unused: config='{preset}' computes no conflict weights"):
        out = gtpo_loss(x, ids, adv, group_size=2, config=preset, backend="torch")
    assert torch.equal(out.loss, gtpo_loss(x, ids, adv, config=preset, backend="torch").loss)
    with pytest.raises(ValueError, match="group_size must be a positive int, got 0"):
        gtpo_loss(x, ids, adv, group_size=0, config=preset, backend="torch")
    with pytest.raises(ValueError, match="group_size = 2 must divide the number of completions B = 3"):
        gtpo_loss(x, ids, adv, group_size=2, config=GTPOConfig.preset("gtpo", entropy_threshold=None),
                  backend="torch")
