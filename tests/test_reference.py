"""Tests of the float64 reference alone (gtpo_reference), against hand-worked answers from the spec."""
import math

import pytest
import torch

import gtpo_reference as ref

LN2 = math.log(2)
PLAIN = dict(use_conflict_mask=False, entropy_threshold=None, entropy_penalty=0.0)  # loss = -A per token


def cw(ids, mask, adv, group_size, **kw):
    lam, n_conf = ref.conflict_weights(torch.tensor(ids), torch.tensor(mask), torch.tensor(adv, dtype=torch.float32),
                                       group_size, **kw)
    assert lam.dtype == n_conf.dtype == torch.float64
    return lam.tolist(), n_conf.tolist()


# ---------------------------------------------------------------- spec 3: conflict weights

def test_spec_worked_example():
    ids = [[5, 7, 9, 4, 8, 2, -100, -100],
           [5, 7, 3, 8, 2, -100, -100, -100]]
    mask = [[1, 1, 1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 0, 0, 0]]
    lam, n_conf = cw(ids, mask, [1.0, -1.0], 2)
    assert lam == [[2, 2, 1, 1, 2, 2, 1, 1],
                   [0, 0, 1, 0, 0, 1, 1, 1]]
    assert n_conf == [2, 2]


def test_right_aligned_backward_runs_of_different_lengths():
    # completions of different lengths; the last token (3) is shared by all three, the one before it
    # (2) only by i0 and i1; i2 has no negative partner for 8. Rows 1-2 also match forward for i0/i1
    # but the forward run already ended at row 0 (1 / 7 / 6 differ).
    ids = [[1, 2, 3, 0], [7, 2, 3, 0], [6, 8, 8, 3]]
    mask = [[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    lam, n_conf = cw(ids, mask, [1.0, -1.0, 0.5], 3)
    assert lam == [[1, 2, 2, 1],
                   [1, 0, 0, 1],
                   [1, 1, 1, 2]]
    assert n_conf == [2, 2, 1]


def test_masked_row0_makes_forward_run_empty():
    ids = [[5, 6, 7, 1], [5, 6, 7, 2]]
    mask = [[0, 1, 1, 1], [1, 1, 1, 1]]          # i0's row 0 is masked out: no positive holds 5 there
    lam, n_conf = cw(ids, mask, [1.0, -1.0], 2)
    assert lam == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert n_conf == [1, 1]


def test_hole_in_mask_ends_both_runs():
    ids = [[5, 6, 7, 8], [5, 6, 7, 8]]
    mask = [[1, 1, 0, 1], [1, 1, 1, 1]]          # hole at row 2 of the positive completion
    lam, n_conf = cw(ids, mask, [2.0, -0.5], 2)
    assert lam == [[2, 2, 1, 2], [0, 0, 1, 0]]
    assert n_conf == [2, 2]


def test_inactive_overlap_squared_and_positive_only_group():
    # group 0: i0 (+), i1 (-), i2 (A=0): every token lies in both runs -> w_pos**2 and w_neg**2;
    # group 1 has only positives and an inactive one: no conflicts (groups never mix).
    ids = [[3, 4]] * 6
    mask = [[1, 1]] * 6
    lam, n_conf = cw(ids, mask, [1.0, -1.0, 0.0, 1.0, 2.0, 0.0], 3, pos_weight=3.0, neg_weight=0.5)
    assert lam == [[9, 9], [0.25, 0.25], [1, 1], [1, 1], [1, 1], [1, 1]]
    assert n_conf == [2, 2, 1, 1, 1, 1]
    lam, _ = cw(ids[:3], mask[:3], [1.0, -1.0, 0.0], 3)        # defaults 2 / 0
    assert lam == [[4, 4], [0, 0], [1, 1]]


def test_n_conf_is_longer_run_and_input_forms():
    # prefix run 3, suffix run 2 -> n_conf 3; float mask and (B, 1) advantages accepted
    ids = [[1, 2, 3, 9, 7, 8, -100], [1, 2, 3, 6, 5, 7, 8]]
    mask = [[1., 1., 1., 1., 1., 1., 0.], [1., 1., 1., 1., 1., 1., 1.]]
    lam, n_conf = cw(ids, mask, [[1.0], [-1.0]], 2)
    assert lam == [[2, 2, 2, 1, 2, 2, 1], [0, 0, 0, 1, 1, 0, 0]]
    assert n_conf == [3, 3]


def test_group_size_must_divide_batch():
    with pytest.raises(ValueError, match="must divide the batch size"):
        ref.conflict_weights(torch.zeros(3, 2, dtype=torch.long), None, torch.ones(3), 2)
    with pytest.raises(ValueError, match="must divide the batch size"):
        ref.gtpo_loss(torch.randn(3, 2, 4), torch.zeros(3, 2, dtype=torch.long), torch.ones(3), group_size=2)


# ---------------------------------------------------------------- spec 1: logp and entropy

def test_logprobs_against_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=g, dtype=torch.float32)
    ids = torch.randint(0, 7, (2, 3), generator=g)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    ids[0, 2] = -100
    logp, H = ref.token_logprobs(logits, ids, temperature=0.7, mask=mask)
    assert logp.dtype == H.dtype == torch.float64
    lp = torch.log_softmax(logits.double() / 0.7, dim=-1)
    want_logp = lp.gather(-1, ids.clamp(min=0)[..., None])[..., 0] * mask
    want_H = -(lp.exp() * lp).sum(-1) * mask
    torch.testing.assert_close(logp, want_logp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(H, want_H, rtol=1e-12, atol=1e-12)
    assert logp[0, 2] == 0 and H[0, 2] == 0


def test_banned_vocabulary_minus_inf():
    logits = torch.tensor([[[0.5, -math.inf, 1.0, -math.inf], [2.0, 0.0, -math.inf, -1.0]]],
                          requires_grad=True)
    ids = torch.tensor([[2, 0]])
    logp, H = ref.token_logprobs(logits, ids, temperature=2.0)
    # same values as on the allowed vocabulary alone
    for t, allowed in ((0, [0, 2]), (1, [0, 1, 3])):
        lp = torch.log_softmax(logits.detach()[0, t, allowed].double() / 2.0, dim=-1)
        assert torch.isclose(H[0, t], -(lp.exp() * lp).sum())
        assert torch.isclose(logp[0, t], lp[allowed.index(int(ids[0, t]))])
    (logp.sum() + H.sum()).backward()
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[0, 0, [1, 3]] == 0).all() and logits.grad[0, 1, 2] == 0

    out = ref.gtpo_loss(logits, ids, torch.tensor([1.0]), group_size=1, entropy_coef=0.1)
    assert torch.isfinite(out["loss"])


# ---------------------------------------------------------------- spec 4: aggregations

AGG_CASES = [  # per-token loss -A: i0 = [-1, -1, .], i1 = [4, ., .]; n = [2, 1], M = 3, B = 2, T = 3
    ("seq-mean-token-mean", {}, 0.5 * (-2 / 2 + 4 / 1)),
    ("seq_mean_token_mean", {}, 1.5),
    ("token-mean", {}, 2 / 3),
    ("token_mean", dict(num_items_in_batch=4), 0.5),
    ("seq-mean-token-sum", {}, 2 / 2),
    ("seq-mean-token-sum-norm", {}, 2 / (2 * 3)),
    ("seq-mean-token-sum-norm", dict(max_completion_length=4), 2 / (2 * 4)),
    ("gtpo-official", dict(lam=torch.ones(2, 3), n_conf=torch.tensor([2.0, 1.0])), -2 / 2 / 2 + 4 / 1 / 1),
]


def _agg_batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 3, 5, generator=g, requires_grad=True)
    ids = torch.tensor([[1, 2, -100], [4, -100, -100]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    return logits, ids, torch.tensor([1.0, -4.0]), mask


@pytest.mark.parametrize("agg,extra,want", AGG_CASES)
def test_aggregation_values(agg, extra, want):
    logits, ids, A, mask = _agg_batch()
    kw = dict(PLAIN, **extra)
    if "lam" in extra:
        kw["use_conflict_mask"] = True          # lam / n_conf passed in: no group_size needed
    out = ref.gtpo_loss(logits, ids, A, mask, loss_agg=agg, **kw)
    assert out["loss"].dim() == 0 and out["loss"].dtype == torch.float64
    assert out["loss"].item() == pytest.approx(want, abs=1e-12)
    assert out["per_token_loss"].tolist() == [[-1, -1, 0], [4, 0, 0]]


def test_aggregation_none_and_gradient():
    logits, ids, A, mask = _agg_batch()
    out = ref.gtpo_loss(logits, ids, A, mask, loss_agg="none", **PLAIN)
    assert out["loss"].shape == (2, 3) and out["loss"].requires_grad
    assert out["loss"].tolist() == [[-1, -1, 0], [4, 0, 0]]
    # token-mean with tau: dL/dz = -A_i / M * (onehot(y) - softmax(z / tau)) / tau on counted rows
    tau = 0.8
    ref.gtpo_loss(logits, ids, A, mask, loss_agg="token-mean", temperature=tau, **PLAIN)["loss"].backward()
    p = torch.softmax(logits.detach().double() / tau, -1)
    want = torch.zeros(2, 3, 5, dtype=torch.float64)
    for i, t in ((0, 0), (0, 1), (1, 0)):
        want[i, t] = -A[i] / 3 * (torch.nn.functional.one_hot(ids[i, t], 5) - p[i, t]) / tau
    torch.testing.assert_close(logits.grad.double(), want, rtol=1e-5, atol=1e-7)
    assert (logits.grad[0, 2] == 0).all() and (logits.grad[1, 1:] == 0).all()


# ---------------------------------------------------------------- spec 2: entropy filter

def test_entropy_filter_and_initial_entropy_gate():
    logits = torch.zeros(2, 2, 4)                    # i0: uniform rows, H = ln 4 > ln 2
    logits[1, :, 0] = 10.0                           # i1: peaked rows, H small
    ids = torch.zeros(2, 2, dtype=torch.long)
    A = torch.tensor([1.0, 1.0])
    base = dict(use_conflict_mask=False)
    out = ref.gtpo_loss(logits, ids, A, **base)
    h1 = out["seq_entropy"][1].item()
    assert out["seq_entropy"][0].item() == pytest.approx(math.log(4), abs=1e-12)
    assert out["kept"].tolist() == [False, True]
    assert out["metrics"]["filtered_frac"].item() == 0.5
    # Ahat = delta * (A - 0.1 * Hbar); filtered completions still count in the 1/B
    assert out["per_token_loss"][0].tolist() == [0, 0]
    assert out["loss"].item() == pytest.approx(-(1 - 0.1 * h1) / 2, abs=1e-12)
    assert out["metrics"]["mean_entropy"].item() == pytest.approx((math.log(4) + h1) / 2, abs=1e-12)

    gated = ref.gtpo_loss(logits, ids, A, initial_entropy=1.0, **base)     # 1.0 > ln 2: filter off
    assert gated["kept"].tolist() == [True, True]
    assert gated["loss"].item() == pytest.approx(-(1 - 0.1 * math.log(4) + 1 - 0.1 * h1) / 2, abs=1e-12)
    assert ref.gtpo_loss(logits, ids, A, initial_entropy=0.5, **base)["kept"].tolist() == [False, True]
    assert ref.gtpo_loss(logits, ids, A, entropy_threshold=None, **base)["kept"].tolist() == [True, True]
    assert ref.gtpo_loss(logits, ids, A, entropy_threshold=1.5, **base)["kept"].tolist() == [True, True]


def test_entropy_bonus():
    logits = torch.zeros(1, 2, 4)
    out = ref.gtpo_loss(logits, torch.zeros(1, 2, dtype=torch.long), torch.zeros(1), entropy_coef=0.3, **PLAIN)
    assert out["loss"].item() == pytest.approx(-0.3 * math.log(4), abs=1e-12)


# ---------------------------------------------------------------- spec 4: clipping, KL

def test_clip_zeroes_gradient_outside_range():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 6, generator=g, requires_grad=True)
    ids = torch.randint(0, 6, (2, 3), generator=g)
    A = torch.tensor([1.0, -1.0])
    logp, _ = ref.token_logprobs(logits.detach(), ids)
    # ratios:        i0 (A>0): 2 clipped, 0.5 kept, 1 ;  i1 (A<0): 0.5 clipped, 1.1 kept, 2 kept
    ratios = torch.tensor([[2.0, 0.5, 1.0], [0.5, 1.1, 2.0]], dtype=torch.float64)
    old = logp - ratios.log()
    out = ref.gtpo_loss(logits, ids, A, old_logps=old, **PLAIN)
    out["loss"].backward()
    row_zero = (logits.grad == 0).all(-1)
    assert row_zero.tolist() == [[True, False, False], [True, False, False]]
    assert out["metrics"]["clip_frac"].item() == pytest.approx(2 / 6)
    want = -(torch.minimum(ratios * A[:, None], ratios.clamp(0.8, 1.2) * A[:, None])).mean(1).mean()
    assert out["loss"].item() == pytest.approx(want.item(), abs=1e-12)

    logits.grad = None
    out = ref.gtpo_loss(logits, ids, A, old_logps=old, clip=False, **PLAIN)
    out["loss"].backward()
    assert not (logits.grad == 0).all(-1).any()
    assert out["metrics"]["clip_frac"].item() == 0
    assert out["loss"].item() == pytest.approx(-(ratios * A[:, None]).mean().item(), abs=1e-12)


def test_kl_k3_term():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 2, 5, generator=g)
    ids = torch.randint(0, 5, (2, 2), generator=g)
    logp, _ = ref.token_logprobs(logits, ids)
    out = ref.gtpo_loss(logits, ids, torch.zeros(2), ref_logps=logp - 0.3, beta=0.04, **PLAIN)
    assert out["loss"].item() == pytest.approx(0.04 * (math.exp(-0.3) + 0.3 - 1), abs=1e-12)
    with pytest.raises(ValueError, match="ref_logps is required"):
        ref.gtpo_loss(logits, ids, torch.zeros(2), beta=0.04, **PLAIN)


