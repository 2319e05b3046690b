"""The fused LM head at its floor: no tile ever exceeds the memory budget (every preset and option);
the per-tile work and host syncs do not grow with the number of tiles; rows with a zero gradient
coefficient skip the gradient GEMMs; the fused schedule's backward runs twice and under autograd.grad;
torch.compile(fullgraph=True) of a step with the defaults traces, both schedules."""
import os
import sys

import pytest
import torch

from conftest import assert_grad_close, assert_value_close
from gtpo_kernels import GTPOConfig, conflict_weights, linear_gtpo_loss
from gtpo_kernels.pipeline import loss as pipeline_loss
from gtpo_kernels.pipeline import tiles
from gtpo_kernels.pipeline.head import row_bytes

BACKENDS = ["triton", "torch"]


def _long_batch(B=4, T=12, D=8, V=30, seed=3, peaked=(), flat=()):
    """Completions of T tokens (longer than the small budgets below), holes in the mask; completions in
    `peaked` get low entropy, those in `flat` near log V (the entropy filter drops them)."""
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g)
    for i in peaked:
        h[i] *= 4.0
    for i in flat:
        h[i] *= 0.01
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, T - 3:] = False
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:B]
    return h, w, ids, mask, adv


def _spy(monkeypatch, name, record):
    """Wraps tiles.<name> so that record(args) sees each call (the GEMMs: project, grad_gemms)."""
    orig = getattr(tiles, name)

    def wrapped(*args):
        record(*args)
        return orig(*args)
    monkeypatch.setattr(tiles, name, wrapped)


SPANNING = [("gtpo", {}), ("gspo", {}), ("grpo", dict(off_policy_mask_threshold=0.5)), ("vespo", {}),
            ("grpo", dict(top_entropy_quantile=0.5)), ("grpo", dict(loss_agg="none")), ("grpo", {})]


@pytest.mark.parametrize("preset,over", SPANNING)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_tile_exceeds_the_budget(monkeypatch, preset, over, dtype):
    """Spec 11: the budget is a bound. Every projected tile (the GEMM's output buffer, and its gradient
    written in its place or beside it) fits memory_budget, for every option that changes the schedule,
    with completions longer than a tile: they are split and the recompute schedule runs; 'fused' is refused."""
    h, w, ids, mask, adv = _long_batch()
    h, w = h.to(dtype), w.to(dtype)
    V = w.shape[0]
    budget = 5 * row_bytes(V, dtype, h.device) + 7  # 5 rows; completions hold up to 12
    seen, shapes = [], []  # rows of the whole-vocabulary tiles; every tile's (rows, entries)
    _spy(monkeypatch, "project", lambda hh, ww, bb, out: (shapes.append(tuple(out.shape)),
                                                        out.shape[1] == V and seen.append(out.shape[0])))
    cfg = GTPOConfig.preset(preset, entropy_threshold=3.0, **over) if preset == "gtpo" else \
        GTPOConfig.preset(preset, **over)
    hh = h.clone().requires_grad_()
    out = linear_gtpo_loss(hh, w, ids, adv, mask, group_size=2, config=cfg, memory_budget=budget, backend="torch")
    out.loss.sum().backward()
    assert seen and max(seen) <= 5, seen
    assert sum(seen) >= int(mask.sum()), seen  # every counted row projected
    assert max(seen) * row_bytes(V, dtype, h.device) <= budget
    # the backward by vocabulary blocks: taller, narrower tiles of at most the budget's elements
    assert max(r * c for r, c in shapes) * row_bytes(V, dtype, h.device) <= budget * V, shapes
    spans = not (preset == "grpo" and not over)
    assert float(out.metrics["grad_in_forward"]) == (0.0 if spans else 1.0)
    if spans:
        with pytest.raises(ValueError, match="schedule='fused' needs"):
            linear_gtpo_loss(h, w, ids, adv, mask, group_size=2, config=cfg, memory_budget=budget, schedule="fused")
    with pytest.raises(ValueError, match="memory_budget = .* holds no row"):
        linear_gtpo_loss(h, w, ids, adv, mask, group_size=2, config=cfg,
                         memory_budget=row_bytes(V, dtype, h.device) - 1)


