"""GTPO for verl without verl: `gtpo_token_advantages` and `conflict_weights(group_ids=...)` against the
float64 reference (shuffled rows, groups of different sizes, padding rows, uid of any kind), spec 3's worked
example, and the errors that name the bad argument. The plugin through verl itself:
tests/test_verl_plugin.py. Both files also run in CI's second environment (.ci/run)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gtpo_reference as ref
from batches import cases
from gtpo_kernels import GTPOConfig, conflict_weights, gtpo_token_advantages

F64 = torch.float64


# --------------------------------------------------------------------------------------------------
# the float64 expectation: per group (any size), the reference's conflict weights and entropy control
# --------------------------------------------------------------------------------------------------

def _expected(adv, ids, mask, H, groups, cfg):
    """lambda * Ahat (/ n_conf with gtpo-official), float64, 0 where masked; groups: lists of rows."""
    B, T = ids.shape
    m = mask != 0
    lam = torch.ones(B, T, dtype=F64)
    n_conf = torch.ones(B, dtype=F64)
    if cfg.use_conflict_mask:
        for rows in groups:
            r = torch.tensor(rows, dtype=torch.long)
            lg, ng = ref.conflict_weights(ids[r], m[r], adv[r].double(), len(rows),
                                          cfg.conflict_pos_weight, cfg.conflict_neg_weight)
            lam[r], n_conf[r] = lg, ng
    mf = m.double()
    Hbar = (H.double() * mf).sum(1) / mf.sum(1).clamp(min=1)
    if cfg.entropy_threshold is None or (cfg.initial_entropy is not None and
                                         cfg.initial_entropy > cfg.entropy_threshold):
        kept = torch.ones(B, dtype=torch.bool)
    else:
        kept = Hbar <= cfg.entropy_threshold
    a_hat = kept.double() * (adv.double() - cfg.entropy_penalty * Hbar)
    if cfg.loss_agg == "gtpo-official":
        a_hat = a_hat / n_conf
    return torch.where(m, lam * a_hat[:, None], torch.zeros((), dtype=F64))


def _entropies(case):
    T = case.ids.shape[1]
    _, H = ref.token_logprobs(case.logits[:, case.logits_start:case.logits_start + T].double(), case.ids,
                              case.temperature, case.counted)
    return H


CONFIGS = [GTPOConfig.preset("gtpo"), GTPOConfig.preset("gtpo-official"),
           GTPOConfig.preset("gtpo", entropy_threshold=None, conflict_pos_weight=1.5, conflict_neg_weight=0.25),
           GTPOConfig.preset("gtpo", entropy_threshold=2.0, initial_entropy=3.0),
           GTPOConfig.preset("grpo")]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), cfg_i=st.integers(0, len(CONFIGS) - 1), seed=st.integers(0, 2**31 - 1),
       uid_kind=st.sampled_from(["str", "int", "object", "tensor"]), n_pad=st.integers(0, 2),
       drop=st.booleans(), adv_2d=st.booleans())
def test_token_advantages_match_reference(case, cfg_i, seed, uid_kind, n_pad, drop, adv_2d):
    """Rows shuffled, groups of different sizes (rows dropped), all-masked padding rows appended,
    uid of any kind, advantages (B,) or verl's (B, T): equal to the per-group float64 reference."""
    cfg = CONFIGS[cfg_i]
    gen = torch.Generator().manual_seed(seed)
    B, T = case.ids.shape
    H = _entropies(case).float()
    group = torch.arange(B) // case.G
    keep = torch.rand(B, generator=gen) > 0.3 if drop else torch.ones(B, dtype=torch.bool)
    keep[0] = True
    rows = torch.nonzero(keep).squeeze(1)
    ids, mask, adv, H, group = case.ids[rows], case.mask[rows], case.adv[rows], H[rows], group[rows]
    if n_pad:  # verl's padding rows: all masked, advantage 0, a uid of their own
        ids = torch.cat([ids, torch.full((n_pad, T), 7, dtype=ids.dtype)])
        mask = torch.cat([mask, torch.zeros((n_pad, T), dtype=mask.dtype)])
        adv = torch.cat([adv, torch.zeros(n_pad)])
        H = torch.cat([H, torch.rand(n_pad, T, generator=gen)])
        group = torch.cat([group, torch.full((n_pad,), 1000)])
    perm = torch.randperm(ids.shape[0], generator=gen)
    ids, mask, adv, H, group = ids[perm], mask[perm], adv[perm], H[perm], group[perm]
    groups = [torch.nonzero(group == g).squeeze(1).tolist() for g in group.unique().tolist()]
    want = _expected(adv, ids, mask, H, groups, cfg)

    uid = {"str": [f"prompt-{g}" for g in group.tolist()], "int": group.tolist(),
           "object": np.array([f"u{g}" for g in group.tolist()], dtype=object), "tensor": group}[uid_kind]
    a_in = adv[:, None] * (mask != 0) if adv_2d else adv
    got = gtpo_token_advantages(a_in, ids, mask, H, uid, config=cfg)
    assert got.shape == (ids.shape[0], T) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert not got[mask.sum(1) == 0].any()  # padding rows: 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), seed=st.integers(0, 2**31 - 1), packed=st.booleans(), holes=st.booleans())