# ---------------------------------------------------------------- masking, logits_start

def test_masked_rows_and_unused_rows_get_zero_gradient():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 5, 6, generator=g, requires_grad=True)         # T_l = 5 >= 1 + T
    ids = torch.tensor([[1, 2, -100], [1, 3, 4], [2, -100, 5], [-100, -100, -100]])
    mask = ids >= 0
    old = torch.full((4, 3), float("nan")).masked_scatter(mask, torch.randn(int(mask.sum()), generator=g))
    out = ref.gtpo_loss(logits, ids, torch.tensor([1.0, -1.0, 0.5, -0.5]), mask, group_size=2,
                        old_logps=old, ref_logps=old, beta=0.1, entropy_coef=0.01, logits_start=1)
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and torch.isfinite(logits.grad).all()
    rows = ~(logits.grad == 0).all(-1)
    want = torch.zeros(4, 5, dtype=torch.bool)
    want[:, 1:4] = mask
    assert rows.tolist() == want.tolist()
    for k in ("per_token_loss", "logps", "entropy"):
        assert (out[k][~mask] == 0).all()
    assert out["lam"][~mask].eq(1).all()


@pytest.mark.parametrize("agg", ref.LOSS_AGGS)
def test_all_masked_batch(agg):
    logits = torch.randn(2, 3, 4, requires_grad=True)
    ids = torch.full((2, 3), -100)
    out = ref.gtpo_loss(logits, ids, torch.tensor([1.0, -1.0]), torch.zeros(2, 3), group_size=2,
                        loss_agg=agg, n_conf=None, num_items_in_batch=3.0 if agg == "token-mean" else None)
    out["loss"].sum().backward()
    assert (out["loss"] == 0).all() and (logits.grad == 0).all()
    assert all(torch.isfinite(v) and v == 0 for k, v in out["metrics"].items() if k != "filtered_frac")


