"""The replay passes as custom ops: a loss whose coefficients c = dL/dlogp, e = dL/dH are given in closed
form gets, through attach_replay_grad, the gradient autograd gives through replay_logprobs; the whole
step traces under torch.compile(fullgraph=True)."""
import pytest
import torch
from conftest import TOL, assert_grad_close, assert_value_close
from test_sampling_replay import rollout

import gtpo_reference as ref

from gtpo_kernels.core.sampling import check_sampling_mask_flat
from gtpo_kernels.kernels.replay import flat_rows, replay_logprobs
from gtpo_kernels.kernels.replay_ops import attach_replay_grad, replay_fwd


def _step(x, rows_b, rows_t, y, tau, ids, off, invalid, counted, w1, w2, backend):
    """L = sum w1 logp + w2 H over the tokens: c = w1, e = w2 in closed form."""
    logp, ent, stats, flags = replay_fwd(x.detach(), rows_b, rows_t, y, tau, ids, off, invalid, counted, 1.0, None,
                                         backend)
    value = (w1 * logp + w2 * ent).sum()
    return attach_replay_grad(x, value, rows_b, rows_t, y, tau, ids, off, stats, ent, w1, w2, 1.0, None, backend)


def _case(seed):
    """A rollout's logits, its kept sets checked, its rows, and random weights w1, w2 of the counted tokens."""
    z, mask, tau, y, (ids, off) = rollout(8, start=0)
    flat_y = torch.zeros(mask.shape, dtype=torch.long).masked_scatter(mask, y).reshape(-1)
    tok, f_off, invalid = check_sampling_mask_flat((ids, off), flat_y, mask, z.shape[-1], validate=False)
    rb, rt = flat_rows(mask.shape, 0, z.device)
    g = torch.Generator().manual_seed(seed)
    m = mask.reshape(-1).float()
    w1, w2 = torch.randn(m.numel(), generator=g) * m, torch.randn(m.numel(), generator=g) * m
    return z, mask, tau, y, (ids, off), flat_y, tok, f_off, invalid, rb, rt, w1, w2, g


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("compiled", [False, True])
def test_attach_replay_grad_matches_autograd(backend, compiled):
    z, mask, tau, y, (ids, off), flat_y, tok, f_off, invalid, rb, rt, w1, w2, g = _case(1)
    w1[::3] = 0.0  # tokens whose only gradient is through the entropy (c = 0, e != 0)
    t = tau.reshape(-1)
    x = z.clone().requires_grad_()
    lp, h, _ = replay_logprobs(x, rb, rt, flat_y, t, tok, f_off, invalid=invalid, backend=backend,
                               counted=mask.reshape(-1))
    want = (w1 * lp + w2 * h).sum()
    want.backward()
    step = torch.compile(_step, fullgraph=True, backend="aot_eager") if compiled else _step
    xo = z.clone().requires_grad_()
    got = step(xo, rb, rt, flat_y, t, tok, f_off, invalid, mask.reshape(-1), w1, w2, backend)
    got.backward()
    # against the float64 reference: the same loss on the counted rows over their sets
    rows = z[mask].double().requires_grad_()
    rlp, rh = ref.gtpo_sampling.replay_logprobs(rows, y, (ids, off), tau[mask].double())
    loss = (w1.reshape(mask.shape)[mask].double() * rlp + w2.reshape(mask.shape)[mask].double() * rh).sum()
    loss.backward()
    assert_value_close("loss", got, loss, TOL[torch.float32]["loss"])
    assert rows.grad.abs().sum() > 0
    assert_grad_close("grad", xo.grad[mask], rows.grad, TOL[torch.float32]["grad"])
    assert (xo.grad[~mask] == 0).all()
    # and the same as autograd through replay_logprobs
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(xo.grad, x.grad) and x.grad.abs().sum() > 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_replay_gradient_of_strided_logits(backend):
    """Logits that are a view with their own row strides (the last position of each row left out, as
    a trainer slices them): the gradient is written at the gradient's own strides, equal to the
    contiguous logits' gradient."""
    z, mask, tau, y, (ids, off), flat_y, tok, f_off, invalid, rb, rt, w1, w2, g = _case(2)
    t = tau.reshape(-1)
    B, T, V = z.shape
    big = torch.randn(B, T + 1, V, generator=g)
    big[:, :T] = z
    big.requires_grad_()
    x = big[:, :T]
    assert x.stride(0) == (T + 1) * V  # not the gradient's (T V)
    _step(x, rb, rt, flat_y, t, tok, f_off, invalid, mask.reshape(-1), w1, w2, backend).backward()
    xc = z.clone().requires_grad_()
    _step(xc, rb, rt, flat_y, t, tok, f_off, invalid, mask.reshape(-1), w1, w2, backend).backward()
    assert xc.grad.abs().sum() > 0
    torch.testing.assert_close(big.grad[:, :T], xc.grad, rtol=1e-6, atol=1e-7)
    assert (big.grad[:, T] == 0).all()


def test_replay_kernels_refuse_a_temperature_of_another_size():
    """tau: one value or one per token; any other size is refused, never read out of bounds."""
    from gtpo_kernels.kernels import replay_triton
    z, mask, tau, y, (ids, off), flat_y, tok, f_off, invalid, rb, rt, w1, w2, g = _case(3)
    replay_triton.replay_fwd(z, rb, rt, flat_y, tau.reshape(-1), tok, f_off)  # one per token: taken
    with pytest.raises(ValueError, match=r"tau: one value or one per token"):
        replay_triton.replay_fwd(z, rb, rt, flat_y, tau.reshape(-1)[:3], tok, f_off)
