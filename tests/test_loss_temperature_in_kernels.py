"""gtpo_loss on its three-launch path with a temperature tensor (spec 8, 13): one per completion is read by the
forward and backward vocabulary kernels at each token's completion (padded: the token's row; packed: found in
cu_seqlens), one per token at the token, and validating, a tau that is not finite and > 0 at a counted token is
flagged in the kernel and named by the host checks (revalidate) in the eager path's order (the batch, the
loss's arguments, then the temperature): 4 launches and one host read when the inputs are valid, no launch to
spread or check the temperature. Every outcome equals the torch path's: the same error, or the same loss,
outputs and gradient (1e-5); unvalidated, NaN where the torch path gives it."""
import pytest
import torch

from gtpo_kernels import GTPOConfig, gtpo_loss

B, T, V = 4, 5, 16
CASES = [(tau, form, flaw, validate) for tau in ("completion", "token") for form in ("padded", "packed")
         for flaw in ("none", "tau_counted", "tau_uncounted", "adv_then_tau") for validate in (True, False)]


def _call(tau_kind, form, flaw, seed):
    g = torch.Generator().manual_seed(seed)
    z, ids = torch.randn(B, T, V, generator=g) * 2, torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    if flaw == "tau_uncounted" and tau_kind == "completion":
        mask[2] = False  # completion 2 counts no token (packed: it is empty): its tau is never read, nor refused
    adv = torch.randn(B, generator=g)
    tau_c, tau_t = torch.rand(B, generator=g) + 0.5, torch.rand(B, T, generator=g) + 0.5
    if flaw in ("tau_counted", "adv_then_tau"):
        tau_c[1], tau_t[1, 0] = -1.0, float("nan")
    if flaw == "tau_uncounted":
        tau_c[2] = 0.0
        tau_t[~mask] = float("nan")
    if flaw == "adv_then_tau":
        adv[3] = float("inf")
    old = torch.log_softmax(z, -1).gather(-1, ids[..., None])[..., 0] + 0.05 * torch.randn(B, T, generator=g)
    kw = dict(config=GTPOConfig.preset("gtpo", entropy_threshold=None), lam=torch.rand(B, T, generator=g) + 0.5,
              n_conf=torch.ones(B))
    if form == "padded":
        kw.update(completion_mask=mask, old_logps=old)
        args = (z, ids, adv)
        tau = tau_c if tau_kind == "completion" else tau_t
    else:
        cu = torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(1).cumsum(0)])
        kw.update(cu_seqlens=cu, old_logps=old[mask], lam=kw["lam"][mask])
        args = (z[mask], ids[mask], adv)
        tau = tau_c[:, None] if tau_kind == "completion" else tau_t[mask]
    return args, dict(kw, temperature=tau)


@pytest.mark.parametrize("tau_kind,form,flaw,validate", CASES)
def test_a_temperature_tensor_in_the_kernels_equals_the_torch_path(tau_kind, form, flaw, validate):
    from bench.launches import counting
    args, kw = _call(tau_kind, form, flaw, seed=len(flaw) * 7 + (form == "packed"))
    outs = {}
    for backend in ("triton", "torch"):
        x = args[0].clone().requires_grad_()
        with counting() as c:
            try:
                out = gtpo_loss(x, *args[1:], validate=validate, backend=backend, **kw)
                out.loss.backward()
                outs[backend] = (out, x.grad)
            except ValueError as e:
                outs[backend] = str(e)
        if backend == "triton" and not isinstance(outs["triton"], str):
            assert (c.launches, c.host_reads) == (4, int(validate)), (c.launches, dict(c.ops), dict(c.reads))
            assert c.triton_names.get("_epilogue_kernel") == 1, dict(c.triton_names)
    if validate and flaw in ("tau_counted", "adv_then_tau"):
        assert isinstance(outs["torch"], str) and outs["triton"] == outs["torch"], outs
        assert ("advantages" if flaw == "adv_then_tau" else "temperature") in outs["torch"]
        return
    (a, ga), (b, gb) = outs["triton"], outs["torch"]
    for name in ("loss", "logps", "entropy", "per_token_loss"):
        torch.testing.assert_close(getattr(a, name).double(), getattr(b, name).double(), rtol=1e-5, atol=1e-5,
                                   equal_nan=True, msg=name)
    torch.testing.assert_close(ga.double(), gb.double(), rtol=1e-5, atol=1e-5, equal_nan=True)
    if flaw in ("none", "tau_uncounted"):
        assert torch.isfinite(a.loss) and ga.abs().sum() > 0
    else:  # unvalidated: the bad tau's tokens NaN, and so the loss
        assert torch.isnan(a.logps).any() and torch.isnan(a.loss)
