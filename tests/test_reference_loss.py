"""Tests of the float64 reference's loss alone (gtpo_reference.gtpo_loss), against hand-worked answers from
the spec: aggregations (spec 4), the entropy filter and bonus (spec 2), clipping and KL (spec 4), masked rows,
logits_start and the conflict metrics. Conflict weights, log-probs and entropies: tests/test_reference.py."""
import math

import pytest
import torch

import gtpo_reference as ref

PLAIN = dict(use_conflict_mask=False, entropy_threshold=None, entropy_penalty=0.0)  # loss = -A per token


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