def test_conflict_weights_group_ids(case, seed, packed, holes):
    """group_ids: shuffled rows and unequal groups equal the reference per group; contiguous keys
    equal group_size; the packed form too (rows cut after their last counted token or one later, holes
    in the mask kept). `holes`: more masked-out tokens, keeping their ids (inside shared prefixes and
    suffixes a hole must end a conflict run)."""
    gen = torch.Generator().manual_seed(seed)
    B, T = case.ids.shape
    group = torch.arange(B) // case.G
    perm = torch.randperm(B, generator=gen)
    keep = perm[: max(1, B - int(torch.randint(0, B, (1,), generator=gen)) // 2)]
    ids, mask, adv, group = case.ids[keep], case.mask[keep], case.adv[keep], group[keep]
    if holes:
        mask = (mask * (torch.rand(mask.shape, generator=gen) > 0.25)).to(mask.dtype)
    m = mask != 0
    lam_w = torch.ones(ids.shape, dtype=F64)
    nc_w = torch.ones(ids.shape[0], dtype=F64)
    for g in group.unique().tolist():
        r = torch.nonzero(group == g).squeeze(1)
        lam_w[r], nc_w[r] = ref.conflict_weights(ids[r], m[r], adv[r], len(r))
    keys = [f"g{g}" for g in group.tolist()]
    if packed:  # each row up to its last counted token, or further (masked-out tail), holes kept in the mask
        last = torch.where(m, torch.arange(1, T + 1), 0).amax(1)
        lens = torch.minimum(last + torch.randint(0, 2, last.shape, generator=gen), torch.tensor(T))
        keep_tok = torch.arange(T)[None] < lens[:, None]
        cu = torch.zeros(len(lens) + 1, dtype=torch.int64)
        cu[1:] = lens.cumsum(0)
        lam, nc = conflict_weights(ids[keep_tok], m[keep_tok], adv, group_ids=keys, cu_seqlens=cu)
        assert lam.shape == (int(cu[-1]),)
        counted = m[keep_tok]
        torch.testing.assert_close(lam.double()[counted], lam_w[m])
    else:
        lam, nc = conflict_weights(ids, mask, adv, group_ids=keys)
        torch.testing.assert_close(torch.where(m, lam.double(), 1.0), torch.where(m, lam_w, 1.0))
    torch.testing.assert_close(nc.double(), nc_w)
    lam_c, nc_c = conflict_weights(case.ids, case.mask, case.adv, case.G)
    lam_k, nc_k = conflict_weights(case.ids, case.mask, case.adv, group_ids=torch.arange(B) // case.G)
    torch.testing.assert_close(lam_k, lam_c)
    torch.testing.assert_close(nc_k, nc_c)


def _small_batch():
    ids = torch.tensor([[5, 7, 9, 4, 8, 2, 0, 0], [5, 7, 3, 8, 2, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]])
    return torch.tensor([1.0, -1.0]), ids, mask, torch.full((2, 8), 0.1)


def test_token_advantages_spec_example():
    """Spec 3's worked example, shaped with gamma = 0.1 and Hbar = 0.1."""
    adv, ids, mask, H = _small_batch()
    got = gtpo_token_advantages(adv, ids, mask, H, ["a", "a"])
    lam = torch.tensor([[2, 2, 1, 1, 2, 2, 0, 0], [0, 0, 1, 0, 0, 0, 0, 0]], dtype=torch.float32)
    a_hat = torch.tensor([1.0 - 0.01, -1.0 - 0.01])
    torch.testing.assert_close(got, torch.where(mask.bool(), lam * a_hat[:, None], 0.0))


def test_bad_input_names_the_argument():
    adv, ids, mask, H = _small_batch()
    with pytest.raises(ValueError, match="uid is required"):
        gtpo_token_advantages(adv, ids, mask, H, None)
    with pytest.raises(ValueError, match="uid must hold one group key per row: 2 entries, got 3"):
        gtpo_token_advantages(adv, ids, mask, H, ["a", "a", "b"])
    with pytest.raises(ValueError, match="uid must hold one group key per row"):
        gtpo_token_advantages(adv, ids, mask, H, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="uid must be 1-D"):
        gtpo_token_advantages(adv, ids, mask, H, np.zeros((2, 1)))
    with pytest.raises(TypeError, match="uid keys must be hashable"):
        gtpo_token_advantages(adv, ids, mask, H, [["a"], ["b"]])
    with pytest.raises(ValueError, match="response_mask must have the shape of responses"):
        gtpo_token_advantages(adv, ids, mask[:, :5], H, ["a", "a"])
    with pytest.raises(ValueError, match="entropy must have the shape of responses"):
        gtpo_token_advantages(adv, ids, mask, H[:1], ["a", "a"])
    with pytest.raises(ValueError, match="advantages must be"):
        gtpo_token_advantages(torch.ones(3), ids, mask, H, ["a", "a"])
    with pytest.raises(ValueError, match="one value per row"):
        gtpo_token_advantages(torch.randn(2, 8), ids, mask, H, ["a", "a"])
    with pytest.raises(ValueError, match="responses must be a"):
        gtpo_token_advantages(adv, ids[0], mask, H, ["a", "a"])
    with pytest.raises(ValueError, match="entropy .* is required"):
        gtpo_token_advantages(adv, ids, mask, None, ["a", "a"])
    gtpo_token_advantages(adv, ids, mask, None, ["a", "a"], config="grpo")  # no entropy needed
    with pytest.raises(TypeError, match="not both"):
        conflict_weights(ids, mask, adv, 2, group_ids=["a", "a"])
    with pytest.raises(ValueError, match="group_ids must hold one group key per row"):
        conflict_weights(ids, mask, adv, group_ids=["a"])
