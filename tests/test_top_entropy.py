"""Spec 9's top-entropy mask on the epilogue path (kernels/top_entropy.py: the entropies' sort key and
torch.sort before the epilogue, the threshold and the mask in the epilogue kernel): fixed cases against the
float64 reference and the eager twin (backend='torch'), with ties at the threshold, a completion that the
mask drops whole and one that is not counted at all; gtpo_loss_from_logps and the fused LM head on the same
mask; the epilogue refused on a tile alone. tests/test_epilogue.py draws top_entropy_quantile with its other
options; tests/test_launches.py counts the launches."""
import pytest
import torch
from gtpo_reference import gtpo_family

import test_runtime
from bench.launches import counting
from conftest import assert_grad_close, assert_value_close
from gtpo_kernels import GTPOConfig, gtpo_loss, gtpo_loss_from_logps, linear_gtpo_loss
from gtpo_kernels.kernels import loss_ops, top_entropy
from test_epilogue import TOL, _call, _compare


def _tied_batch(seed=7):
    """B = 4 completions of T = 6 tokens: 0 peaked (low entropies), 1 flat (high), 2 one logits row repeated
    (six entropies tied, between the two), 3 not counted (mask all False). The 18 counted entropies, sorted:
    0's six, the six ties (positions 6..11), 1's six."""
    g = torch.Generator().manual_seed(seed)
    B, T, V = 4, 6, 16
    logits = torch.randn(B, T, V, generator=g)
    logits[0] *= 12.0
    logits[1] *= 0.3
    logits[2] = logits[2, 0] * 2.0  # every token of completion 2: the same row, the same entropy
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[3] = False
    adv = torch.tensor([0.7, -1.1, 0.9, 0.4])
    lp = torch.log_softmax(logits.double(), -1).gather(-1, ids[..., None])[..., 0]
    old = (lp + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    ref = (lp + 0.2).float()
    return logits, ids, mask, adv, old, ref


# rho -> (counted tokens kept, completion 0 dropped whole); q = 1 - rho, the threshold at pos = 17 q among the
# 18 sorted entropies (0's six at 0..5, the ties at 6..11, 1's six at 12..17): 0.81: pos 3.23, inside 0's
# (its two largest kept); 0.7: pos 5.1, between 0's largest and the ties (ties and 1 kept); 0.5: pos 8.5, on
# the ties (v_lo == v_hi: every tie kept); 0.35: pos 11.05 and 0.31: pos 11.73, between the ties and 1 (ties
# dropped; at 0.31 a position off by one, M q, would drop 1's smallest too)
_KEPT = {0.81: (14, False), 0.7: (12, True), 0.5: (12, True), 0.35: (6, True), 0.31: (6, True)}


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("rho", sorted(_KEPT))
def test_ties_at_the_threshold_and_masked_completions(rho, packed):
    """The mask keeps the tied entropies together (all kept when the threshold is theirs), drops completion 0
    whole (but at 0.81), and ignores completion 3 (not counted: +inf in the sort key, sorted after the counted
    ones): the outputs and the gradient equal the float64 reference's and the eager twin's; the dropped tokens
    carry no policy term, bonus nor gradient of either (only their KL term)."""
    logits, ids, mask, adv, old, ref = _tied_batch()
    H = torch.special.entr(torch.softmax(logits.double(), -1)).sum(-1)
    assert torch.equal(H[2], H[2, :1].expand(6)) and H[0].max() < H[2, 0] < H[1].min()
    cfg = GTPOConfig.preset("grpo", top_entropy_quantile=rho, entropy_coef=0.01, beta=0.04, entropy_threshold=None)
    keep = gtpo_family.top_entropy_mask(H, mask, rho)
    assert (int(keep.sum()), not keep[0].any()) == _KEPT[rho] and not keep[3].any(), keep
    c = dict(G=2, cfg=cfg, packed=packed, mask="bool", old=True, lam="off", items=None, tau=None)
    up = torch.ones(4, 6)
    out, grad, k = _call(c, logits, ids, mask, adv, old, ref, None, "triton", up)
    assert k.triton_names.get("_epilogue_kernel") == 1 and k.launches <= 6, (k.launches, dict(k.triton_names))
    ref_out, ref_grad, _ = _call(c, logits.double(), ids, mask, adv, old.double(), ref.double(), None, "reference", up)
    assert ref_grad.abs().sum() > 0
    _compare("ties vs reference", out, grad, ref_out, ref_grad, mask)
    twin, twin_grad, _ = _call(c, logits, ids, mask, adv, old, ref, None, "torch", up)
    _compare("ties vs torch", out, grad, twin, twin_grad.double(), mask)
    # the dropped tokens' loss is their KL term alone: the same loss without the policy term and the bonus
    no_pg = cfg.replace(top_entropy_quantile=1.0, entropy_coef=0.0)
    kl_only = gtpo_loss(logits, ids, torch.zeros(4), mask, old_logps=old, ref_logps=ref, config=no_pg,
                        backend="torch", validate=False)
    drop = mask & ~keep
    ltok = out.per_token_loss.reshape(4, 6)
    assert_value_close("dropped tokens", ltok, kl_only.per_token_loss, TOL, where=drop)
    assert (ltok - kl_only.per_token_loss).abs()[keep].min() > 1e-4  # the kept ones carry more


def test_unvalidated_flagged_token_sorts_last_as_on_the_eager_path():
    """validate=False, a counted token flagged (its id out of range: its row's entropy is finite): its entropy
    is NaN in the sort key (sorted after the uncounted tokens' +inf, as the eager sort puts it), so the quantile
    reads a NaN: every counted token's mask is NaN (spec 6: what it touches), as the oracle's threshold (it took
    the others' threshold from the finite keys: finite per-token losses where the oracle kept none), and the
    per-token outputs and the gradient equal the eager twin's."""
    logits, ids, mask, adv, old, ref = _tied_batch()
    ids[0, 2] = 16 + 3  # a low entropy: without it the threshold falls between the ties and 1 (pos 11.05 of
    # 17 sorted finite keys: 1's smallest dropped); counted as its own entropy, below the ties (1's six kept)
    cfg = GTPOConfig.preset("grpo", top_entropy_quantile=0.35, entropy_coef=0.01, entropy_threshold=None,
                            loss_agg="none")
    outs = {}
    for backend in ("triton", "torch"):
        x = logits.clone().requires_grad_()
        out = gtpo_loss(x, ids, adv, mask, old_logps=old, config=cfg, backend=backend, validate=False)
        out.loss.backward(torch.where(mask, 1.0, 0.0))
        outs[backend] = (out.per_token_loss, x.grad)
    torch.testing.assert_close(outs["triton"][0], outs["torch"][0], equal_nan=True, rtol=TOL, atol=TOL)
    torch.testing.assert_close(outs["triton"][1], outs["torch"][1], equal_nan=True, rtol=TOL, atol=TOL)
    ltok = outs["torch"][0]
    assert torch.isnan(ltok[mask]).all() and (ltok[~mask] == 0).all()


def test_no_counted_token_and_an_empty_batch():
    """Nothing counted: the mask keeps nothing (M = 0, the threshold +inf) as on the eager path; no token at
    all: no sort, no launch reads the sorted keys."""
    logits, ids, mask, adv, old, ref = _tied_batch()
    cfg = GTPOConfig.preset("grpo", top_entropy_quantile=0.5, entropy_coef=0.01, entropy_threshold=None)
    none = torch.zeros_like(mask)
    outs = [gtpo_loss(logits, ids, adv, none, old_logps=old, config=cfg, backend=b, validate=False)
            for b in ("triton", "torch")]
    assert float(outs[0].loss) == float(outs[1].loss) == 0.0
    empty = [gtpo_loss(torch.randn(0, 16), torch.zeros(0, dtype=torch.long), torch.ones(1),
                       cu_seqlens=torch.zeros(2, dtype=torch.long), config=cfg, backend=b, validate=False)
             for b in ("triton", "torch")]
    assert float(empty[0].loss) == float(empty[1].loss) == 0.0


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_from_logps_takes_the_mask_in_the_epilogue(packed):
    """gtpo_loss_from_logps with the mask (entropies given): the epilogue path (its prep kernel, the sort key
    and the sort, the epilogue), against the eager twin: values, outputs and the gradients w.r.t. the
    log-probs and the entropies (the bonus: masked too)."""
    logits, ids, mask, adv, old, ref = _tied_batch()
    cfg = GTPOConfig.preset("grpo", top_entropy_quantile=0.5, entropy_coef=0.01, beta=0.04, entropy_threshold=None)
    logp_all = torch.log_softmax(logits, -1)
    lp = logp_all.gather(-1, ids[..., None])[..., 0]
    H = -(logp_all.exp() * logp_all).sum(-1)
    kw = dict(old_logps=old, ref_logps=ref)
    args = [lp, ids, adv, mask]
    if packed:
        kw = {k: v.reshape(-1) for k, v in kw.items()}
        kw.update(cu_seqlens=torch.arange(0, 25, 6), max_seqlen=6)
        args, H = [lp.reshape(-1), ids.reshape(-1), adv, mask.reshape(-1)], H.reshape(-1)
    outs = {}
    for backend in ("triton", "torch"):
        x, h = args[0].clone().requires_grad_(), H.clone().requires_grad_()
        out = gtpo_loss_from_logps(x, *args[1:], entropy=h, config=cfg, group_size=2, backend=backend,
                                   validate=False, **kw)
        out.loss.backward()
        outs[backend] = (out, x.grad, h.grad)
    (o, gx, gh), (t, tx, th) = outs["triton"], outs["torch"]
    counted = args[3]
    assert tx.abs().sum() > 0 and (th[counted] == 0).any() and (th[counted] != 0).any()  # the bonus masked
    assert_value_close("loss", o.loss, t.loss, TOL)
    for f in ("logps", "entropy", "per_token_loss"):
        assert_value_close(f, getattr(o, f), getattr(t, f), TOL, where=counted)
    assert_grad_close("grad logps", gx[..., None], tx[..., None].double(), TOL)
    assert_grad_close("grad entropy", gh[..., None], th[..., None].double(), TOL)


def test_the_lm_head_takes_the_mask_once_per_call():
    """linear_gtpo_loss with the mask (tiles of 4 rows: completions span tiles, the recompute schedule): the
    epilogue once per call on every tile's entropies, equal to gtpo_loss on the materialized logits."""
    g = torch.Generator().manual_seed(3)
    B, T, D, V = 4, 6, 8, 24
    h = torch.randn(B, T, D, generator=g)
    w = torch.randn(V, D, generator=g) * 0.7
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    adv = torch.randn(B, generator=g)
    cfg = GTPOConfig.preset("grpo", top_entropy_quantile=0.4, entropy_coef=0.01, entropy_threshold=None)
    hh = h.clone().requires_grad_()
    with counting() as k:
        out = linear_gtpo_loss(hh, w, ids, adv, mask, config=cfg, memory_budget=2 * V * 4 * 4, backend="triton",
                               validate=False)
        out.loss.backward()
    assert float(out.metrics["grad_in_forward"]) == 0.0
    assert k.triton_names.get("_epilogue_kernel") == 1 and k.triton_names.get("_entropy_key_kernel") == 1, \
        dict(k.triton_names)
    z = (h @ w.T).requires_grad_()
    want = gtpo_loss(z, ids, adv, mask, config=cfg, backend="torch", validate=False)
    want.loss.backward()
    assert_value_close("loss", out.loss, want.loss, TOL)
    assert_value_close("per_token_loss", out.per_token_loss, want.per_token_loss, TOL, where=mask)
    assert_grad_close("grad hidden", hh.grad, (z.grad @ w).double(), TOL)


def test_the_epilogue_is_refused_on_a_tile_alone():
    """The quantile spans every counted token: an epilogue over a tile's completions only (the fused LM head's)
    would sort a partial batch; loss_ops.epilogue refuses it."""
    n, B = 6, 2
    floats = [0.0] * len(loss_ops.FLOATS)
    flags = [0] * len(loss_ops.FLAGS)
    flags[loss_ops.FLAGS.index("TOP_ENT")] = 1
    x = torch.zeros(n)
    outs = loss_ops.epilogue_outputs(x, n, B, flags)
    with pytest.raises(ValueError, match="spans the whole batch"):
        loss_ops.epilogue(x, x, torch.zeros(n, dtype=torch.int8), None, None, torch.zeros(B), None, None, None, None,
                          None, floats, flags, B, None, outs, g_lo=1, g_hi=2)


def test_the_key_kernel_specializes_no_batch_size():
    test_runtime.test_no_per_batch_size_is_constexpr(top_entropy._entropy_key_kernel)
