"""The float64 reference of spec 13 against independent statements: replay over K equals the spec-1
reference on logits set to -inf outside K (values and gradients); no rules = the whole vocabulary; the
packed form equals the padded form; per-completion parameters equal their per-token expansion."""
import torch

import gtpo_reference as ref


def _batch(seed, B=3, T=5, V=40):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2
    z[..., :4] += 3 * torch.rand(B, T, 4, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 4, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.3
    return z, ids, mask


def test_replay_equals_masked_full_softmax():
    z, ids, mask = _batch(0)
    tau = torch.tensor([0.7, 1.0, 1.3], dtype=torch.float64)
    x = z.clone().requires_grad_()
    lp, h, metrics, (tok, off) = ref.replay_token_logprobs(x, ids, mask, temperature=tau, top_k=6, top_p=0.9)
    (lp.sum() + 0.5 * h.sum()).backward()
    # the same sets as a -inf mask on the logits, through spec 1's reference (one temperature per completion)
    keep = torch.zeros_like(z, dtype=torch.bool)
    seg = torch.repeat_interleave(torch.arange(off.numel() - 1), off[1:] - off[:-1])
    bi, ti = mask.nonzero(as_tuple=True)
    keep[bi[seg], ti[seg], tok] = True
    xm = z.clone().requires_grad_()
    lp2, h2 = [], []
    for i in range(3):
        zi = torch.where(keep[i:i + 1] | ~mask[i:i + 1, :, None], xm[i:i + 1], torch.full_like(z[:1], float("-inf")))
        a, b = ref.token_logprobs(zi, ids[i:i + 1], float(tau[i]), mask[i:i + 1])
        lp2.append(a), h2.append(b)
    lp2, h2 = torch.cat(lp2), torch.cat(h2)
    (lp2.sum() + 0.5 * h2.sum()).backward()
    assert torch.allclose(lp, lp2, atol=1e-12) and torch.allclose(h, h2, atol=1e-12)
    assert torch.allclose(x.grad, xm.grad, atol=1e-12) and x.grad.abs().sum() > 0
    assert (x.grad[~keep] == 0).all()
    assert 0 < float(metrics["kept_mass"]) < 1 and float(metrics["mean_kept_size"]) <= 40


def test_no_rules_is_the_vocabulary_and_packed_equals_padded():
    z, ids, mask = _batch(1)
    lp, h, m, _ = ref.replay_token_logprobs(z, ids, mask, temperature=0.8)
    lp0, h0 = ref.token_logprobs(z, ids, 0.8, mask)
    assert torch.allclose(lp, lp0, atol=1e-12) and torch.allclose(h, h0, atol=1e-12)
    assert float(m["kept_mass"]) == 1.0 or abs(float(m["kept_mass"]) - 1) < 1e-12
    assert float(m["mean_kept_size"]) == 40 and float(m["replay_restored_frac"]) == 0
    # packed: the completions' rows concatenated, per-completion parameters through cu_seqlens
    cu = torch.tensor([0, 5, 10, 15])
    top_p = torch.tensor([0.8, 0.95, 1.0], dtype=torch.float64)
    a = ref.replay_token_logprobs(z, ids, mask, temperature=0.8, top_p=top_p, min_p=0.02)
    b = ref.replay_token_logprobs(z.reshape(15, 40), ids.reshape(15), mask.reshape(15), temperature=0.8,
                                  top_p=top_p, min_p=0.02, cu_seqlens=cu)
    assert torch.equal(a[0].reshape(15), b[0]) and torch.equal(a[1].reshape(15), b[1])
    assert all(torch.equal(u, v) for u, v in zip(a[3], b[3]))
    # per completion = its per-token expansion
    c = ref.replay_token_logprobs(z, ids, mask, temperature=0.8, top_p=top_p[:, None].expand(3, 5), min_p=0.02)
    assert torch.equal(a[0], c[0])


def test_given_mask_replays_it():
    z, ids, mask = _batch(2)
    _, _, _, sets = ref.replay_token_logprobs(z, ids, mask, top_k=5)
    lp, h, m, same = ref.replay_token_logprobs(z, ids, mask, sampling_mask=sets)
    lp_k, h_k, _, _ = ref.replay_token_logprobs(z, ids, mask, top_k=5)
    assert same is sets and torch.equal(lp, lp_k) and torch.equal(h, h_k)
    assert float(m["replay_restored_frac"]) == 0
