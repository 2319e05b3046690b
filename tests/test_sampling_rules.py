"""The recomputed kept sets (spec 13) against a plain statement of vLLM's sampler rules, on random rows and
on rows built to sit exactly on a boundary: ties at the k-th value, a cumulative mass exactly 1 - top_p
(equal logits give exact dyadic probabilities), p_v exactly min_p * max p.

The statement follows vLLM's v1 sampler as a whole-batch tensor program (its MinPLogitsProcessor, then
apply_top_k_top_p's PyTorch path), with the two points spec 13 fixes where vLLM leaves them open: ties
in the ascending sort are ordered by token id (a stable sort), and top_p = 1 is off (no pass that could
drop masses that underflow to 0). A token is kept when its processed logit is not -inf.

Both recomputations are compared: the float64 reference (gtpo_reference.kept_sets, per row by sorting)
and the package's blockwise kernels.kept_set on float64 and float32 logits. A row where a decision lies
within the arithmetic's rounding of its threshold (a boundary row) is compared too, and a disagreement
there is counted as skipped, not as a mismatch, with its reason; the summary line reports rows,
mismatches and skipped rows.
"""
import math

import pytest
import torch

import gtpo_reference as ref
from gtpo_kernels.kernels.kept_set import kept_sets

NINF = float("-inf")


def vllm_rules(s, k, p, min_p):
    """keep (R, V) of s = z / tau (R, V) float64; k (R,) (0 or >= V: off), p (R,) (1: off), min_p (R,)."""
    R, V = s.shape
    x = s.clone()
    # min-p: probabilities of the full softmax, tokens below min_p * the largest probability removed
    probs = torch.softmax(x, -1)
    low = probs < min_p[:, None] * probs.max(-1, keepdim=True).values
    x[low & (min_p > 0)[:, None]] = NINF
    # top-k then top-p on one ascending sort (ties by id)
    xs, order = torch.sort(x, dim=-1, stable=True)
    on_k = (k > 0) & (k < V)
    kth = xs.gather(1, (V - k.clamp(1, V))[:, None])
    xs[on_k[:, None] & (xs < kth)] = NINF
    cum = torch.cumsum(torch.softmax(xs, -1), -1)
    cut = cum <= 1 - p[:, None]
    cut[:, -1] = False
    xs[cut & (p < 1)[:, None]] = NINF
    return torch.full_like(x, NINF).scatter(1, order, xs) > NINF


def margins(s, k, p, min_p):
    """Per row, how far the closest decision lies from its threshold (inf where a rule is off): min-p on
    p_v / p_max, top-k on the values (exact ties excluded: equal inputs stay equal), top-p on the
    cumulative masses."""
    R, V = s.shape
    out = torch.full((R,), math.inf, dtype=torch.float64)
    for r in range(R):
        row = s[r]
        keep = row > NINF
        if min_p[r] > 0:
            ratio = torch.exp(row - row.max())
            out[r] = min(out[r], float((ratio[keep] - min_p[r]).abs().min()))
            keep &= ratio >= min_p[r]
        vals = torch.sort(row[keep], descending=True).values
        if 0 < k[r] < vals.numel():
            kth = vals[int(k[r]) - 1]
            gap = (vals - kth).abs()
            gap = gap[gap > 0]
            if gap.numel():
                out[r] = min(out[r], float(gap.min()))
            keep &= row >= kth
        if p[r] < 1 and int(keep.sum()) > 1:
            cum = torch.cumsum(torch.softmax(torch.sort(row[keep]).values, 0), 0)[:-1]
            out[r] = min(out[r], float((cum - (1 - p[r])).abs().min()))
    return out


def random_rows(g, R, V):
    """Rows as a model gives them: peaked (a few confident tokens), flat, and with banned entries."""
    z = torch.randn(R, V, generator=g, dtype=torch.float64) * (0.5 + 4 * torch.rand(R, 1, generator=g, dtype=torch.float64))
    hot = torch.randint(0, V, (R, 3), generator=g)
    z.scatter_add_(1, hot, 6 * torch.rand(R, 3, generator=g, dtype=torch.float64))
    banned = torch.rand(R, V, generator=g) < 0.05 * (torch.arange(R) % 3 == 0)[:, None]
    z[banned] = NINF
    k = torch.where(torch.rand(R, generator=g) < 0.7, torch.randint(1, 80, (R,), generator=g), 0)
    p = torch.where(torch.rand(R, generator=g) < 0.7, 0.5 + 0.5 * torch.rand(R, generator=g, dtype=torch.float64), 1.0)
    mp = torch.where(torch.rand(R, generator=g) < 0.4, 0.2 * torch.rand(R, generator=g, dtype=torch.float64), 0.0)
    return z, k, p, mp