class _Syncs:
    """Counts the host reads (the Tensor methods that read the device) made by the package outside the
    kernels (the torch backend's chunking and its CPU temperature read belong to the kernels' path)."""
    NAMES = ("tolist", "item", "nonzero", "__bool__", "__int__", "__float__")

    def __init__(self, monkeypatch):
        self.n = 0
        for name in self.NAMES:
            orig = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counted(orig))

    def _counted(self, orig):
        def f(t, *a, **k):
            caller = sys._getframe(1).f_code.co_filename
            if "gtpo_kernels" in caller and f"{os.sep}kernels{os.sep}" not in caller:
                self.n += 1
            return orig(t, *a, **k)
        return f


@pytest.mark.parametrize("preset", ["grpo", "gtpo"])
def test_tile_work_does_not_grow_with_the_tiles(monkeypatch, preset):
    """The fused schedule's O(N) work and its host reads are the same with 1 tile and with a tile per
    completion: the surrogate sees each token once per tile loop plus once for the loss, and no host read
    happens inside the loop (validate=False)."""
    h, w, ids, mask, adv = _long_batch(T=6, peaked=(0, 2))
    cfg = GTPOConfig.preset(preset, entropy_threshold=3.0) if preset == "gtpo" else preset
    tokens = []
    orig = pipeline_loss.surrogate
    monkeypatch.setattr(pipeline_loss, "surrogate", lambda logp, *a, **k: tokens.append(logp.numel()) or
                        orig(logp, *a, **k))
    counts, grads = [], []
    for rows in (1000, 6):
        tokens.clear()
        syncs = _Syncs(monkeypatch)
        hh = h.clone().requires_grad_()
        out = linear_gtpo_loss(hh, w, ids, adv, mask, group_size=2, config=cfg, validate=False, backend="torch",
                               memory_budget=rows * row_bytes(w.shape[0], w.dtype, h.device), schedule="fused")
        out.loss.backward()
        assert float(out.metrics["grad_in_forward"]) == 1.0
        counts.append((sum(tokens), syncs.n))
        grads.append(hh.grad)
        monkeypatch.undo()
        monkeypatch.setattr(pipeline_loss, "surrogate", lambda logp, *a, **k: tokens.append(logp.numel()) or
                            orig(logp, *a, **k))
    M, N = int(mask.sum()), mask.numel()
    assert counts[0] == counts[1], counts  # (surrogate tokens, host reads): 1 tile vs 4
    assert counts[0][0] == M + N, counts
    assert counts[0][1] <= 3, counts  # the plan: counted rows, rows per completion (+ the longest, when needed)
    assert grads[0].abs().sum() > 0
    assert_grad_close("grad hidden, 1 tile vs 4", grads[1], grads[0], 1e-6)


def _both_schedules(monkeypatch, h, w, ids, adv, mask, cfg, backend, **kw):
    """{schedule: (grad hidden, grad weight, rows of each projection, rows of each gradient GEMM call),
    'kept': the fused call's kept completions}, groups of 2."""
    proj, grad_rows, got = [], [], {}
    _spy(monkeypatch, "project", lambda hh, ww, bb, out: proj.append(out.shape[0]))
    _spy(monkeypatch, "grad_gemms", lambda gz, hh, idx, ww, g, at=None: grad_rows.append(gz.shape[0]))
    for schedule in ("fused", "recompute"):
        proj.clear(), grad_rows.clear()
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        out = linear_gtpo_loss(hh, ww, ids, adv, mask, group_size=2, config=cfg, schedule=schedule, backend=backend,
                               **kw)
        out.loss.backward()
        got[schedule] = (hh.grad, ww.grad, list(proj), list(grad_rows))
        got.setdefault("kept", out.kept.tolist())
    return got


