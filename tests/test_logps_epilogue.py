"""The loss math in the epilogue kernel on log-probs computed elsewhere (pipeline/logps_epilogue.py):
gtpo_loss_from_logps(backend='triton') against its eager twin (the torch backend: loss.logps_loss) and the
float64 reference, on fresh random inputs: values, outputs, metrics and gradients (the reference's not zero),
every aggregation ('none' with an upstream gradient that is inf where a token is not counted), padded and
packed, with and without entropies, half precision; unvalidated invalid input gives NaN as the twin does,
validating raises the twin's error; the new kernels compile for the GPUs. The kept sets' path:
tests/test_replay_epilogue.py. Tolerances: spec 7 (float32: 1e-5)."""
import warnings

import pytest
import torch
from conftest import assert_grad_close, assert_value_close, compiled_ahead

import gtpo_reference as ref
from bench.launches import counting
from gtpo_kernels import GTPOConfig, gtpo_loss_from_logps

TOL = 1e-5
OUTS = ("logps", "entropy", "per_token_loss", "lam")


def _config(agg, entropy, hbar=None):
    """With entropies: GTPO with the bonus (a gradient w.r.t. them) and the filter's threshold between two
    completions' mean entropies; without: grpo with the KL."""
    if not entropy:
        return GTPOConfig.preset("grpo", beta=0.04, loss_agg=agg)
    srt = hbar.sort().values
    gaps = srt[1:] - srt[:-1]
    k = int(gaps.argmax())
    return GTPOConfig.preset("gtpo", loss_agg=agg, entropy_coef=0.01,
                             entropy_threshold=float(srt[k] + gaps[k] / 2))


def _tokens(seed, B=4, T=5, V=16):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 3
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    adv = torch.randn(B, generator=g)
    noise = torch.randn(2, B, T, generator=g, dtype=torch.float64)
    return z, ids, mask, adv, noise


def _extras(lp, noise):
    """old log-probs off the current ones (ratios within the clip and outside it), ref ones |d| >= 0.05 away
    (the KL's float32 conditioning: tests/test_kl_conditioning.py)."""
    return dict(old_logps=(lp + 0.3 * noise[0]).float(),
                ref_logps=(lp + 0.1 * torch.sign(noise[1]) * (0.5 + noise[1].abs())).float())


def _pack(x, mask):
    return x[mask] if x.dim() == 2 else x


def _padded(x, mask):
    return x if x.dim() == 2 else torch.zeros(mask.shape, dtype=x.dtype).masked_scatter(mask, x)


def _upstream(mask, seed=1):
    return torch.where(mask, torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed)) + 0.5,
                       torch.full(mask.shape, float("inf")))


def _backward(out, up):
    out.loss.backward() if out.loss.dim() == 0 else out.loss.backward(up)


def _compare(name, a, b, mask, packed, entropy_given=True):
    """Outputs of two calls (a: ours) at the counted tokens, per completion, and the metrics."""
    pad = (lambda x: _padded(x, mask)) if packed else (lambda x: x)
    loss_a, loss_b = a.loss.detach(), b.loss.detach()
    if loss_a.dim():
        loss_a, loss_b = pad(loss_a), pad(loss_b)
        assert_value_close(f"{name} loss", loss_a, loss_b, TOL, where=mask)
    else:
        assert_value_close(f"{name} loss", loss_a, loss_b, TOL)
    for f in OUTS if entropy_given else ("logps", "per_token_loss", "lam"):
        assert_value_close(f"{name} {f}", pad(getattr(a, f)), pad(getattr(b, f)), TOL, where=mask)
    assert_value_close(f"{name} n_conf", a.n_conf, b.n_conf, TOL)
    assert torch.equal(a.kept, b.kept), name
    assert_value_close(f"{name} seq_entropy", a.seq_entropy, b.seq_entropy, TOL)


def _metrics_equal(a, b, ordered=True):
    assert list(a.metrics) == list(b.metrics) if ordered else sorted(a.metrics) == sorted(b.metrics)
    for k in a.metrics:
        assert_value_close(k, a.metrics[k], b.metrics[k], TOL)


