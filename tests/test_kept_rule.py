"""Kept sets rebuilt by top_k / top_p / min_p in one Triton launch (kernels/kept_rule_triton.py; spec 8, 13):
the thresholds (t_s, t_id) keep exactly the sets of the float64 statement (reference/gtpo_sampling.kept_sets)
and of the torch rebuild (kernels/kept_set.kept_sets, the twin), ties at the k-th value and at top-p's cut
included, with the set's size, the sampled token restored and the kept mass; gtpo_loss on them against the
reference (packed, tensors per completion and per token, validating); an invalid rule NaN unvalidated at its
token and the twin's error validating. Tolerances: spec 7 (float32: 1e-5)."""
import pytest
import torch
from conftest import assert_grad_close, compiled_ahead
from test_logps_epilogue import TOL, _compare

import gtpo_reference as ref
from bench.launches import counting
from gtpo_kernels import gtpo_loss, token_logprobs
from gtpo_kernels.kernels.kept_rule_triton import kept_thresholds
from gtpo_kernels.kernels.kept_set import kept_sets

# (top_k, top_p, min_p) drawn per token below, or numbers: each rule alone, all three, and the corners
# (top_p so small that only the largest is kept, top_k >= V and 0: off)
RULES = [("tok", None, None), (None, "tok", None), (None, None, "tok"), ("tok", "tok", "tok"), (60, 1e-9, None),
         (0, 0.5, 0.2)]


def _rules(case, M, g):
    k, p, mp = case
    return (torch.randint(0, 9, (M,), generator=g) if k == "tok" else k,
            torch.rand(M, generator=g) * 0.8 + 0.15 if p == "tok" else p,
            torch.rand(M, generator=g) * 0.3 if mp == "tok" else mp)


def _as_sets(z, ids, tau, t_s, t_id):
    """The sets the thresholds keep, as vocab_jit._kept reads them, per row of z (M, V): (M, V) bool."""
    s = z.float() * (1.0 / tau)[:, None]
    v = torch.arange(z.shape[-1])
    rule = ((s > t_s[:, None]) | ((s == t_s[:, None]) & (v >= t_id[:, None]))) & (s > float("-inf"))
    return rule | (v == ids[:, None])


def _dense(token_ids, offsets, M, V):
    out = torch.zeros(M, V, dtype=torch.bool)
    for r in range(M):
        out[r, token_ids[offsets[r]:offsets[r + 1]]] = True
    return out


@pytest.mark.parametrize("dtype,ties", [(torch.float32, False), (torch.bfloat16, True)], ids=["f32", "bf16-ties"])
def test_thresholds_keep_the_reference_sets(dtype, ties):
    """Per-token rules (and number corners) on M rows: the thresholds' sets equal the float64 statement's and
    the twin's entry for entry; |K|, restored exactly, kept mass within 1e-5. tau per token in {0.5, 1, 2}
    (exact in float32 and float64, so both order the same s). bf16 logits on a coarse grid: many ties."""
    g = torch.Generator().manual_seed(11 + ties)
    M, V = 12, 40
    z = torch.randn(1, M, V, generator=g) * 2
    if ties:
        z = (z * 2).round() / 2
    z = z.to(dtype)
    z[0, 3, 5] = float("-inf")  # a banned entry: never kept unless sampled
    z[0, 6] -= 40.0  # a row of negative logits only (its keys' order flips the bits)
    ids = torch.randint(0, V, (M,), generator=g)
    tau = torch.tensor([0.5, 1.0, 2.0])[torch.randint(0, 3, (M,), generator=g)]
    for case in RULES:
        k, p, mp = _rules(case, M, g)
        t_s, t_id, kst = kept_thresholds(z, ids, None, tau, 0, k, p, mp)
        got = _as_sets(z[0], ids, tau, t_s, t_id)
        r_ids, r_off, r_rest = ref.gtpo_sampling.kept_sets(z[0].double(), tau.double(), k, p, mp, ids)
        want = _dense(r_ids, r_off, M, V)
        assert torch.equal(got, want), (case, (got != want).nonzero().tolist())
        w_ids, w_off, w_rest, _nf, w_mass = kept_sets(z, torch.zeros(M, dtype=torch.long), torch.arange(M), ids,
                                                      tau, k, p, mp)
        assert torch.equal(got, _dense(w_ids, w_off, M, V)), case
        assert torch.equal(kst[:, 0], want.sum(1).float()), case
        assert torch.equal(kst[:, 1].bool(), r_rest) and torch.equal(r_rest, w_rest), case
        torch.testing.assert_close(kst[:, 2], w_mass.float(), atol=1e-5, rtol=0)