def test_conflict_metrics_through_loss():
    ids = torch.tensor([[5, 7, 9, 4, 8, 2, 0, 0], [5, 7, 3, 8, 2, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]])
    out = ref.gtpo_loss(torch.randn(2, 8, 10), ids, torch.tensor([1.0, -1.0]), mask, group_size=2)
    assert out["lam"].tolist() == [[2, 2, 1, 1, 2, 2, 1, 1], [0, 0, 1, 0, 0, 1, 1, 1]]
    assert out["n_conf"].tolist() == [2, 2]
    assert out["metrics"]["conflict_frac"].item() == pytest.approx(8 / 11)
    off = ref.gtpo_loss(torch.randn(2, 8, 10), ids, torch.tensor([1.0, -1.0]), mask, use_conflict_mask=False)
    assert off["lam"].eq(1).all() and off["n_conf"].eq(1).all()


# ---------------------------------------------------------------- near-certain rows (issue 16 item 4)

def test_near_certain_rows_exact():
    """Rows whose top entry leads by 30..45 nats (1 - p_max down to 1e-19): logp and entropy to 1e-13 of
    their own size against an exact log-sum-exp in mpmath (log_softmax rounds log(1 + 1e-17) to 0, which
    zeroes log p of the top token and its entropy term), and the gradient's target entry 1 - p_y."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 60
    g = torch.Generator().manual_seed(11)
    B, T, V = 2, 4, 9
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T), generator=g)
    margin = torch.tensor([30.0, 36.0, 40.0, 45.0], dtype=torch.float64)
    top = ids.clone()
    top[1] = (ids[1] + 1) % V  # row 1: a near-certain entry that is not the target
    z.scatter_add_(-1, top[..., None], margin.expand(B, T)[..., None])
    x = z.clone().requires_grad_()
    lp, H = ref.token_logprobs(x, ids)
    lp.sum().backward()
    lp, H = lp.detach(), H.detach()
    for b in range(B):
        for t in range(T):
            row = [mpmath.mpf(float(v)) for v in z[b, t]]
            lse = mpmath.log(mpmath.fsum(mpmath.exp(v) for v in row))
            logp = [v - lse for v in row]
            want_lp = logp[int(ids[b, t])]
            want_H = -mpmath.fsum(mpmath.exp(v) * v for v in logp)
            want_g = 1 - mpmath.exp(want_lp)  # d logp_y / d z_y = 1 - p_y
            for name, got, want in (("logp", lp[b, t], want_lp), ("entropy", H[b, t], want_H),
                                    ("grad", x.grad[b, t, ids[b, t]], want_g)):
                err = abs(mpmath.mpf(float(got)) - want) / max(abs(want), mpmath.mpf(1e-300))
                assert err <= 1e-13, (name, b, t, float(got), float(want), float(err))