CASES = [("seq-mean-token-mean", False, True), ("token-mean", True, True), ("seq-mean-token-sum", False, False),
         ("seq-mean-token-sum-norm", True, False), ("gtpo-official", False, True), ("none", True, True),
         ("none", False, False)]


CASE_IDS = [f"{a}-{'packed' if p else 'padded'}-{'entropy' if e else 'no-entropy'}" for a, p, e in CASES]
# each case's rollout weights (drawn; the epilogue reads them): per token (-1 where not counted: ignored), per
# completion (B, 1), or (B,) in the padded form; or none
WEIGHTS = ["token", "completion", None, "token", "completion-flat", "completion", "token"]


def _weights(kind, mask, seed):
    """Rollout weights in [0.5, 1.5) of `kind` (WEIGHTS) for the padded (B, T) batch, or None."""
    if kind is None:
        return None
    g = torch.Generator().manual_seed(100 + seed)
    B, T = mask.shape
    if kind == "token":
        return torch.where(mask, torch.rand(B, T, generator=g) + 0.5, torch.full((B, T), -1.0))
    w = torch.rand(B, 1, generator=g) + 0.5
    return w.reshape(B) if kind == "completion-flat" else w


@pytest.mark.parametrize("agg,packed,entropy", CASES, ids=CASE_IDS)
def test_from_logps_matches_twin_and_reference(agg, packed, entropy):
    case = CASES.index((agg, packed, entropy))
    z, ids, mask, adv, noise = _tokens(case)
    rw = _weights(WEIGHTS[case], mask, case)
    zr = z.clone().requires_grad_()
    lp64, H64 = ref.token_logprobs(zr, ids, 1.0, mask)
    hbar = (H64.detach() * mask).sum(1) / mask.sum(1)
    cfg = _config(agg, entropy, hbar)
    kw = dict(_extras(lp64.detach(), noise), group_size=2, config=cfg, validate=False,
              rollout_logps=(lp64.detach() + 0.2 * noise[1]).float())
    if rw is not None:
        kw["rollout_is_weights"] = rw
    up = _upstream(mask)
    args, upstream = (ids, adv, mask), (_pack(up, mask) if packed else up)
    if packed:
        kw = {k: _pack(v, mask) if isinstance(v, torch.Tensor) and v.shape == mask.shape else v
              for k, v in kw.items()}
        kw.update(cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(1).cumsum(0)]),
                  max_seqlen=int(mask.sum(1).max()))
        args = (ids[mask], adv, None)
    runs = {}
    for backend in ("triton", "torch"):
        x = _pack(lp64.detach().float(), mask).requires_grad_() if packed else lp64.detach().float().requires_grad_()
        h = (_pack(H64.detach().float(), mask) if packed else H64.detach().float()).requires_grad_()
        with counting() as c:
            out = gtpo_loss_from_logps(x, *args, entropy=h if entropy else None, backend=backend, **kw)
            _backward(out, upstream)
        runs[backend] = (out, x.grad, h.grad, c)
    (out, gx, gh, c), (twin, tgx, tgh, _) = runs["triton"], runs["torch"]
    assert c.triton_names.get("_epilogue_kernel") == 1 and c.launches <= 5, (c.launches, dict(c.triton_names))
    _compare("triton vs torch", out, twin, mask, packed, entropy)
    _metrics_equal(out, twin)
    assert_grad_close("grad logps", _padded(gx, mask), _padded(tgx, mask).double(), TOL)
    assert (_padded(gx, mask)[~mask] == 0).all()
    assert (gh is None) == (tgh is None) and (gh is not None) == (entropy and cfg.entropy_coef != 0)
    if gh is not None:
        assert_grad_close("grad entropy", _padded(gh, mask), _padded(tgh, mask).double(), TOL)
    # against the float64 reference on the logits that gave the log-probs (chained back to them)
    ref_kw = {k: v.double() for k, v in _extras(lp64.detach(), noise).items()}
    zref = z.clone().requires_grad_()
    r = ref.gtpo_loss(zref, ids, adv.double(), mask, group_size=2, **ref_kw, **_ref_config(cfg),
                      rollout_is_weights=None if rw is None else rw.double())
    (r["loss"] if r["loss"].dim() == 0 else (r["loss"] * torch.where(mask, up, 0.0).double()).sum()).backward()
    assert zref.grad.abs().sum() > 0
    grads = [_padded(gx, mask).double()] + ([_padded(gh, mask).double()] if gh is not None else [])
    (gz,) = torch.autograd.grad([lp64, H64][:len(grads)], zr, grads)
    assert_grad_close("grad logits (through the log-probs)", gz, zref.grad, TOL)
    loss = _padded(out.loss.detach(), mask) if packed and out.loss.dim() else out.loss.detach()
    assert_value_close("loss vs reference", loss, r["loss"].detach(), TOL, where=mask if loss.dim() else None)
    assert_value_close("logps vs reference", _padded(out.logps, mask), r["logps"], TOL, where=mask)
    assert torch.equal(out.kept, r["kept"])


