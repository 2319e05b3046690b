"""Property tests of the Triton kernels (under the interpreter) and the torch path against the float64
reference, with the error measure and tolerances of spec section 7. What holds without the reference
(invariances, hand-worked conflict weights, refusals, what backward saves): tests/test_kernel_properties.py."""
import contextlib
import dataclasses
import math
import os

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import gtpo_reference as ref
from batches import DTYPES, cases, cases_and_configs, completion_entropies, reference_logps
from conftest import TOL, assert_grad_close, assert_value_close, examples
from gtpo_kernels import GTPOConfig, conflict_weights, gtpo_loss, token_logprobs
from gtpo_kernels.kernels import dispatch, ops, vocab_torch, vocab_triton

BACKENDS = ["triton", "torch"]
# GTPO_TEST_DEVICE=cuda (with TRITON_INTERPRET=0, as bench/gpu_check.sh runs them) sends our side of the
# property tests to the GPU: compiled Triton kernels against the same float64 reference on the CPU.
DEVICE = os.environ.get("GTPO_TEST_DEVICE", "cpu")


def dev(*xs):
    out = tuple(None if x is None else x.to(DEVICE) for x in xs)
    return out if len(out) > 1 else out[0]


@contextlib.contextmanager
def small_chunks(on):
    """Several vocabulary blocks per row (Triton) and several row chunks (torch) at test sizes."""
    saved = vocab_triton.MAX_BLOCK_V, vocab_torch.CHUNK_ELEMENTS
    if on:
        vocab_triton.MAX_BLOCK_V, vocab_torch.CHUNK_ELEMENTS = 16, 64
    try:
        yield
    finally:
        vocab_triton.MAX_BLOCK_V, vocab_torch.CHUNK_ELEMENTS = saved


class _PoisonedTorch:
    """`torch` as our modules see it, except that empty / empty_like come back filled with NaN (or -77):
    outputs that nobody writes show up. (Patching torch itself would leak into torch.compile's tables.)"""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _poison(x):
        return x.fill_(float("nan")) if x.dtype.is_floating_point else x.fill_(-77)

    def empty(self, *a, **k):
        return self._poison(torch.empty(*a, **k))

    def empty_like(self, *a, **k):
        return self._poison(torch.empty_like(*a, **k))


@contextlib.contextmanager
def poisoned_empty():
    """Every torch.empty / empty_like in gtpo_kernels is filled with NaN while the block runs."""
    import gtpo_kernels.kernels.autograd as ag
    import gtpo_kernels.kernels.conflict_triton as ct
    mods = (vocab_triton, vocab_torch, ag, ct)
    saved = [m.torch for m in mods]
    for m in mods:
        m.torch = _PoisonedTorch()
    try:
        yield
    finally:
        for m, t in zip(mods, saved):
            m.torch = t


def window(case):
    T = case.ids.shape[1]
    return case.logits[:, case.logits_start:case.logits_start + T]


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(25))  # CI time: nightly runs 250
@given(case=cases(dtypes=DTYPES + [torch.float64]), small=st.booleans())
def test_token_logprobs_match_reference(backend, case, small):
    if backend == "triton" and case.logits.dtype == torch.float64:  # refused, not accumulated in float32
        with pytest.raises(TypeError, match="float64"):
            token_logprobs(*dev(case.logits, case.ids), case.temperature, dev(case.mask),
                           logits_start=case.logits_start, backend=backend)
        return
    with small_chunks(small), poisoned_empty():
        lp, ent = token_logprobs(*dev(case.logits, case.ids), case.temperature, dev(case.mask),
                                 logits_start=case.logits_start, backend=backend)
    lp, ent = lp.cpu(), ent.cpu()
    rlp, rent = ref.token_logprobs(window(case).double(), case.ids, case.temperature, case.counted)
    tol = TOL[case.logits.dtype]["value"]
    assert lp.dtype == (torch.float64 if case.logits.dtype == torch.float64 else torch.float32)
    assert_value_close("logp", lp, rlp, tol)
    assert_value_close("entropy", ent, rent, tol)
    assert (lp[~case.counted] == 0).all() and (ent[~case.counted] == 0).all()


