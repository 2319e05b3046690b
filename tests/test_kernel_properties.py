"""Kernel properties checked without the float64 reference: invariances (row shift, vocabulary permutation,
order inside a group), spec section 3's conflict weights worked by hand and precomputed for a shuffled
micro-batch, O(1) bytes saved for backward per token, and refusals (bad scale / softcap values, the Triton
backend on a CPU without the interpreter)."""
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from batches import cases
from conftest import assert_grad_close, assert_value_close, examples
from gtpo_kernels import GTPOConfig, conflict_weights, gtpo_loss
from gtpo_kernels.kernels import dispatch
from test_kernels import BACKENDS


@pytest.mark.parametrize("scale, softcap, err", [(float("nan"), None, TypeError), ("2", None, TypeError),
                                                 (1.0, 0.0, ValueError), (1.0, -3.0, ValueError),
                                                 (1.0, float("inf"), ValueError)])
def test_transforms_refuse_bad_values(scale, softcap, err):
    z, ids = torch.randn(1, 3, 8), torch.zeros(3, dtype=torch.long)
    name = "scale" if err is TypeError else "softcap"
    with pytest.raises(err, match=name):
        dispatch.vocab_fwd("torch", z, ids, torch.ones(3, dtype=torch.bool), 1.0, 0, scale, softcap)