def _ref_config(cfg):
    keys = ("eps_low", "eps_high", "clip", "use_conflict_mask", "conflict_pos_weight", "conflict_neg_weight",
            "entropy_threshold", "entropy_penalty", "initial_entropy", "entropy_coef", "beta", "loss_agg",
            "max_completion_length", "policy_loss", "importance_sampling_level", "delta", "use_bias_correction_kl",
            "dual_clip_c")
    return {k: getattr(cfg, k) for k in keys}


def _nan_where_counted(out, counted):
    assert torch.isnan(out.loss).all()
    for f in ("logps", "entropy", "per_token_loss"):
        assert torch.isnan(getattr(out, f).reshape(counted.shape)[counted]).all(), f


@pytest.mark.parametrize("where", ["counted", "uncounted", "cu_seqlens"])
def test_from_logps_unvalidated_nonfinite_entropy_or_malformed_cu(where):
    """validate=False: a non-finite entropy at a counted token, or malformed cu_seqlens, makes every output
    (the metrics too: the entropy filter's count was a finite number, and a different one on each path)
    and the gradient at the counted tokens NaN (spec 6), as on the eager path; one at an uncounted token
    is ignored."""
    z, ids, mask, adv, noise = _tokens(7)
    mask[1, 1] = False
    lp, H = (x.float() for x in ref.token_logprobs(z, ids, 1.0, mask))
    H[1, 1 if where == "uncounted" else 0] = float("inf")
    args, kw, counted = (ids, adv, mask), {}, mask
    if where == "cu_seqlens":
        H[1, 0] = 1.0
        args, kw = (ids.reshape(-1), adv, None), dict(cu_seqlens=torch.tensor([0, 5, 4, 15, 20]))
        lp, H, counted = lp.reshape(-1), H.reshape(-1), torch.ones(20, dtype=torch.bool)
    runs = {}
    for backend in ("triton", "torch"):
        x = lp.clone().requires_grad_()
        out = gtpo_loss_from_logps(x, *args, entropy=H, config="gtpo", group_size=2, validate=False,
                                   backend=backend, **kw)
        out.loss.backward()
        runs[backend] = (out, x.grad)
    (out, grad), (twin, tgrad) = runs["triton"], runs["torch"]
    if where == "uncounted":
        assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
        _compare("finite", out, twin, mask, False)
        assert_grad_close("grad", grad, tgrad.double(), TOL)
        return
    for o, gr in ((out, grad), (twin, tgrad)):
        _nan_where_counted(o, counted)
        assert all(bool(torch.isnan(v)) for v in o.metrics.values()), o.metrics
        assert torch.isnan(gr.reshape(counted.shape)[counted]).all()
        assert (gr.reshape(counted.shape)[~counted] == 0).all()