def test_zero_rows_skip_the_gradient_gemms(monkeypatch):
    """Recompute schedule: with half the completions dropped by the entropy filter, the backward's
    projection and both gradient GEMMs run on the kept half of the rows only; gradients match 'fused'."""
    h, w, ids, mask, adv = _long_batch(T=6, peaked=(0, 2), flat=(1, 3))
    mask[:] = True
    cfg = GTPOConfig.preset("gtpo", entropy_threshold=2.0, use_conflict_mask=False)
    got = _both_schedules(monkeypatch, h, w, ids, adv, mask, cfg, "torch")
    assert got["kept"] == [True, False, True, False]
    N = mask.numel()
    _, _, proj_r, grad_r = got["recompute"]
    assert sum(proj_r) == N + N // 2, proj_r  # the forward's projection, then the kept half
    assert sum(grad_r) == N // 2, grad_r
    assert (got["recompute"][0][1::2] == 0).all() and got["recompute"][0].abs().sum() > 0
    assert_grad_close("grad hidden", got["recompute"][0], got["fused"][0], 1e-6)
    assert_grad_close("grad weight", got["recompute"][1], got["fused"][1], 1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["zero_adv", "zero_adv_split", "zero_adv_masked", "conflict_token",
                                  "conflict_split", "conflict_sequence", "kl"])
def test_fused_skips_rows_known_to_have_no_gradient(monkeypatch, backend, case):
    """Fused schedule: rows whose coefficient is 0 before any logit is read skip the gradient kernel and
    GEMMs (counted while planning, no extra host read): a completion with A = 0 and no shaping; with w_neg = 0, a
    conflict token of a negative completion at the token level. Not at the sequence level (gspo: the
    ratio spreads over the completion) nor with a KL term; masked: a token masked out in a live and in a
    dead completion (the plan reads each counted row's liveness at its token). Gradients equal the
    recompute schedule's."""
    h, w, ids, mask, adv = _long_batch(T=6)
    mask[:] = True
    if case == "zero_adv_masked":  # a token masked out in a dead completion and in a live one
        mask[0, 2] = mask[1, 3] = False
    ids[1, :4] = ids[0, :4]  # completions 0 (A > 0) and 1 (A < 0) share 4 tokens: conflict tokens
    ref, rows = None, 12
    if case.startswith("zero_adv"):  # split: tiles of 4 rows, a completion (6) spans two (token-local c)
        dead = [0, 2] if case == "zero_adv_masked" else [2, 3]  # (masked: dead, live, dead, live)
        adv = torch.tensor([0.0, 1.0, 0.0, -1.0] if case == "zero_adv_masked" else [1.0, -1.0, 0.0, 0.0])
        cfg, skipped, rows = GTPOConfig.preset("grpo"), int(mask[dead].sum()), 4 if case == "zero_adv_split" else 12
    elif case == "kl":
        adv = torch.tensor([1.0, -1.0, 0.0, 0.0])
        ref = -torch.rand(4, 6, generator=torch.Generator().manual_seed(2)) * 3
        cfg, skipped = GTPOConfig.preset("grpo", beta=0.1), 0
    else:  # split: grpo (token-local c) with conflict weights on top, tiles of 4 rows
        preset = {"conflict_token": "gtpo", "conflict_split": "grpo", "conflict_sequence": "gspo"}[case]
        cfg = GTPOConfig.preset(preset, entropy_threshold=None, use_conflict_mask=True, conflict_neg_weight=0.0)
        lam, _ = conflict_weights(ids, mask, adv, 2, config=cfg)
        skipped = int((lam == 0).sum()) if case != "conflict_sequence" else 0
        rows = 4 if case == "conflict_split" else 12
        assert int((lam[1] == 0).sum()) >= 4 and (lam[0] > 1).any()
    got = _both_schedules(monkeypatch, h, w, ids, adv, mask, cfg, backend, ref_logps=ref,
                          memory_budget=row_bytes(w.shape[0], w.dtype, "cpu") * rows)
    assert got["fused"][1].abs().sum() > 0
    assert_grad_close("grad hidden", got["fused"][0], got["recompute"][0], 1e-6)
    assert_grad_close("grad weight", got["fused"][1], got["recompute"][1], 1e-6)
    N = int(mask.sum())
    _, _, proj_f, grad_f = got["fused"]
    assert sum(proj_f) == N and sum(grad_f) == N - skipped, (proj_f, grad_f)
    if skipped:
        assert int((got["fused"][0] == 0).all(-1).sum()) == skipped + mask.numel() - N


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias_on", [False, True])
def test_fused_backward_twice_and_autograd_grad(backend, bias_on):
    """The fused schedule's backward runs twice (retain_graph) and under autograd.grad, with an upstream
    gradient of 3, and equals the recompute schedule's gradients."""
    h, w, ids, mask, adv = _long_batch(T=6, peaked=(0, 2))
    bias = torch.randn(w.shape[0], generator=torch.Generator().manual_seed(5)) if bias_on else None
    cfg = GTPOConfig.preset("gtpo", entropy_threshold=3.0)

    def run(schedule):
        params = [h.clone().requires_grad_(), w.clone().requires_grad_()] + \
            ([bias.clone().requires_grad_()] if bias_on else [])
        out = linear_gtpo_loss(params[0], params[1], ids, adv, mask, bias=params[2] if bias_on else None,
                               group_size=2, config=cfg, schedule=schedule, backend=backend)
        return params, out.loss * 3.0
    rp, rl = run("recompute")
    ref_grads = torch.autograd.grad(rl, rp)
    assert all(g.abs().sum() > 0 for g in ref_grads)
    fp, fl = run("fused")
    first = torch.autograd.grad(fl, fp, retain_graph=True)
    fl.backward(retain_graph=True)
    fl.backward()
    for name, a, b, r in zip(("hidden", "weight", "bias"), first, [p.grad for p in fp], ref_grads):
        assert_grad_close(f"grad {name}: fused vs recompute", a, r, 1e-5)
        assert_grad_close(f"grad {name}: two backwards", b, 2 * r, 1e-5)