@settings(max_examples=examples(5))  # CI time: three passes per example; nightly runs 50
@given(case=cases(), seed=st.integers(0, 1000))
def test_invariances(case, seed):
    """Shift a row, permute the vocabulary with the ids, reorder completions inside a group."""
    gen = torch.Generator().manual_seed(seed)
    cfg = GTPOConfig(entropy_threshold=None, temperature=case.temperature)
    assume(torch.isfinite(case.logits).all())
    case.logits = case.logits.clamp(-8, 8)
    kw = dict(group_size=case.G, logits_start=case.logits_start, config=cfg)
    for backend in BACKENDS:
        x = case.logits.clone().requires_grad_()
        base = gtpo_loss(x, case.ids, case.adv, case.mask, backend=backend, **kw)
        base.loss.backward()
        # 1. a constant per row
        shifted = case.logits + 3 * torch.randn(case.logits.shape[:2] + (1,), generator=gen)
        out = gtpo_loss(shifted, case.ids, case.adv, case.mask, backend=backend, **kw)
        assert_value_close("shifted loss", out.loss, base.loss.detach(), 1e-5)
        assert_value_close("shifted logps", out.logps, base.logps, 1e-5)
        # 2. vocabulary permutation with the ids
        V = case.logits.shape[-1]
        perm = torch.randperm(V, generator=gen)
        inv = torch.argsort(perm)
        ids_p = torch.where(case.ids >= 0, inv[case.ids.long().clamp(min=0)], case.ids.long())
        xp = case.logits[..., perm].clone().requires_grad_()
        out = gtpo_loss(xp, ids_p, case.adv, case.mask, backend=backend, **kw)
        out.loss.backward()
        assert_value_close("permuted loss", out.loss.detach(), base.loss.detach(), 1e-5)
        assert_value_close("permuted entropy", out.entropy, base.entropy, 1e-5)
        assert_grad_close("permuted grad", xp.grad, x.grad[..., perm], 1e-5)
        # 3. reorder completions inside each group
        B = case.ids.shape[0]
        order = torch.cat([g * case.G + torch.randperm(case.G, generator=gen) for g in range(B // case.G)])
        out = gtpo_loss(case.logits[order], case.ids[order], case.adv[order], case.mask[order],
                        backend=backend, **kw)
        assert_value_close("reordered loss", out.loss, base.loss.detach(), 1e-5)
        for name in ("per_token_loss", "lam", "logps"):
            assert_value_close(f"reordered {name}", getattr(out, name), getattr(base, name)[order], 1e-5)


def test_conflict_weights_worked_example():
    """Spec section 3's example (written out by hand there)."""
    ids = torch.tensor([[5, 7, 9, 4, 8, 2, 0, 0], [5, 7, 3, 8, 2, -100, -100, -100]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]])
    lam, n_conf = conflict_weights(ids, mask, torch.tensor([1.0, -1.0]), 2)
    assert lam.tolist() == [[2, 2, 1, 1, 2, 2, 1, 1], [0, 0, 1, 0, 0, 1, 1, 1]]
    assert n_conf.tolist() == [2, 2]


def test_conflict_weights_hand_examples():
    # group of 3: the positive shares a 3-token prefix and (right-aligned) a 2-token suffix with both
    # negatives, whose lengths differ
    ids = torch.tensor([[1, 2, 3, 9, 4, 5], [1, 2, 3, 8, 4, 5], [1, 2, 3, 4, 5, 0], [1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[1] * 6, [1] * 6, [1, 1, 1, 1, 1, 0], [1] * 6])
    adv = torch.tensor([1.0, -1.0, -2.0, 0.0])
    lam, n_conf = conflict_weights(ids[:3], mask[:3], adv[:3], 3)
    assert lam.tolist() == [[2, 2, 2, 1, 2, 2], [0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 1]]
    assert n_conf.tolist() == [3, 3, 3]  # forward runs of 3, backward runs of 2: the longer one
    # a hole at row 1 ends the forward run; masked-out row 0 makes it empty
    ids2 = torch.tensor([[7, 7, 7], [7, 7, 7]])
    assert conflict_weights(ids2, torch.tensor([[1, 0, 1], [1, 1, 1]]), torch.tensor([1.0, -1.0]),
                            2)[0].tolist() == [[2, 1, 2], [0, 1, 0]]
    assert conflict_weights(ids2, torch.tensor([[0, 1, 1], [1, 1, 1]]), torch.tensor([1.0, -1.0]),
                            2)[0].tolist() == [[1, 2, 2], [1, 0, 0]]
    # both runs cover a token of the positive: w_pos**2
    lam, n_conf = conflict_weights(ids2[:, :2], None, torch.tensor([1.0, -1.0]), 2)
    assert lam.tolist() == [[4, 4], [0, 0]] and n_conf.tolist() == [2, 2]


@given(case=cases(max_T=6), seed=st.integers(0, 100))
def test_precomputed_weights_for_a_shuffled_subset(case, seed):
    """lam / n_conf computed once for the whole batch, then passed for a shuffled micro-batch."""
    gen = torch.Generator().manual_seed(seed)
    cfg = GTPOConfig(entropy_threshold=None, loss_agg="gtpo-official", temperature=case.temperature)
    full = gtpo_loss(case.logits, case.ids, case.adv, case.mask, group_size=case.G, config=cfg,
                     logits_start=case.logits_start)
    lam, n_conf = conflict_weights(case.ids, case.mask, case.adv, case.G, config=cfg)
    B = case.ids.shape[0]
    rows = torch.randperm(B, generator=gen)[:max(1, B // 2)]
    sub = gtpo_loss(case.logits[rows], case.ids[rows], case.adv[rows], case.mask[rows], config=cfg,
                    lam=lam[rows], n_conf=n_conf[rows], logits_start=case.logits_start)
    assert torch.equal(sub.lam, full.lam[rows])
    assert_value_close("per_token_loss", sub.per_token_loss, full.per_token_loss[rows], 1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_saved_for_backward_is_o1_per_token(backend, entropy_coef):
    B, T, V = 4, 8, 300
    logits = torch.randn(B, T, V, requires_grad=True)
    ids = torch.randint(0, V, (B, T))
    saved = []

    def pack(t):
        saved.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = gtpo_loss(logits, ids, torch.tensor([1.0, -1.0, 0.5, -0.5]), group_size=2, backend=backend,
                        config=GTPOConfig(entropy_coef=entropy_coef, entropy_threshold=None))
    storage = logits.untyped_storage().data_ptr()
    extra = sum(t.numel() * t.element_size() for t in saved if t.untyped_storage().data_ptr() != storage)
    assert any(t.untyped_storage().data_ptr() == storage for t in saved), "logits saved by reference"
    assert extra / (B * T) <= 64, f"{extra / (B * T)} bytes per token saved beyond the logits"
    out.loss.backward()
    assert logits.grad is not None and (logits.grad != 0).any()


def test_triton_backend_on_cpu_needs_the_interpreter(tmp_path):
    import subprocess
    import sys
    code = ("import torch, gtpo_kernels as g\n"
            "try:\n g.gtpo_loss(torch.randn(2,3,5), torch.zeros(2,3,dtype=torch.long), torch.ones(2),"
            " group_size=2, backend='triton')\nexcept RuntimeError as e: print('ERR', e)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "TRITON_INTERPRET=1" in res.stdout, res.stdout + res.stderr