def test_validating_raises_the_twins_errors_and_warns_at_the_caller():
    z, ids, mask, adv, noise = _tokens(8)
    lp, H = (x.float() for x in ref.token_logprobs(z, ids, 1.0, mask))
    bad = H.clone()
    bad[2, 0] = float("nan")
    errors = {}
    for backend in ("triton", "torch"):
        with pytest.raises(ValueError) as e:
            gtpo_loss_from_logps(lp, ids, adv, mask, entropy=bad, config="gtpo", group_size=2, backend=backend)
        errors[backend] = str(e.value)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = gtpo_loss_from_logps(lp, ids, adv, mask, entropy=H, group_size=2, backend=backend,
                                       config=GTPOConfig(entropy_threshold=1e-3))
        drop = [x for x in w if "dropped every completion" in str(x.message)]
        assert len(drop) == 1 and drop[0].filename == __file__, [(x.filename, str(x.message)) for x in w]
        assert out.loss == 0
    assert errors["triton"] == errors["torch"] and "entropy" in errors["triton"], errors


BREAKS = ("entropy", "ids_negative", "ids_2_31", "old", "ref", "lam", "n_conf", "mask", "adv", "num_items",
          "cu_seqlens", "max_seqlen", "weight_token", "weight_completion")


@pytest.mark.parametrize("bad", BREAKS)
def test_validating_in_the_kernels_raises_each_check_of_the_twin(bad):
    """Validating, the Triton path makes the value checks in its kernels (one host read: the status word) and
    on a failure raises the torch path's error, for every check the call makes; a valid call reads once and
    launches at most 4 kernels, and the entropy filter's all-dropped warning still reaches the caller."""
    z, ids, mask, adv, noise = _tokens(9)
    lp, H = (x.float() for x in ref.token_logprobs(z, ids, 1.0, mask))
    lam = torch.rand(ids.shape, dtype=torch.float32) + 0.5
    packed = bad in ("cu_seqlens", "max_seqlen")
    kw = dict(_extras(lp.double(), noise), lam=lam, n_conf=torch.full((4,), 2.0), group_size=2,
              config=GTPOConfig.preset("gtpo", beta=0.04, loss_agg="token-mean", entropy_threshold=5.0),
              num_items_in_batch=torch.tensor(float(mask.sum())))
    if bad == "weight_token":  # rollout weights per token (-1 where not counted: ignored), NaN at a counted one
        kw["rollout_is_weights"] = torch.where(mask, torch.rand(mask.shape) + 0.5, -1.0)
        kw["rollout_is_weights"][1, 2] = float("nan")
    elif bad == "weight_completion":  # per completion (B, 1), one negative
        kw["rollout_is_weights"] = torch.rand(4, 1) + 0.5
        kw["rollout_is_weights"][1, 0] = -0.5
    args = [lp, ids.clone(), adv.clone(), mask.float()]
    if packed:
        kw = {k: _pack(v, mask) if isinstance(v, torch.Tensor) and v.dim() == 2 else v for k, v in kw.items()}
        cu = torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(1).cumsum(0)])
        kw.update(cu_seqlens=cu, max_seqlen=int(mask.sum(1).max()))
        args = [lp[mask], ids[mask], adv.clone(), None]
        H = H[mask]
    pos = (1, 2) if not packed else (3,)
    if bad == "entropy":
        H = H.clone()
        H[pos] = float("inf")
    elif bad.startswith("ids"):
        args[1][pos] = -3 if bad == "ids_negative" else 2 ** 31
    elif bad in ("old", "ref", "lam"):
        key = {"old": "old_logps", "ref": "ref_logps", "lam": "lam"}[bad]
        kw[key] = kw[key].clone()
        kw[key][pos] = float("nan")
    elif bad == "n_conf":
        kw["n_conf"][2] = 0.5
    elif bad == "mask":
        args[3][0, 3] = 0.5
    elif bad == "adv":
        args[2][1] = float("-inf")
    elif bad == "num_items":
        kw["num_items_in_batch"] = torch.tensor(0.0)
    elif bad == "cu_seqlens":
        kw["cu_seqlens"] = kw["cu_seqlens"].clone()
        kw["cu_seqlens"][2] = kw["cu_seqlens"][1] - 1
    elif bad == "max_seqlen":
        kw["max_seqlen"] = int(mask.sum(1).max()) - 1
    errors = {}
    for backend in ("triton", "torch"):
        with counting() as c, pytest.raises(ValueError) as e:
            gtpo_loss_from_logps(*args, entropy=H, backend=backend, **kw)
        errors[backend] = str(e.value)
        if backend == "triton":  # the kernels' path (then the host checks, to name the error)
            assert c.triton_names.get("_epilogue_kernel") == 1, dict(c.triton_names)
    assert errors["triton"] == errors["torch"], errors