def boundary_rows(V):
    """Rows whose decisions sit exactly on a threshold in exact arithmetic (and in float64, float32)."""
    rows, ks, ps, mps = [], [], [], []

    def add(vals, k=0, p=1.0, mp=0.0):
        z = torch.full((V,), NINF, dtype=torch.float64)
        z[:len(vals)] = torch.tensor(vals, dtype=torch.float64)
        rows.append(z[torch.randperm(V, generator=torch.Generator().manual_seed(len(rows)))])
        ks.append(k), ps.append(p), mps.append(mp)

    add([1.0] * 8, p=0.5)  # 8 equal: cumulative 1/8 .. 1, four of them exactly <= 1/2: the lowest ids go
    add([1.0] * 4, p=0.75)  # cumulative 1/4 exactly at 1 - top_p
    add([2.0] * 4 + [1.0] * 4 + [0.0] * 8, k=6)  # ties at the 6th value: all four 1.0 kept
    add([2.0, 1.0, 1.0, 1.0, 0.5], k=2)  # the 2nd value is tied three ways
    add([3.0] * 2 + [1.0] * 6, k=4, p=0.9)  # ties at k-th, then top-p
    add([0.0] * 2 + [math.log(0.5)] * 2, mp=0.5)  # p_v / p_max = 0.5 (to rounding) at min_p = 0.5
    add([0.0] * 4, mp=0.999)  # equal probabilities: min-p keeps all
    add([1.0] * 16, k=16, p=0.25)  # k = all remaining; cumulative 12/16 exactly <= 3/4
    return torch.stack(rows), torch.tensor(ks), torch.tensor(ps, dtype=torch.float64), \
        torch.tensor(mps, dtype=torch.float64)


def as_sets(keep):
    ids = keep.nonzero()
    return ids[:, 1], torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(keep.sum(1), 0)])


def compare(name, got, want_keep, margin, eps, report):
    """got: (token_ids, offsets); mismatches at rows within eps of a threshold are skipped."""
    ids, off = got[0].cpu(), got[1].cpu()
    mism, skipped = [], []
    for r in range(want_keep.shape[0]):
        want = want_keep[r].nonzero().squeeze(1)
        have = ids[int(off[r]):int(off[r + 1])]
        if not torch.equal(have, want):
            (skipped if margin[r] < eps else mism).append(r)
    report[name] = (want_keep.shape[0], len(mism), len(skipped))
    return mism


