"""token_logprobs with validate=False in one launch and no host read (spec 8): the forward vocabulary kernel
reads the ids, mask and cu_seqlens as given and the temperature as given (a number; one per completion, read
at each token's completion, padded or packed; one per token). A tau that is not finite and > 0 gives NaN at
its counted tokens, a malformed cu_seqlens NaN at every counted token, as the float64 reference gives them;
every other output equals the reference's (beside an empty completion too)."""
import pytest
import torch

from gtpo_kernels import token_logprobs

B, T, V = 4, 5, 16
TAUS = ["number", "completion", "completion_column", "token"]
FLAWS = ["none", "tau_negative", "tau_nan", "cu_decreasing", "cu_short", "float_mask", "empty_completion"]
CASES = [(form, tau, flaw) for form in ("padded", "packed") for tau in TAUS for flaw in FLAWS
         if not (flaw.startswith("tau") and tau == "number") and not (flaw.startswith("cu") and form == "padded")]


def _call(form, tau, flaw, seed):
    g = torch.Generator().manual_seed(seed)
    z, ids = torch.randn(B, T, V, generator=g) * 2, torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    if flaw == "empty_completion":  # completion 1 counts no token (packed: it is empty, cu_seqlens repeats)
        mask[1] = False
    tau_c, tau_t = torch.rand(B, generator=g) + 0.5, torch.rand(B, T, generator=g) + 0.5
    if flaw.startswith("tau"):
        bad = -1.0 if flaw == "tau_negative" else float("nan")
        tau_c[1] = bad
        tau_t[2, 1] = bad
        tau_t[0, 3] = bad
    if form == "padded":
        kw = dict(logits=z, completion_ids=ids, completion_mask=mask.float() if flaw == "float_mask" else mask)
        per_token = tau_t
    else:
        cu = torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(1).cumsum(0)])
        if flaw == "cu_decreasing":
            cu[2] = cu[1] - 1
        if flaw == "cu_short":
            cu[-1] -= 1
        kw = dict(logits=z[mask], completion_ids=ids[mask], cu_seqlens=cu)
        if flaw == "float_mask":
            kw["completion_mask"] = (torch.rand(int(mask.sum()), generator=g) > 0.2).float() * 0.5
        per_token = tau_t[mask]
    kw["temperature"] = {"number": 0.8, "completion": tau_c, "completion_column": tau_c[:, None],
                         "token": per_token}[tau]
    return kw


@pytest.mark.parametrize("form,tau,flaw", CASES)
def test_one_launch_no_host_read_and_the_reference_values(form, tau, flaw):
    from bench.launches import counting
    kw = _call(form, tau, flaw, seed=len(form) * 31 + TAUS.index(tau) * 7 + FLAWS.index(flaw))
    token_logprobs(kw["logits"][:1], kw["completion_ids"][:1], validate=False, backend="triton",
                   **({"cu_seqlens": torch.tensor([0, 1])} if form == "packed" else {}))  # (the counter)
    with counting() as c:
        lp, ent = token_logprobs(validate=False, backend="triton", **kw)
    assert (c.launches, c.host_reads) == (1, 0), (c.launches, dict(c.ops), dict(c.reads))
    ref = token_logprobs(**dict(kw, logits=kw["logits"].double()), validate=False, backend="reference")
    for got, want in zip((lp, ent), ref):
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert torch.equal(got.isnan(), want.isnan()), (got, want)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, equal_nan=True)
    nan, counted = ref[0].isnan(), (kw.get("completion_mask", torch.ones(1)) != 0).expand(ref[0].shape)
    if flaw in ("none", "float_mask", "empty_completion"):
        assert not nan.any() and (ref[0][counted] < 0).all()
    elif flaw.startswith("cu"):
        assert torch.equal(nan, counted)
    else:  # the bad tau's tokens only (completion 1, or the two tokens given one)
        assert nan.any() and not nan.all() and not nan[~counted].any()
