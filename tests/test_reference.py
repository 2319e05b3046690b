"""Tests of the float64 reference alone (gtpo_reference), against hand-worked answers from the spec: the
conflict weights (spec 3), log-probs and entropies (spec 1, near-certain rows included). The loss itself
(aggregations, entropy filter, clipping, KL, masking): tests/test_reference_loss.py."""
import math

import pytest
import torch

import gtpo_reference as ref

LN2 = math.log(2)


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


def test_a_nan_row_has_nan_log_prob_entropy_and_gradient():
    """A row holding a NaN logit (or scaled by a NaN temperature): its logp, its entropy and its gradient are
    NaN, never the 0 that dropping p log p where p is not > 0 would give; the other rows keep their values and
    a -inf entry its exact 0 term (test_banned_vocabulary_minus_inf)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(1, 3, 6, generator=g, dtype=torch.float64)
    logits[0, 1, 4] = float("nan")
    logits[0, 2, 0] = -math.inf
    x = logits.clone().requires_grad_()
    logp, H = ref.token_logprobs(x, torch.tensor([[1, 2, 3]]))
    assert torch.isnan(logp[0, 1]) and torch.isnan(H[0, 1])
    assert torch.isfinite(logp[0, [0, 2]]).all() and torch.isfinite(H[0, [0, 2]]).all() and (H[0, [0, 2]] > 0).all()
    (logp.sum() + H.sum()).backward()
    assert torch.isnan(x.grad[0, 1]).all() and torch.isfinite(x.grad[0, [0, 2]]).all()
    assert x.grad[0, 2, 0] == 0 and (x.grad[0, 0] != 0).all()


def test_a_masked_out_row_gets_exact_zeros_even_all_minus_inf():
    """Spec 7: a masked-out row's gradient is exactly 0, also when the row is all -inf (its p is NaN there, and
    0 times NaN would be NaN); the counted rows' gradients are unchanged and not zero."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=g, dtype=torch.float64)
    logits[1, 2] = -math.inf
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1, 2] = False
    x = logits.clone().requires_grad_()
    r = ref.gtpo_loss(x, ids, torch.tensor([1.0, -1.0]), mask, group_size=2, entropy_threshold=None,
                      entropy_coef=0.01)
    r["loss"].backward()
    assert torch.equal(x.grad[1, 2], torch.zeros(7, dtype=torch.float64))
    assert torch.isfinite(x.grad).all() and (x.grad[0, 0] != 0).all()
    # a NaN upstream gradient still reaches its row
    x2 = logits[:1, :2].clone().requires_grad_()
    logp, H = ref.token_logprobs(x2, ids[:1, :2])
    (logp * torch.tensor([[float("nan"), 0.0]], dtype=torch.float64)).sum().backward()
    assert torch.isnan(x2.grad[0, 0]).all() and torch.equal(x2.grad[0, 1], torch.zeros(7, dtype=torch.float64))


def test_the_reference_backend_gives_nan_for_an_id_out_of_range_unvalidated():
    """backend='reference', validate=False: a counted id outside [0, V) (or malformed cu_seqlens, which make
    every id -1) gives NaN log-prob and entropy there, as the other backends do, not the clamped id's."""
    from gtpo_kernels import token_logprobs
    g = torch.Generator().manual_seed(6)
    x, ids = torch.randn(2, 3, 8, generator=g), torch.randint(0, 8, (2, 3), generator=g)
    ids[0, 1] = 8
    lp, ent = token_logprobs(x, ids, validate=False, backend="reference")
    bad = torch.zeros(2, 3, dtype=torch.bool)
    bad[0, 1] = True
    assert torch.equal(lp.isnan(), bad) and torch.equal(ent.isnan(), bad) and (lp[~bad] < 0).all()
    lp, ent = token_logprobs(x[0], ids[0].clamp(max=7), cu_seqlens=torch.tensor([0, 2, 1, 3]), validate=False,
                             backend="reference")
    assert lp.isnan().all() and ent.isnan().all()


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


@pytest.mark.parametrize("target_on_top", [True, False])
def test_entropy_bonus_gradient_on_near_certain_rows(target_on_top):
    """gtpo_loss with an entropy bonus on rows where 1 - p_max = 1e-12, 2e-16, 3e-20 (the top entry the
    target, or another entry): every entry of d loss / d logits within 1e-12 of its own size against
    the analytic gradient -A ([v = y] - p_v) + coef p_v (log p_v + H) evaluated in mpmath at 60 digits
    (autograd of -sum p log p loses the top entry's term: its two parts cancel to 1e-20 of 1)."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 60
    g = torch.Generator().manual_seed(5)
    qs, V, coef = [1e-12, 2e-16, 3e-20], 5, 0.3
    B = len(qs)
    w = torch.rand(B, V - 1, generator=g, dtype=torch.float64) + 0.1
    w = w / w.sum(-1, keepdim=True)
    others = torch.log(w * torch.tensor(qs, dtype=torch.float64)[:, None])  # sum_v exp = q, the top at 0
    z = torch.cat([torch.zeros(B, 1, dtype=torch.float64), others], -1)[:, None, :]
    ids = torch.zeros(B, 1, dtype=torch.long) if target_on_top else torch.full((B, 1), 2)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    x = z.clone().requires_grad_()
    out = ref.gtpo_loss(x, ids, adv, use_conflict_mask=False, entropy_threshold=None, entropy_penalty=0.0,
                        entropy_coef=coef)
    out["loss"].backward()
    for b in range(B):
        row = [mpmath.mpf(float(v)) for v in z[b, 0]]
        lse = mpmath.log(mpmath.fsum(mpmath.exp(v) for v in row))
        logp = [v - lse for v in row]
        H = -mpmath.fsum(mpmath.exp(v) * v for v in logp)
        A, y = mpmath.mpf(float(adv[b])), int(ids[b, 0])
        for v in range(V):
            p = mpmath.exp(logp[v])
            want = (-A * ((1 if v == y else 0) - p) + coef * p * (logp[v] + H)) / B
            got = mpmath.mpf(float(x.grad[b, 0, v]))
            err = abs(got - want) / abs(want)
            assert err <= 1e-12, (qs[b], v, float(got), float(want), float(err))