@pytest.mark.parametrize("seed", [0, 1])
def test_kept_sets_follow_vllm_rules(seed):
    g = torch.Generator().manual_seed(seed)
    V = 257
    z, k, p, mp = random_rows(g, 96, V)
    zb, kb, pb, mpb = boundary_rows(V)
    z, k, p, mp = torch.cat([z, zb]), torch.cat([k, kb]), torch.cat([p, pb]), torch.cat([mp, mpb])
    R = z.shape[0]
    tau = torch.where(torch.arange(R) % 2 == 0, 1.0, 0.7).double()
    tau[-zb.shape[0]:] = 1.0  # the built rows keep their exact values
    want = vllm_rules(z / tau[:, None], k, p, mp)
    margin = margins(z / tau[:, None], k, p, mp)
    report = {}
    rows_b, rows_t = torch.zeros(R, dtype=torch.long), torch.arange(R)
    # no restoring here: the targets are drawn inside the sets
    y = torch.tensor([int(want[r].nonzero()[0, 0]) for r in range(R)])
    r_ids, r_off, r_rest = ref.kept_sets(z, tau, k, p, mp, y)
    bad = compare("reference float64", (r_ids, r_off), want, margin, 1e-12, report)
    p_ids, p_off, _, _, _ = kept_sets(z[None], rows_b, rows_t, y, tau, k, p, mp, block_rows=13)
    bad += compare("package float64", (p_ids, p_off), want, margin, 1e-12, report)
    # every row with a top_k: the blocks take the path that sorts only the candidates
    kk = torch.where(k > 0, k, 40)
    want_k = vllm_rules(z / tau[:, None], kk, p, mp)
    margin_k = margins(z / tau[:, None], kk, p, mp)
    yk = torch.tensor([int(want_k[r].nonzero()[0, 0]) for r in range(R)])
    k_ids, k_off, k_rest, _, _ = kept_sets(z[None], rows_b, rows_t, yk, tau, kk, p, mp, block_rows=13)
    bad += compare("package float64, top-k path", (k_ids, k_off), want_k, margin_k, 1e-12, report)
    # float32 logits (exactly the float64 values rounded): s = z / tau in float32 moves decisions within
    # ~1e-6 of their thresholds, the float32 sums within ~1e-6 of the cumulative masses
    z32 = z.float()
    want32 = vllm_rules(z32.double() / tau[:, None], k, p, mp)
    margin32 = margins(z32.double() / tau[:, None], k, p, mp)
    f_ids, f_off, _, _, _ = kept_sets(z32[None], rows_b, rows_t, y, tau.float(), k, p.float(), mp.float())
    bad += compare("package float32", (f_ids, f_off), want32, margin32, 1e-5, report)
    print(f"\nseed {seed}, {R} rows ({zb.shape[0]} built on a boundary), {int((margin < 1e-12).sum())} rows "
          f"within 1e-12 and {int((margin32 < 1e-5).sum())} within 1e-5 of a threshold; "
          + "; ".join(f"{n}: {t[0]} rows, {t[1]} mismatches, {t[2]} boundary rows skipped"
                      for n, t in report.items()))
    assert not bad, f"kept sets differ from vLLM's rules at rows {bad}: {report}"
    # the built rows decide exactly at the threshold and are compared, not skipped
    assert report["reference float64"][2] == 0 and report["package float64"][2] == 0 and not r_rest.any(), report
    assert report["package float64, top-k path"][2] == 0 and not k_rest.any(), report
    assert report["package float32"][2] <= 2, report


def test_statement_sees_the_boundaries():
    """The rules as stated give the hand results on the built rows (ids in ascending order)."""
    V = 16
    z = torch.tensor([[1.0] * 8 + [NINF] * 8, [2.0, 1.0, 1.0, 1.0, 0.5] + [NINF] * 11])
    keep = vllm_rules(z.double(), torch.tensor([0, 2]), torch.tensor([0.5, 1.0], dtype=torch.float64),
                      torch.zeros(2, dtype=torch.float64))
    assert keep[0].nonzero().squeeze(1).tolist() == [4, 5, 6, 7]  # 1/8 .. 4/8 <= 1/2: ids 0..3 removed
    assert keep[1].nonzero().squeeze(1).tolist() == [0, 1, 2, 3]  # the 2nd value tied three ways
    assert ref.kept_set_row(z[0].double(), 0, 0.5, 0.0).tolist() == [4, 5, 6, 7]
    assert ref.kept_set_row(z[1].double(), 2, 1.0, 0.0).tolist() == [0, 1, 2, 3]
    assert V == z.shape[1]


def test_sampled_token_restored():
    """A sampled token outside the rebuilt set is added back and counted."""
    z = torch.tensor([[4.0, 3.0, 0.0, -1.0]])
    y = torch.tensor([3])
    ids, off, rest = ref.kept_sets(z.double(), 1.0, 2, None, None, y)
    assert ids.tolist() == [0, 1, 3] and rest.tolist() == [True]
    p_ids, p_off, p_rest, nf, _ = kept_sets(z[None], torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                                         y, 1.0, 2)
    assert p_ids.tolist() == [0, 1, 3] and p_off.tolist() == [0, 3] and p_rest.tolist() == [True]
    assert not nf.any()