@pytest.mark.parametrize("schedule", ["auto", "fused", "recompute"])
def test_compile_fullgraph_matches_eager(schedule):
    """torch.compile(fullgraph=True) of a step calling linear_gtpo_loss with its defaults (validate,
    memory_budget, the default GTPOConfig) traces without a graph break, both schedules and auto (the
    schedule the time model chooses, the same compiled and eager), same numbers."""
    torch._dynamo.reset()
    h, w, ids, mask, adv = _long_batch(T=6, peaked=(0, 1, 2))

    def step(h, w):
        out = linear_gtpo_loss(h, w, ids, adv, group_size=2, schedule=schedule)
        return out.loss, out.logps, out.entropy, out.metrics["grad_in_forward"]
    he, we = h.clone().requires_grad_(), w.clone().requires_grad_()
    le, lpe, ee, fe = step(he, we)
    le.backward()
    hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
    lc, lpc, ec, fc = torch.compile(step, fullgraph=True)(hc, wc)
    lc.backward()
    assert float(fe) == float(fc) == {"fused": 1.0, "recompute": 0.0}.get(schedule, float(fe))
    assert_value_close("loss", lc.detach(), le.detach(), 1e-6)
    assert_value_close("logps", lpc, lpe, 1e-6)
    assert_value_close("entropy", ec, ee, 1e-6)
    assert he.grad.abs().sum() > 0
    assert_grad_close("grad hidden", hc.grad, he.grad, 1e-6)
    assert_grad_close("grad weight", wc.grad, we.grad, 1e-6)
