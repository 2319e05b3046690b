"""Recorded kept sets on a vocabulary split with bfloat16 logits (spec 7, 12, 13): the merge gathered the sampled
id's logit twice (its set entry and its target term), so autograd rounded each part of its gradient to bfloat16
before summing them. At a confident token, 1 - p_y is a small difference of the two: the split's gradient there
was 2.3x one process's, or 0 where it is 5.3e-5 (the LM head's weight-gradient row alike). The target term now
reads the set entry itself (one gather), and the head's backward forms 1 - p_y as -expm1: the split equals one
process at the sampled id (1e-2, spec 7's 16-bit gradient target) and the float64 gradient's norm."""
import torch
import torch.distributed as dist

from gloo import run_ranks_ok

V, S0, D = 23, 12, 8


def _case(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, V, generator=g) * 3
    x[0, 0, 9] = x.max() + 4  # the sampled id 9 (rank 0's) holds nearly all its set's mass
    sel = torch.rand(V, generator=g) < 0.4
    sel[9] = True
    keep = sel.nonzero().reshape(-1)
    return x.bfloat16(), (keep, torch.tensor([0, keep.numel()]))


def _checks(rank, world):
    from gtpo_kernels import gtpo_loss, linear_gtpo_loss
    sl = slice(0, S0) if rank == 0 else slice(S0, V)
    ids, adv, res = torch.tensor([[9]]), torch.tensor([-0.3]), {}
    for seed in (1, 5):
        x, sm = _case(seed)
        x64 = x.double().requires_grad_()
        gtpo_loss(x64, ids, adv, config="grpo", sampling_mask=sm, backend="reference").loss.backward()
        for backend in ("torch", "triton"):
            grads = []
            for pg in (None, dist.group.WORLD):
                leaf = (x if pg is None else x[..., sl]).clone().requires_grad_()
                gtpo_loss(leaf, ids, adv, config="grpo", sampling_mask=sm, backend=backend,
                          process_group=pg).loss.backward()
                grads.append(leaf.grad[..., sl] if pg is None else leaf.grad)
            one, split = (gr.float().reshape(-1) for gr in grads)
            ref = x64.grad[..., sl].reshape(-1)
            res[f"logits {seed} {backend}"] = (float((one - split).abs().max() / one.abs().max()),
                                               float((split.double() - ref).norm() / ref.norm()))
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(1, 1, D, generator=g), torch.randn(V, D, generator=g)
    w[9] = h[0, 0] * 1.2
    h, w = h.bfloat16(), w.bfloat16()
    sel = torch.rand(V, generator=g) < 0.4
    sel[9] = True
    keep = sel.nonzero().reshape(-1)
    sm = (keep, torch.tensor([0, keep.numel()]))
    grads = []
    for pg in (None, dist.group.WORLD):
        leaf = (w if pg is None else w[sl]).clone().requires_grad_()
        linear_gtpo_loss(h, leaf, ids, adv, config="grpo", sampling_mask=sm, backend="torch",
                         process_group=pg).loss.backward()
        grads.append((leaf.grad[sl] if pg is None else leaf.grad).float())
    res["head"] = (float((grads[0] - grads[1]).abs().max() / grads[0].abs().max()), 0.0)
    return res


def test_a_confident_token_s_split_bf16_gradient():
    for rank, res in enumerate(run_ranks_ok(_checks, 2)):
        for key, (to_one, to_ref) in res.items():
            assert to_one <= 1e-2 and to_ref <= 1e-2, (rank, key, to_one, to_ref)