def test_top_p_cut_inside_a_tie_and_the_last_kept():
    """Rows built so that top-p's cut falls inside a group of equal values (ids ascending decide, spec 13), and a
    cut no entry passes (only the largest, its largest id among ties at the maximum)."""
    V = 16
    z = torch.full((1, 4, V), -4.0)
    z[0, :, [2, 5, 9, 12]] = 1.0  # four tied entries of 0.25 each of (most of) the mass
    z[0, 2, [3, 7]] = 2.0  # a tie at the maximum
    z[0, 3] = float("-inf")
    z[0, 3, [1, 6, 8, 11]] = 0.0  # four entries of exactly 0.25: a cumulative mass exactly 1 - top_p is dropped
    ids = torch.tensor([0, 1, 4, 11])
    top_p = torch.tensor([0.5, 0.3, 1e-9, 0.5])
    t_s, t_id, kst = kept_thresholds(z, ids, None, 1.0, 0, None, top_p, None)
    got = _as_sets(z[0], ids, torch.ones(4), t_s, t_id)
    r_ids, r_off, _ = ref.gtpo_sampling.kept_sets(z[0].double(), 1.0, None, top_p, None, ids)
    want = _dense(r_ids, r_off, 4, V)
    assert torch.equal(got, want), (got.nonzero().tolist(), want.nonzero().tolist())
    # the tied four hold ~0.25 each: the cut 1 - 0.5 falls after id 2's, so 5, 9, 12 stay (and y = 0, restored)
    assert want[0].nonzero().flatten().tolist() == [0, 5, 9, 12] and kst[0, 1] == 1
    assert want[2].nonzero().flatten().tolist() == [4, 7]  # the largest id tied at the maximum, and y
    assert want[3].nonzero().flatten().tolist() == [8, 11] and kst[3, 1] == 0  # 0.25 + 0.25 <= 0.5: dropped


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_loss_on_rebuilt_sets_matches_the_reference(packed):
    """gtpo_loss with top_p per completion and top_k per token (padded) or numbers with min_p (packed), tau per
    completion, validating: four kernels and one host read (the temperature tensor's host check adds aten
    launches, as without rules); loss, logps, entropies, gradient and spec 13's metrics against the float64
    reference."""
    g = torch.Generator().manual_seed(5)
    B, T, V = 4, 5, 48 if packed else 32  # (32: whole blocks of the vocabulary kernels; 48: a partial one)
    z = torch.randn(B, T, V, generator=g) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.25
    adv = torch.randn(B, generator=g)
    tau = torch.tensor([0.5, 1.0, 2.0, 1.0])
    rules = dict(top_p=torch.rand(B, generator=g) * 0.6 + 0.3, top_k=torch.randint(0, 10, (B, T), generator=g))
    kw = {}
    if packed:
        cu = torch.cat([torch.zeros(1, dtype=torch.long), mask.sum(1).cumsum(0)])
        z, ids, mask, kw = z[mask], ids[mask], None, dict(cu_seqlens=cu)
        rules = dict(top_k=6, top_p=0.85, min_p=0.05)
    runs = {}
    for backend in ("triton", "torch", "reference"):
        x = (z.double() if backend == "reference" else z).clone().requires_grad_()
        with counting() as c:
            out = gtpo_loss(x, ids, adv, mask, temperature=tau, config="grpo", backend=backend, **rules, **kw)
            out.loss.backward()
        runs[backend] = (out, x.grad, c)
    (out, grad, c), (twin, _, _), (r, rgrad, _) = runs["triton"], runs["torch"], runs["reference"]
    assert c.host_reads == 1 and dict(c.triton_names) == {"_kept_rule_kernel": 1, "_vocab_fwd_kernel": 1,
                                                          "_epilogue_kernel": 1, "_vocab_bwd_kernel": 1}, c.triton_names
    assert rgrad.abs().sum() > 0
    counted = torch.ones(ids.shape, dtype=torch.bool) if mask is None else mask
    _compare("rules", out, r, counted, False)
    assert list(out.metrics) == list(twin.metrics)
    for k in ("mean_kept_size", "replay_restored_frac", "kept_mass"):  # (the reference has no kept_mass)
        torch.testing.assert_close(out.metrics[k].double(), (r if k in r.metrics else twin).metrics[k].double(),
                                   atol=TOL, rtol=TOL)
    assert_grad_close("rules grad", grad.reshape(-1, V), rgrad.reshape(-1, V), TOL)


@pytest.mark.parametrize("validate", [False, True])
def test_token_logprobs_in_two_launches(validate):
    """token_logprobs with top_k per token and top_p (the old-policy pass of a trainer that replays the
    sampler): the kept sets' kernel and the forward kernel, no host read unvalidated and one validating (the
    mask and ids checked in the kernel); the values of the float64 reference."""
    g = torch.Generator().manual_seed(7)
    B, T, V = 3, 4, 32
    z, ids = torch.randn(B, T, V, generator=g) * 2, torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    rules = dict(top_k=torch.randint(0, 9, (B, T), generator=g), top_p=0.85)
    with counting() as c:
        lp, h = token_logprobs(z, ids, 0.7, mask, backend="triton", validate=validate, **rules)
    assert (c.host_reads, dict(c.triton_names)) == (int(validate), {"_kept_rule_kernel": 1, "_vocab_fwd_kernel": 1})
    assert c.launches <= 2 + validate, (c.launches, dict(c.ops))  # (validating: the status counter's zeros, once)
    r_lp, r_h = token_logprobs(z.double(), ids, 0.7, mask, backend="reference", **rules)
    torch.testing.assert_close(lp.double(), r_lp, atol=TOL, rtol=TOL)
    torch.testing.assert_close(h.double(), r_h, atol=TOL, rtol=TOL)