def test_metrics_match_reference():
    """kept_mass, mean_kept_size, replay_restored_frac: the recompute's and the two-pass forms against the
    reference's sums."""
    from gtpo_kernels.kernels.replay import kept_mass_from_logps, replay_logprobs, replay_metrics
    g = torch.Generator().manual_seed(3)
    z, k, p, mp = random_rows(g, 24, 120)
    z[:, :3] = torch.randn(24, 3, generator=g, dtype=torch.float64)  # finite target candidates
    y = torch.randint(0, 3, (24,), generator=g)
    tau = 0.9
    ids, off, rest = ref.kept_sets(z, tau, k, p, mp, y)
    want = ref.sampling_metrics(z, (ids, off), tau, rest)
    assert want["kept_mass"] < 1 and want["replay_restored_frac"] > 0
    rb, rt = torch.zeros(24, dtype=torch.long), torch.arange(24)
    p_ids, p_off, p_rest, _, mass = kept_sets(z[None].float(), rb, rt, y, tau, k, p.float(), mp.float())
    got = replay_metrics(p_off, p_rest, mass)
    for name in ("kept_mass", "mean_kept_size", "replay_restored_frac"):
        assert abs(float(got[name]) - float(want[name])) <= 1e-5 * max(1.0, abs(float(want[name]))), name
    lp_k, _, _ = replay_logprobs(z[None].float(), rb, rt, y, tau, p_ids, p_off)
    lp_v = torch.log_softmax(z.float() / tau, -1).gather(1, y[:, None]).squeeze(1)
    assert abs(float(kept_mass_from_logps(lp_v, lp_k).mean()) - float(want["kept_mass"])) <= 1e-5


def test_recompute_is_blockwise(monkeypatch):
    """The recompute sorts blocks of at most rows_per_block(V) rows (here 4), never all M rows at once
    (with a top_k on every row, only each row's candidates), and the blocks do not change the result; a row holding NaN or +inf is flagged; bfloat16 logits are
    upcast (the sets of the bf16 values)."""
    import gtpo_kernels.kernels.kept_set as ks
    g = torch.Generator().manual_seed(5)
    M, V = 19, 64
    z, k, p, mp = random_rows(g, M, V)
    z = z.to(torch.bfloat16)
    z[:, 0] = 1.0
    z[7, 5] = float("nan")
    z[11, 6] = float("inf")
    y = torch.zeros(M, dtype=torch.long)
    rb, rt = torch.zeros(M, dtype=torch.long), torch.arange(M)
    whole = kept_sets(z[None], rb, rt, y, 1.0, k, p, mp, block_rows=M)
    monkeypatch.setattr(ks, "CHUNK_ELEMENTS", 4 * V)
    shapes = []
    real_sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda x, *a, **kw: shapes.append(tuple(x.shape)) or real_sort(x, *a, **kw))
    blocked = kept_sets(z[None], rb, rt, y, 1.0, k, p, mp)
    assert len(shapes) >= 5 and max(s[0] for s in shapes) == 4  # 5 blocks of at most 4 rows
    shapes.clear()
    kept_sets(z[None], rb, rt, y, 1.0, torch.full((M,), 5), p, mp)
    assert shapes and all(s[0] <= 4 and s[1] < V for s in shapes)  # with top_k: only the candidates
    for a, b in zip(whole, blocked):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert blocked[3].nonzero().squeeze(1).tolist() == [7, 11]
    fine = [r for r in range(M) if r not in (7, 11)]
    want = vllm_rules(z.double()[fine], k[fine], p[fine], mp[fine])
    ids, off = blocked[0], blocked[1]
    for j, r in enumerate(fine):
        have = ids[int(off[r]):int(off[r + 1])]
        assert torch.equal(have, torch.sort(torch.unique(torch.cat([want[j].nonzero().squeeze(1), y[r:r + 1]]))).values)


@pytest.mark.parametrize("backend", ["triton", "torch", "reference"])
def test_top_p_mass_just_above_the_cut(backend):
    """Two tied maxima over a tail of mass ~1e-8, top_p = 0.5: the cumulative mass at the first maximum is
    0.5 + ~1e-8, above the cut 1 - top_p, so both stay (logp -ln 2, entropy ln 2, the float64 oracle's).
    The torch path summed the masses in float32, rounded that mass onto the cut and dropped one maximum
    (logp 0, entropy 0); every backend now sums them in float64, as the Triton kernel does."""
    from gtpo_kernels import token_logprobs
    z = torch.tensor([[[20.0, 20.0, 1.0, 1.0, 0.5, 0.0]]])
    ids = torch.tensor([[1]])
    want, want_h, _, _ = ref.replay_token_logprobs(z.double(), ids, None, top_p=0.5)
    lp, h = token_logprobs(z, ids, 1.0, backend=backend, top_p=0.5)
    assert abs(float(want) + math.log(2)) < 1e-12
    assert abs(float(lp) - float(want)) < 1e-6 and abs(float(h) - float(want_h)) < 1e-6, (float(lp), float(h))