def _run_both(case, cfg, backend, old=None, refl=None, small=False, upstream=None, **kw):
    """(our output, our grad, reference dict, reference grad) for one case."""
    x = dev(case.logits).clone().requires_grad_()
    args = dict(group_size=case.G, old_logps=old, ref_logps=refl, logits_start=case.logits_start, **kw)
    dargs = dict(args, old_logps=dev(old), ref_logps=dev(refl))
    with small_chunks(small), poisoned_empty():
        out = gtpo_loss(x, *dev(case.ids, case.adv, case.mask), config=cfg, backend=backend, **dargs)
        loss = out.loss if upstream is None else (out.loss * dev(upstream)).sum()
        loss.backward()
    out = type(out)(**{k: (v.detach().cpu() if torch.is_tensor(v) else {a: b.cpu() for a, b in v.items()})
                       for k, v in out.__dict__.items()})
    xr = case.logits.double().requires_grad_()
    r = ref.gtpo_loss(xr, case.ids, case.adv, case.mask, **args, **dataclasses.asdict(cfg))
    rloss = r["loss"] if upstream is None else (r["loss"] * upstream.double()).sum()
    rloss.backward()
    return out, x.grad.cpu(), r, xr.grad


LOSS_DTYPES = {"triton": DTYPES, "torch": DTYPES + [torch.float64]}  # Triton refuses float64 logits


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(20))  # CI time: nightly runs 200
@given(data=st.data(), old_noise=st.sampled_from([None, 0.05, 1.0]), small=st.booleans(),
       seed=st.integers(0, 1000))
def test_loss_and_gradient_match_reference(backend, data, old_noise, small, seed):
    case, cfg = data.draw(cases_and_configs(dtypes=LOSS_DTYPES[backend], min_V=2, nonempty=True),
                          label="case, config")
    gen = torch.Generator().manual_seed(seed)
    rlp = reference_logps(case)
    B, T = case.ids.shape
    nan = torch.full((B, T), float("nan"))
    old = refl = None
    if old_noise is not None:  # ratios inside and outside the clip range; NaN where masked (ignored)
        noise = old_noise * torch.randn(B, T, generator=gen)
        first = (case.counted.cumsum(1) == 1) & case.counted  # each completion's first counted token
        noise = torch.where(first, noise.clamp(-0.1, 0.1), noise)  # keeps a ratio inside the clip range
        old = torch.where(case.counted, rlp + noise, nan).float()
        r = torch.exp(rlp - old.double())[case.counted]
        assume(((r - (1 - cfg.eps_low)).abs().min() > 1e-4) if r.numel() else True)
        assume(((r - (1 + cfg.eps_high)).abs().min() > 1e-4) if r.numel() else True)
    if cfg.beta > 0:
        refl = torch.where(case.counted, rlp + 0.3 * torch.randn(B, T, generator=gen), nan).float()
    upstream = torch.rand(B, T, generator=gen) + 0.5 if cfg.loss_agg == "none" else None
    # keep the filter decision away from its threshold (float32 vs float64 can differ there)
    if cfg.entropy_threshold is not None:
        hbar, _ = completion_entropies(case)
        assume(((hbar - cfg.entropy_threshold).abs() > 1e-4).all())
    out, g, r, rg = _run_both(case, cfg, backend, old, refl, small, upstream)

    tol = TOL[case.logits.dtype]
    assert_value_close("loss", out.loss.detach(), r["loss"].detach(), tol["loss"])
    for name in ("logps", "entropy", "per_token_loss", "seq_entropy", "lam", "n_conf"):
        assert_value_close(name, getattr(out, name), r[name], tol["value"])
    assert torch.equal(out.kept, r["kept"])
    for k, v in r["metrics"].items():
        assert_value_close(f"metrics[{k}]", out.metrics[k], v, 1e-6)
    assert g.dtype == case.logits.dtype
    assert_grad_close("grad logits", g, rg, tol["grad"])
    # an all-zero reference gradient compares little: the strategy makes it rare (zero advantages
    # without shaping, every token clipped or weighted 0), and such an example does not count
    assume((rg != 0).any())