def test_validating_a_valid_call_reads_once():
    z, ids, mask, adv, noise = _tokens(10)
    lp, H = (x.float() for x in ref.token_logprobs(z, ids, 1.0, mask))
    x, kw, m = lp.clone().requires_grad_(), _extras(lp.double(), noise), mask.float()
    kw["rollout_is_weights"] = torch.rand(4, 1, generator=torch.Generator().manual_seed(10)) + 0.5
    with counting() as c:
        out = gtpo_loss_from_logps(x, ids, adv, m, entropy=H, group_size=2, backend="triton", **kw,
                                   config=GTPOConfig(entropy_threshold=5.0))
        out.loss.backward()
    assert (c.launches, c.host_reads, c.creations) == (5, 1, 0), (c.launches, dict(c.reads), dict(c.ops))
    assert x.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_from_logps_half_precision_and_strided(dtype):
    """bfloat16 / float16 log-probs and entropies, given as strided views: float32 inside, the gradients in
    their dtype, as the twin's."""
    z, ids, mask, adv, noise = _tokens(11)
    lp, H = ref.token_logprobs(z, ids, 1.0, mask)
    cfg = GTPOConfig.preset("gtpo", entropy_coef=0.01, entropy_threshold=None)
    runs = {}
    for backend in ("triton", "torch"):
        wide = torch.stack([lp, H], -1).to(dtype).requires_grad_()  # logps = wide[..., 0]: stride 2
        out = gtpo_loss_from_logps(wide[..., 0], ids, adv, mask, entropy=wide[..., 1], config=cfg, group_size=2,
                                   backend=backend, **_extras(lp, noise))
        out.loss.backward()
        runs[backend] = (out, wide.grad)
    (out, grad), (twin, tgrad) = runs["triton"], runs["torch"]
    _compare("half", out, twin, mask, False)
    assert grad.dtype == dtype and tgrad.abs().sum() > 0
    torch.testing.assert_close(grad, tgrad, rtol=1e-2, atol=1e-6)


