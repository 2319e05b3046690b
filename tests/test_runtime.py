"""Runtime properties that trainers rely on: no recompilation as sizes change, grids that fit any token
count, no host round-trip with validate=False, long sequences, the conflict kernel."""
import ast
import contextlib
import inspect
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import gtpo_reference as ref
from batches import cases
from conftest import assert_grad_close, assert_value_close
from gtpo_kernels import GTPOConfig, conflict_weights, gtpo_loss
from gtpo_kernels.kernels import (check_triton, conflict_triton, digest_triton, dispatch, epilogue_triton,
                                  kept_rule_triton, tile_union_triton, vocab_triton, vp_first_triton, vp_merge_triton)

KERNELS = [vocab_triton._vocab_fwd_kernel, vocab_triton._vocab_bwd_kernel,
           conflict_triton._raw_conflicts_kernel, epilogue_triton._epilogue_kernel, kept_rule_triton._kept_rule_kernel,
           vp_merge_triton._vp_sums_kernel, vp_merge_triton._vp_finish_kernel,
           digest_triton._terms_kernel, digest_triton._row_kernel, check_triton._any_outside_kernel,
           tile_union_triton._keys_kernel, tile_union_triton._first_kernel, tile_union_triton._starts_kernel,
           tile_union_triton._columns_kernel, vp_first_triton._vp_first_kernel]
ALLOWED_CONSTEXPR = {"BLOCK_V", "HAS_E", "HAS_SCALE", "HAS_SOFTCAP", "BLOCK_G", "BLOCK_T", "BLOCK",  # block sizes,
                     "VOCAB_BLOCK",  # gtpo_kernels.VOCAB_BLOCK: fixed per process (spec 14), never per batch
                     "HAS_MASK", "TEMP_BY_VALUE", "NAN_FLAGGED", "HAS_G", "BLOCKS_OUT", "ROWS",  # switches
                     "PACKED", "HAS_OLD", "HAS_KL", "BIAS_KL", "HAS_LAM", "HAS_NCONF", "NITEMS", "CLIP", "HAS_DELTA",
                     "HAS_DUAL", "FILTER", "PENALTY", "SEQ", "AGG", "VALIDATE", "MASK_VALUES", "HAS_REF", "HAS_ROLL",
                     "POLICY", "RW", "OFF_POLICY", "HAS_STATUS", "CU_CHECK", "CU_NAN",  # policy term, weights,
                     # mask, status
                     "TEMP_PER_SEQ",  # a temperature per completion: a layout switch (its index), no size
                     "TARGET_Z",  # the merge's sums kernel reads the owner's target logit: a switch
                     "CONFLICT", "C_PACKED", "C_HAS_MASK",  # its programs for the conflict weights too: switches
                     "VP_MAX",  # the forward kernel stores the vocabulary-parallel merge's first input: a switch
                     "OUT_AT_ROW",  # the head's tile of a vocabulary slice: outputs at the tile's row, a switch
                     "VP",  # the epilogue finishes the vocabulary-parallel merge: a switch
                     "CHECKS",  # the agreement row's kernel checks values too: a switch
                     "HEAD",  # and writes the row's host values (their checksum by value): a switch
                     "TOP_ENT", "TOK_ADV",  # the top-entropy mask, advantages per token: switches
                     "PHASE",  # the epilogue's key launch (clip_cov, kl_cov) or the loss: a mode
                     "HP",  # which hyper-parameters are read by pointer (a config's, fixed across steps; no value)
                     "KEEP", "KEPT", "TOP_K", "TOP_P", "MIN_P", "STATS", "NAN_BAD",  # kept sets rebuilt by rules
                     "IS_FLOAT", "HAS_WHERE", "FP", "IDS", "ROW_MASK",  # the agreement's checksums, the host checks
                     "F0", "F1", "F2", "F3", "F4", "F5", "F6", "F7", "N_TERMS", "TOKENS"}  # (a row's: each term's kind, how many)
PER_BATCH_SIZES = {"T", "T_l", "logits_start", "n_t_blocks", "B", "N", "n",  # vary every step
                   "K", "M", "n_tiles", "steps"}  # (the head's union tiles: kept ids, tokens, tiles)


def _params(kernel):
    fn = getattr(kernel, "fn", kernel)
    return inspect.signature(fn).parameters, getattr(fn, "__annotations__", {})


