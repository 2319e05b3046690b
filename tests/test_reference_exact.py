"""The oracle against a 60-digit evaluation: the float64 reference's loss and its gradient on near-certain
rows (1 - p_y from 1e-2 down to 1e-20, the target or another entry on top), with the policy term and the
entropy bonus together, checked against the same loss evaluated in mpmath (spec 1 and 4). The
reference is what every other test compares with, so it must be the most exact evaluation in the
repository: each row of its gradient to 1e-12 of the row's own size, small as the row may be."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gtpo_reference as ref
from conftest import examples

mpmath = pytest.importorskip("mpmath")


@st.composite
def near_certain(draw):
    """A padded batch whose rows lead by 1 - p_y = 10**-k (k in 2..20), with the leader the target or
    not, an entropy bonus, advantages of both signs (some zero), temperature and aggregation drawn."""
    B, T, V = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.sampled_from([2, 5, 9]))
    return dict(seed=draw(st.integers(0, 2**31 - 1)), B=B, T=T, V=V,
                k=[draw(st.integers(2, 20)) for _ in range(B * T)],
                other_top=[draw(st.sampled_from([False, False, True])) for _ in range(B * T)],
                adv=[draw(st.sampled_from([0.0, 1.0, -0.5, 2.0])) for _ in range(B)],
                coef=draw(st.sampled_from([0.01, 0.3])), tau=draw(st.sampled_from([1.0, 0.7])),
                agg=draw(st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])))


def _batch(c):
    """(B, T, V) float64 logits with row (b, t)'s leader 10**-k short of certainty (mpmath-planned margin)."""
    g = torch.Generator().manual_seed(c["seed"])
    B, T, V = c["B"], c["T"], c["V"]
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T), generator=g)
    for r in range(B * T):
        b, t = divmod(r, T)
        top = (int(ids[b, t]) + 1) % V if c["other_top"][r] and V > 1 else int(ids[b, t])
        rest = mpmath.fsum(mpmath.exp(mpmath.mpf(float(v)) / c["tau"]) for i, v in enumerate(z[b, t]) if i != top)
        # exp(s_top) = rest * (1 - q) / q with q = 10**-k: then 1 - p_top = q
        q = mpmath.mpf(10) ** -c["k"][r]
        z[b, t, top] = float(c["tau"] * mpmath.log(rest * (1 - q) / q))
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    return z, ids, mask


def _exact(z, ids, mask, adv, coef, tau, agg):
    """The loss (on-policy PPO: r = 1 with the gradient of logp; lambda = 1, no filter, no KL) and its
    gradient with respect to the logits, in mpmath:
        loss_t = -A_b - coef * H_t;  d loss_t / d s_v = -A_b (1[v=y] - p_v) + coef * p_v (log p_v + H_t)
    aggregated with the token weights of `agg` (spec 4); d / d z = d / d s / tau."""
    B, T, V = z.shape
    n = mask.sum(1)
    M = int(n.sum())
    loss, grad = mpmath.mpf(0), [[[mpmath.mpf(0)] * V for _ in range(T)] for _ in range(B)]
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            w = {"token-mean": mpmath.mpf(1) / M, "seq-mean-token-mean": mpmath.mpf(1) / (B * int(n[b])),
                 "seq-mean-token-sum": mpmath.mpf(1) / B}[agg]
            s = [mpmath.mpf(float(v)) / tau for v in z[b, t]]
            lse = mpmath.log(mpmath.fsum(mpmath.exp(v) for v in s))
            lp = [v - lse for v in s]
            p = [mpmath.exp(v) for v in lp]
            H = -mpmath.fsum(pv * lv for pv, lv in zip(p, lp))
            A, y = mpmath.mpf(adv[b]), int(ids[b, t])
            loss += w * (-A - coef * H)
            for v in range(V):
                grad[b][t][v] = w * (-A * ((1 if v == y else 0) - p[v]) + coef * p[v] * (lp[v] + H)) / tau
    return loss, grad


@settings(max_examples=examples(12))
@given(c=near_certain())
def test_reference_loss_gradient_exact_on_near_certain_rows(c):
    mpmath.mp.dps = 60
    z, ids, mask = _batch(c)
    adv = torch.tensor(c["adv"], dtype=torch.float64)
    x = z.clone().requires_grad_()
    out = ref.gtpo_loss(x, ids, adv, mask, group_size=1, temperature=c["tau"], use_conflict_mask=False,
                        entropy_threshold=None, entropy_penalty=0.0, entropy_coef=c["coef"], loss_agg=c["agg"])
    out["loss"].backward()
    want_loss, want_grad = _exact(z, ids, mask, c["adv"], c["coef"], c["tau"], c["agg"])
    err = abs(mpmath.mpf(float(out["loss"].detach())) - want_loss) / max(1, abs(want_loss))
    assert err <= 1e-13, ("loss", float(out["loss"]), float(want_loss))
    worst = (0.0, None)
    for b in range(c["B"]):
        for t in range(c["T"]):
            want = want_grad[b][t]
            norm = mpmath.sqrt(mpmath.fsum(v * v for v in want))
            if norm == 0:
                assert (x.grad[b, t] == 0).all(), ("masked-out row's gradient is not zero", b, t)
                continue
            diff = mpmath.sqrt(mpmath.fsum((mpmath.mpf(float(g)) - v) ** 2 for g, v in zip(x.grad[b, t], want)))
            rel = float(diff / norm)
            if rel > worst[0]:
                worst = (rel, (b, t, f"1 - p_top = 1e-{c['k'][b * c['T'] + t]}", [float(v) for v in want],
                               x.grad[b, t].tolist()))
    assert worst[0] <= 1e-12, f"gradient row error {worst[0]:.3e} at (b, t, leader, exact, reference) {worst[1]}"