def _transformed(z, scale, softcap):
    """The tile's transforms of spec 11 on materialized logits (the reference side)."""
    z = z * scale
    return z if softcap is None else softcap * torch.tanh(z / softcap)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(15))  # CI time: nightly runs 150
@given(seed=st.integers(0, 2**20), dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       transform=st.sampled_from([(0.6, None), (1.0, 4.0), (2.5, 3.0)]), tau=st.sampled_from([0.7, 1.3]),
       has_e=st.booleans(), inplace=st.booleans(), small=st.booleans())
def test_transforms_match_reference(backend, seed, dtype, transform, tau, has_e, inplace, small):
    """scale and softcap applied inside the vocabulary passes (forward values and the gradient of the raw
    logits) against the float64 reference on materialized transformed logits: -inf entries, saturated
    and small tanh arguments, uncounted tokens, rows outside the completion window, in-place backward."""
    scale, softcap = transform
    gen = torch.Generator().manual_seed(seed)
    B, T, start, V = 2, 5, 1, 37
    z = (6 * torch.randn(B, start + T + 1, V, generator=gen)).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=gen)
    counted = torch.rand(B, T, generator=gen) < 0.8
    counted[0, 0] = True
    ban = torch.rand(z.shape, generator=gen) < 0.2  # -inf entries (banned vocabulary), never a target
    ban[:, start:start + T].scatter_(2, ids[..., None], False)
    z = z.masked_fill(ban, float("-inf"))
    c = torch.randn(B * T, generator=gen) * counted.reshape(-1)
    e = torch.randn(B * T, generator=gen) * counted.reshape(-1) if has_e else None
    zr = z.double().requires_grad_()
    rlp, rent = ref.token_logprobs(_transformed(zr, scale, softcap)[:, start:start + T], ids, tau, counted)
    obj = (rlp.reshape(-1) * c.double()).sum() + (0 if e is None else (rent.reshape(-1) * e.double()).sum())
    rg, = torch.autograd.grad(obj, zr)
    assert (rg != 0).any()
    zd, idd, cd = dev(z, ids.reshape(-1), counted.reshape(-1))
    temp = ops.as_tensor_param(tau)
    with small_chunks(small), poisoned_empty():
        lp, ent, stats, bad = ops.vocab_fwd(zd, idd, cd, temp, start, scale, softcap, backend)
        if inplace:
            grad = zd.clone()
            ops.vocab_bwd_inplace(grad, idd, stats, ent, *dev(c, e), temp, start, scale, softcap, backend)
        else:
            grad = torch.full_like(zd, float("nan"))  # poisoned: every entry must be written
            dispatch.vocab_bwd(backend, zd, grad, idd, stats, ent, *dev(c, e), temp, start, scale, softcap)
    tol = TOL[dtype]
    assert (bad.cpu() == 0).all()
    assert_value_close("logp", lp.cpu(), rlp.detach().reshape(-1), tol["value"])
    assert_value_close("entropy", ent.cpu(), rent.detach().reshape(-1), tol["value"])
    assert grad.dtype == dtype
    assert_grad_close("grad of the raw logits", grad.cpu(), rg, tol["grad"])


@given(case=cases(max_T=8), w=st.sampled_from([(2.0, 0.0), (1.5, 0.5)]))
def test_conflict_weights_match_reference(case, w):
    cfg = GTPOConfig(conflict_pos_weight=w[0], conflict_neg_weight=w[1])
    lam, n_conf = conflict_weights(case.ids, case.mask, case.adv, case.G, config=cfg)
    rlam, rn = ref.conflict_weights(case.ids, case.mask, case.adv, case.G, *w)
    assert torch.equal(lam.double(), rlam) and torch.equal(n_conf.double(), rn)