def _declared_do_not_specialize(kernel):
    """The names in the kernel's `@triton.jit(do_not_specialize=[...])`, read from its module's source
    (the interpreter's function object and the JIT object differ in where, or whether, they keep it)."""
    fn = getattr(kernel, "fn", kernel)
    tree = ast.parse(inspect.getsource(sys.modules[fn.__module__]))
    defs = [d for d in ast.walk(tree) if isinstance(d, ast.FunctionDef) and d.name == fn.__name__]
    assert len(defs) == 1, f"{fn.__name__}: {len(defs)} definitions in {fn.__module__}"
    names = []
    for dec in defs[0].decorator_list:
        if isinstance(dec, ast.Call) and ast.unparse(dec.func) in ("triton.jit", "jit"):
            names += [n for kw in dec.keywords if kw.arg == "do_not_specialize"
                      for n in ast.literal_eval(kw.value)]
    return names


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: getattr(k, "__name__", str(k)))
def test_no_per_batch_size_is_constexpr(kernel):
    params, ann = _params(kernel)
    constexpr = {n for n, p in params.items() if "constexpr" in str(p.annotation) or "constexpr" in str(ann.get(n))}
    assert constexpr <= ALLOWED_CONSTEXPR, constexpr
    sizes = PER_BATCH_SIZES & set(params)
    assert sizes, "kernel has no runtime size at all?"
    # an int argument is specialized (== 1, divisible by 16) unless listed: T would recompile every step
    declared = _declared_do_not_specialize(kernel)
    assert all(isinstance(n, str) and n in params for n in declared), (declared, list(params))
    assert sizes <= set(declared), f"per-batch sizes not in do_not_specialize: {sorted(sizes - set(declared))}"
    # and the object Triton built records the same list (interpreter: kwargs; JIT: indices or names)
    live = getattr(kernel, "kwargs", {}).get("do_not_specialize", getattr(kernel, "do_not_specialize", None))
    if live is not None:
        live = {list(params)[n] if isinstance(n, int) else n for n in live}
        assert live == set(declared), (live, declared)


class _Recorder:
    def __init__(self, launches):
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *a, **k: self.launches.append((tuple(grid), k))