def test_numbers_that_float32_rounds_to_a_ranges_open_end():
    """top_p = 1e-50 and min_p = 1 - 1e-9 are valid (checked in float64) but round to 0 and 1 in float32: both
    backends keep what the rules keep there (the largest entry; the entries tied at the maximum) as the float64
    statement does, never NaN and never the rule switched off."""
    g = torch.Generator().manual_seed(8)
    z = torch.randn(2, 3, 16, generator=g)
    z[0, 1, [4, 9]] = 5.0  # a tie at the maximum
    ids = torch.randint(0, 16, (2, 3), generator=g)
    for rule in (dict(top_p=1e-50), dict(min_p=1 - 1e-9)):
        want, _, _, _ = ref.gtpo_sampling.replay_token_logprobs(z.double(), ids, **rule)
        for backend in ("triton", "torch"):
            lp, _ = token_logprobs(z, ids, 1.0, backend=backend, **rule)
            torch.testing.assert_close(lp.double(), want, atol=1e-5, rtol=0, msg=f"{rule} {backend}")


def test_invalid_rule_nan_at_its_token_and_the_twins_error():
    """top_k -2 at a counted token, a NaN top_p of a completion, a NaN logit outside the kept set: unvalidated
    those tokens' outputs NaN (the loss NaN, the other tokens finite); validating, the error the torch path
    gives, naming the argument (the row, for the logit); gtpo_loss and token_logprobs."""
    g = torch.Generator().manual_seed(2)
    B, T, V = 3, 4, 20
    z, ids = torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, generator=g)
    k = torch.full((B, T), 5)
    k[1, 2] = -2
    p = torch.full((B,), 0.9)
    p[2] = float("nan")
    z_nan = z.clone()
    z_nan[0, 1, z[0, 1].argmin()] = float("nan")  # (outside the top 5)
    for rules, bad in ((dict(top_k=k), [(1, 2)]), (dict(top_p=p), [(2, t) for t in range(T)]),
                       (dict(top_k=5, logits=z_nan), [(0, 1)])):
        x = rules.pop("logits", z)
        out = gtpo_loss(x, ids, adv, top_k=rules.get("top_k"), top_p=rules.get("top_p"), config="grpo",
                        validate=False, backend="triton")
        nan = torch.zeros(B, T, dtype=torch.bool)
        nan[tuple(zip(*bad))] = True
        assert torch.equal(out.logps.isnan(), nan) and torch.equal(out.entropy.isnan(), nan)
        assert out.loss.isnan()
        errors = []
        for backend in ("triton", "torch"):
            with pytest.raises(ValueError) as e:
                gtpo_loss(x, ids, adv, config="grpo", backend=backend, **rules)
            errors.append(str(e.value))
        assert errors[0] == errors[1] and errors[0].startswith("logits" if x is z_nan else next(iter(rules))), errors
        if "top_k" not in rules or x is z_nan:
            continue
        # token_logprobs alike (its kernels check the rules too, validating)
        lp, h = token_logprobs(x, ids, 1.0, validate=False, backend="triton", **rules)
        assert torch.equal(lp.isnan(), nan) and torch.equal(h.isnan(), nan)
        for backend in ("triton", "torch"):
            with pytest.raises(ValueError) as e:
                token_logprobs(x, ids, 1.0, backend=backend, **rules)
            assert str(e.value) == errors[0], (backend, str(e.value))


def test_kernels_compile_for_the_gpus():
    """The kept sets' kernel (rules per token, by value, off) and both vocabulary kernels with KEEP compiled
    ahead of time for sm_90, sm_80 and sm_100 (no GPU needed): what the interpreter does not check fails here."""
    code = ("from bench.aot.compiler import compile_kept_rule, compile_vocab_keep\n"
            "for arch, sw in [(90, {}), (80, dict(TOP_K=1, TOP_P=0, MIN_P=1, HAS_MASK=False, TEMP_BY_VALUE=True)),\n"
            "                 (100, dict(TOP_K=0, TOP_P=1, MIN_P=0, STATS=False))]:\n"
            "    assert compile_kept_rule(arch, **sw).asm.get('ptx'), (arch, sw)\n"
            "for arch, backward in [(90, False), (90, True), (100, True)]:\n"
            "    assert compile_vocab_keep(arch, backward).asm.get('ptx'), (arch, backward)\n"
            "print('compiled')\n")
    compiled_ahead(code)