AOT = '''
import torch
from bench.aot.compiler import _compile_ahead
from gtpo_kernels.kernels import logps_triton as L, set_check_triton as S
i64, i8, f32, b16 = torch.int64, torch.int8, torch.float32, torch.bfloat16
for arch in (90, 80, 100):
    for packed in (True, False):
        assert _compile_ahead(L._prep_kernel, arch, dict(logp_ptr=b16, ent_ptr=b16, mask_ptr=torch.bool,
                              cu_ptr=torch.int32, ids_ptr=i64, bad_out=i8, cu_out=i64), f32, dict(B=64, T=512, N=32768),
                              dict(HAS_ENT=True, HAS_MASK=True, PACKED=packed, CHECK=not packed, BLOCK=1024,
                                   VALIDATE=packed, num_warps=4)).asm.get("ptx")
        assert _compile_ahead(L._flat_sets_kernel, arch, dict(mask_ptr=torch.bool, off_ptr=i64, cu_ptr=torch.int32,
                              flat_out=i64, row_out=i64, grow_out=i64, cu_out=i64), f32,
                              dict(B=64, T=512, N=32768, M_rec=30000, K=900000, logits_start=0, s0=1 << 27, s1=151936,
                                   g0=1 << 27, g1=151936, tau_value=1.0),
                              dict(HAS_MASK=True, PACKED=packed, TAU_MODE=1 if packed else 2, BLOCK=1024,
                                   num_warps=4)).asm.get("ptx")
    assert _compile_ahead(L._set_check_kernel, arch, dict(mask_ptr=torch.bool, flat_ptr=i64, ids_ptr=i64,
                          flags_ptr=i8), f32, dict(),
                          dict(HAS_MASK=True, DUP_BLOCK=64, num_warps=4)).asm.get("ptx")
    # the LM head's recorded sets checked on the device (kernels/set_check_triton.py; their helpers are these)
    assert _compile_ahead(S._flat_offsets_kernel, arch, dict(mask_ptr=torch.bool, off_ptr=i64, flat_out=i64,
                          bad_out=torch.int32), f32, dict(N=32768, M_rec=30000, K=900000),
                          dict(BLOCK=1024, num_warps=4)).asm.get("ptx")
    assert _compile_ahead(S._set_problems_kernel, arch, dict(mask_ptr=torch.bool, flat_ptr=i64, kept_ptr=i64,
                          y_ptr=i64, bad_ptr=torch.int32, invalid_out=torch.bool, kept_out=i64), f32,
                          dict(V=151936), dict(CLAMP=True, DUP_BLOCK=64, num_warps=4)).asm.get("ptx")
    for per in (True, False):
        assert _compile_ahead(L._scale_kernel, arch, dict(gc_ptr=b16, ge_ptr=b16), f32, dict(N=32768),
                              dict(PER_TOKEN=per, HAS_E=True, BLOCK=1024, num_warps=4)).asm.get("ptx")
print("compiled")
'''


def test_kernels_compile_for_the_gpus():
    """The four kernels (and the head's two set checks) compiled ahead of time for sm_90, sm_80 and sm_100 by Triton's compiler (a process
    without the interpreter): what the interpreter does not check fails here."""
    compiled_ahead(AOT)


def test_no_per_batch_size_is_a_constexpr():
    """As tests/test_runtime.py asks of the other kernels: every per-batch size is a runtime argument that
    is never specialized (no recompilation per step)."""
    from test_runtime import _declared_do_not_specialize, _params
    from gtpo_kernels.kernels import logps_triton as L
    sizes = {"B", "T", "N", "M_rec", "K", "logits_start", "s0", "s1", "g0", "g1"}
    for kernel in (L._prep_kernel, L._flat_sets_kernel, L._set_check_kernel, L._scale_kernel):
        params, ann = _params(kernel)
        constexpr = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
        assert constexpr <= {"HAS_ENT", "HAS_MASK", "PACKED", "CHECK", "BLOCK", "TAU_MODE", "DUP_BLOCK", "PER_TOKEN",
                             "HAS_E", "VALIDATE"}, constexpr
        assert sizes & set(params) <= set(_declared_do_not_specialize(kernel)), kernel


@pytest.mark.parametrize("upstream", ["strided", "expanded"])
def test_per_token_upstream_gradient_of_any_stride(upstream):
    """loss_agg='none': the upstream gradient as a strided view, or expanded from one element (sum()'s
    backward): the twin's gradient."""
    z, ids, mask, adv, noise = _tokens(12)
    lp, H = (x.float() for x in ref.token_logprobs(z, ids, 1.0, mask))
    up = _upstream(mask)
    grads = {}
    for backend in ("triton", "torch"):
        x = lp.clone().requires_grad_()
        out = gtpo_loss_from_logps(x, ids, adv, mask, entropy=H, config=GTPOConfig(loss_agg="none", entropy_threshold=None), group_size=2,
                                   backend=backend, **_extras(lp, noise))
        if upstream == "strided":
            out.loss.backward(torch.stack([up, up * 0], -1)[..., 0])
        else:
            out.loss.sum().backward()
        grads[backend] = x.grad
    assert grads["torch"].abs().sum() > 0
    assert_grad_close("grad", grads["triton"], grads["torch"].double(), TOL)