def test_grids_fit_any_token_count(monkeypatch):
    """100,000-token sequences: every launch is a 1-D grid over all the work (tokens, logits rows, or
    (group, block of positions) pairs), below 2**31, so the 65,535 limit of dimensions 2 and 3 never applies."""
    launches = []
    for name in ("_vocab_fwd_kernel", "_vocab_bwd_kernel"):
        monkeypatch.setattr(vocab_triton, name, _Recorder(launches))
    monkeypatch.setattr(conflict_triton, "_raw_conflicts_kernel", _Recorder(launches))
    B, T, V, start = 2, 100_000, 16, 1
    T_l = start + T + 1
    logits = torch.empty(B, T_l, V)
    ids = torch.zeros(B * T, dtype=torch.long)
    f = torch.zeros(B * T)
    vocab_triton.vocab_fwd(logits, ids, torch.ones(B * T, dtype=torch.bool), 1.0, start)
    vocab_triton.vocab_bwd(logits, logits, ids, torch.zeros(B * T, 3), f, f, None, 1.0, start)
    G, n_groups = 8, 3
    conflict_triton.raw_conflicts(torch.zeros(G * n_groups, T, dtype=torch.long),
                                  torch.ones(G * n_groups, T, dtype=torch.bool),
                                  torch.ones(G * n_groups, dtype=torch.bool),
                                  torch.zeros(G * n_groups, dtype=torch.bool), G)
    assert len(launches) == 3, launches
    grids = [g for g, _ in launches]
    for g in grids:
        assert 1 <= len(g) <= 3 and 0 < g[0] < 2**31 and all(0 < d <= 65535 for d in g[1:]), g
    assert grids[0] == (B * T,)  # one program per token
    assert grids[1] == (B * T_l,)  # one program per logits row (rows outside the window are zeroed)
    bt = launches[2][1]["BLOCK_T"]
    assert grids[2] == (n_groups * -(-T // bt),), (grids[2], bt)  # (group, block of positions) pairs


@contextlib.contextmanager
def no_host_sync(monkeypatch):
    """Raise on every device-to-host read (item, tolist, cpu, bool/int/float of a tensor) outside the
    kernels themselves (the interpreter reads its arguments on the host; a GPU launch does not)."""
    names = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__")
    real = {n: getattr(torch.Tensor, n) for n in names}
    state = {"on": True}

    def guard(n):
        def f(self, *a, **k):
            if state["on"]:
                raise AssertionError(f"host sync: Tensor.{n} reached with validate=False")
            return real[n](self, *a, **k)
        return f

    def suspended(fn):
        def g(*a, **k):
            state["on"] = False
            try:
                return fn(*a, **k)
            finally:
                state["on"] = True
        return g
    for n in names:
        monkeypatch.setattr(torch.Tensor, n, guard(n))
    monkeypatch.setattr(dispatch, "vocab_fwd", suspended(dispatch.vocab_fwd))
    monkeypatch.setattr(dispatch, "vocab_bwd", suspended(dispatch.vocab_bwd))
    monkeypatch.setattr(conflict_triton, "raw_conflicts", suspended(conflict_triton.raw_conflicts))
    try:
        yield
    finally:
        for n in names:
            monkeypatch.setattr(torch.Tensor, n, real[n])


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean", "gtpo-official", "seq-mean-token-sum-norm"])
def test_no_host_sync_with_validate_false(monkeypatch, packed, agg):
    B, T, V = 4, 6, 20
    x = torch.randn(B, T, V, requires_grad=True)
    ids = torch.randint(0, V, (B, T))
    adv = torch.randn(B)
    kw = dict(group_size=2, backend="triton", validate=False, config=GTPOConfig(loss_agg=agg, entropy_coef=0.01),
              old_logps=torch.randn(B, T))
    if packed:
        x = torch.randn(B * T, V, requires_grad=True)
        ids, kw["old_logps"] = ids.reshape(-1), kw["old_logps"].reshape(-1)
        kw.update(cu_seqlens=torch.arange(0, B * T + 1, T), max_seqlen=T)
    with no_host_sync(monkeypatch):
        out = gtpo_loss(x, ids, adv, **kw)
        out.loss.backward()
    assert torch.isfinite(x.grad).all()


def test_seventy_thousand_token_sequence_matches_reference():
    T, V = 70_000, 8
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, T, V, generator=g)
    ids = torch.randint(0, V, (2, T), generator=g)
    ids[1, :50] = ids[0, :50]
    adv = torch.tensor([1.0, -1.0])
    cfg = GTPOConfig(entropy_threshold=None)
    xx = x.clone().requires_grad_()
    out = gtpo_loss(xx, ids, adv, group_size=2, config=cfg, backend="torch")
    out.loss.backward()
    xr = x.double().requires_grad_()
    r = ref.gtpo_loss(xr, ids, adv, group_size=2, entropy_threshold=None)
    r["loss"].backward()
    assert_value_close("loss", out.loss.detach(), r["loss"].detach(), 1e-5)
    assert_value_close("logps", out.logps, r["logps"], 1e-5)
    assert torch.equal(out.lam.double(), r["lam"])
    assert_grad_close("grad", xx.grad, xr.grad, 1e-5)


@given(case=cases(max_T=8), w=st.sampled_from([(2.0, 0.0), (1.5, 0.5)]), block_t=st.sampled_from([None, 16]))
def test_conflict_kernel_matches_reference(case, w, block_t):
    cfg = GTPOConfig(conflict_pos_weight=w[0], conflict_neg_weight=w[1])
    lam, n_conf = conflict_weights(case.ids, case.mask, case.adv, case.G, config=cfg, backend="triton")
    rlam, rn = ref.conflict_weights(case.ids, case.mask, case.adv, case.G, *w)
    assert torch.equal(lam.double(), rlam) and torch.equal(n_conf.double(), rn)
    # several position blocks per group
    ids = case.ids.long()
    m = case.counted
    pos, neg = case.adv > 0, case.adv < 0
    from gtpo_kernels.kernels.conflict_torch import raw_conflicts as torch_raw_conflicts
    assert torch.equal(conflict_triton.raw_conflicts(ids, m, pos, neg, case.G, block_t=block_t),
                       torch_raw_conflicts(ids, m, pos, neg, case.G))


def test_conflict_kernel_block_does_not_follow_the_length(monkeypatch):
    seen = []

    class Rec:
        def __getitem__(self, grid):
            return lambda *a, **k: seen.append(k["BLOCK_T"])
    monkeypatch.setattr(conflict_triton, "_raw_conflicts_kernel", Rec())
    for T in (5, 20, 100, 3000):
        conflict_triton.raw_conflicts(torch.zeros(8, T, dtype=torch.long), torch.ones(8, T, dtype=torch.bool),
                                      torch.ones(8, dtype=torch.bool), torch.zeros(8, dtype=torch.bool), 8)
    assert len(set(seen)) == 1, seen


def _tensor_config(**values):
    """A GTPOConfig whose floats are 0-d float64 CPU tensors (a schedule a trainer updates in place)."""
    return GTPOConfig(**{k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()})


HYPER = dict(temperature=0.7, eps_low=0.2, eps_high=0.28, beta=0.04, entropy_coef=0.01, entropy_threshold=2.5,
             entropy_penalty=0.1, conflict_pos_weight=1.5, conflict_neg_weight=0.25, initial_entropy=0.5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tensor_hyper_parameters_equal_floats(backend):
    g = torch.Generator().manual_seed(3)
    B, T, V = 4, 6, 32
    x = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[1, :3] = ids[0, :3]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    old = torch.randn(B, T, generator=g) * 0.3 - 3.5
    refl = torch.randn(B, T, generator=g) * 0.3 - 3.5
    outs = []
    for cfg in (GTPOConfig(**HYPER), _tensor_config(**HYPER)):
        xx = x.clone().requires_grad_()
        out = gtpo_loss(xx, ids, adv, group_size=2, old_logps=old, ref_logps=refl, config=cfg, backend=backend)
        out.loss.backward()
        outs.append((out, xx.grad))
    (a, ga), (b, gb) = outs
    assert_value_close("loss", b.loss.detach(), a.loss.detach(), 1e-6)
    for k in ("logps", "entropy", "per_token_loss", "lam"):
        assert_value_close(k, getattr(b, k), getattr(a, k), 1e-6)
    assert b.loss.dtype == torch.float32 and b.lam.dtype == torch.float32
    assert_grad_close("grad", gb, ga, 1e-6)


def test_tensor_hyper_parameters_do_not_recompile():
    """Under torch.compile a tensor hyper-parameter is a graph input: new values, one compile."""
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(4)
    B, T, V = 4, 5, 16
    x = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    old = torch.randn(B, T, generator=g) * 0.3 - 2.8
    refl = torch.randn(B, T, generator=g) * 0.3 - 2.8
    cfg = _tensor_config(**HYPER)

    def step(x):
        return gtpo_loss(x, ids, adv, group_size=2, old_logps=old, ref_logps=refl, config=cfg,
                         validate=False, backend="torch").loss

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    counts = []
    for beta, eps, temp in ((0.04, 0.2, 0.7), (0.1, 0.1, 1.0), (0.0, 0.3, 1.3)):
        cfg.beta.fill_(beta)
        cfg.eps_high.fill_(eps)
        cfg.temperature.fill_(temp)
        xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
        lc, le = compiled(xc), step(xe)
        lc.backward()
        le.backward()
        assert_value_close("loss", lc.detach(), le.detach(), 1e-6)
        assert_grad_close("grad", xc.grad, xe.grad, 1e-6)
        counts.append(counter.frame_count)
    assert counts[0] > 0 and counts == [counts[0]] * 3, f"graphs compiled after each call: {counts}"


def test_temperature_reaches_the_triton_kernels_as_a_tensor(monkeypatch):
    """The kernels read tau from memory: a tensor schedule is never read on the host, and a change made
    in place is what the next launch (or a replayed CUDA graph) uses."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 4, 40, generator=g)
    ids = torch.randint(0, 40, (8,), generator=g)
    counted = torch.ones(8, dtype=torch.bool)
    tau = torch.tensor(0.7, dtype=torch.float32)
    for name in ("__float__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, **k: (_ for _ in ()).throw(
            AssertionError(f"host read: Tensor.{_n}")), raising=True)
    lp_t, ent_t, st_t, _ = vocab_triton.vocab_fwd(x, ids, counted, tau, 0)
    tau.fill_(1.3)  # the schedule moves, in place
    lp_u, _, st_u, _ = vocab_triton.vocab_fwd(x, ids, counted, tau, 0)
    c = torch.rand(8, generator=g)
    grad = torch.empty_like(x)
    vocab_triton.vocab_bwd(x, grad, ids, st_u, ent_t, c, None, tau, 0)
    monkeypatch.undo()
    for lp, t in ((lp_t, 0.7), (lp_u, 1.3)):
        ref_lp = torch.log_softmax(x.double() / t, -1).reshape(8, 40).gather(1, ids[:, None])[:, 0]
        assert_value_close(f"logp at tau={t}", lp, ref_lp, 1e-5)
    assert (lp_t - lp_u).abs().max() > 1e-2
    lp_f, _, _, _ = vocab_triton.vocab_fwd(x, ids, counted, 1.3, 0)
    assert torch.equal(lp_f, lp_u)
