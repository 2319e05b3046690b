"""The LM head over the sampler's kept sets (recorded, or rebuilt by top_k) computes its loss in the epilogue
kernel from the replayed log-probs (pipeline/logps_epilogue.py; about 110 launches fewer than the eager
surrogate): the same loss, outputs, metrics (in the same order) and gradients as the eager twin (the torch
backend) within spec 7's float32 tolerance, validating with no more host reads (on Triton the recorded sets
are checked on the device, one read)."""
import functools

import pytest
import torch

from bench.launches import counting
from conftest import assert_grad_close, assert_value_close
from gtpo_kernels import GTPOConfig, linear_gtpo_loss

TOL = 1e-5


@pytest.mark.parametrize("rule", ["recorded", "top_k"])
@pytest.mark.parametrize("preset", ["grpo", "geo-mean"])
def test_head_over_kept_sets_takes_the_epilogue(preset, rule):
    g = torch.Generator().manual_seed(1)
    B, T, D, V = 4, 5, 8, 40
    h, w = torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g) / 2
    ids = torch.randint(0, V, (B, T), generator=g)
    adv, mask = torch.randn(B, generator=g), torch.rand(B, T, generator=g) > 0.2
    z = h @ w.T
    sets = [sorted(set(z[mask][r].topk(5).indices.tolist()) | {int(ids[mask][r])}) for r in range(int(mask.sum()))]
    kept = (torch.tensor([v for s in sets for v in s]), torch.tensor([0] + [len(s) for s in sets]).cumsum(0))
    old = torch.log_softmax(z, -1).gather(-1, ids[..., None])[..., 0] + 0.1 * torch.randn(B, T, generator=g)
    cfg = GTPOConfig.preset(preset, beta=0.04)
    kw = dict(sampling_mask=kept) if rule == "recorded" else dict(top_k=5)
    res = {}
    for backend in ("triton", "torch"):
        x, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with counting() as n:
            out = linear_gtpo_loss(x, ww, ids, adv, mask, old_logps=old, ref_logps=old - 0.1, config=cfg,
                                   backend=backend, group_size=2, **kw)
            out.loss.backward()
        res[backend] = (out, x.grad, ww.grad, n)
    (o, gh, gw, n), (t, th, tw, nt) = res["triton"], res["torch"]
    assert n.triton_names.get("_epilogue_kernel") == 1 and n.triton_names.get("_prep_kernel") == 1, n.triton_names
    assert n.host_reads <= nt.host_reads, (dict(n.reads), dict(nt.reads))  # (triton: the sets checked on the device)
    assert list(o.metrics) == list(t.metrics) and tw.abs().sum() > 0
    assert_value_close("loss", o.loss.detach(), t.loss.detach(), TOL)
    for k in ("logps", "entropy", "per_token_loss"):
        assert_value_close(k, getattr(o, k), getattr(t, k), TOL)
    for k in o.metrics:
        assert_value_close(k, o.metrics[k], t.metrics[k], TOL)
    assert_grad_close("hidden grad", gh, th, TOL)
    assert_grad_close("weight grad", gw, tw, TOL)


@functools.lru_cache(maxsize=None)  # (the one-tile count serves both tests below)
def _head_sets_count(B, T, budget=1 << 20):
    """(launches, Triton launches by kernel, tensors from host data, host reads outside aten, union tiles) of
    linear_gtpo_loss over recorded kept sets (4 or 5 ids each), unvalidated on Triton, forward + backward."""
    from gtpo_kernels.pipeline import head_replay
    g = torch.Generator().manual_seed(B)
    D, V = 8, 40
    h, w = torch.randn(B, T, D, generator=g).requires_grad_(), torch.randn(V, D, generator=g).requires_grad_()
    ids = torch.randint(0, V, (B, T), generator=g)
    adv, mask = torch.randn(B, generator=g), torch.rand(B, T, generator=g) > 0.2
    z = (h @ w.T).detach()
    sets = [sorted(set(z[mask][r].topk(4).indices.tolist()) | {int(ids[mask][r])}) for r in range(int(mask.sum()))]
    kept = (torch.tensor([v for s in sets for v in s]), torch.tensor([0] + [len(s) for s in sets]).cumsum(0))
    call = lambda: linear_gtpo_loss(h, w, ids, adv, mask, config="grpo", group_size=2, sampling_mask=kept,  # noqa: E731
                                    validate=False, backend="triton", memory_budget=budget).loss.backward()
    call()
    tiles, plan = [], head_replay.plan_union
    head_replay.plan_union = lambda *a, **k: tiles.append(plan(*a, **k)) or tiles[-1]
    try:
        with counting() as n:
            call()
    finally:
        head_replay.plan_union = plan
    assert len(tiles) == 1  # planned once a call: the backward takes the forward's plan
    return (n.launches, dict(n.triton_names), n.creations, sorted(k for k in n.reads if not k.startswith("aten.")),
            len(tiles[0]))


def test_head_over_recorded_sets_unvalidated_launches_flat_in_tokens():
    """linear_gtpo_loss over recorded kept sets, unvalidated on Triton, one union tile: the sets checked on
    the device (two launches, kernels/set_check_triton.py), every tile's union formed at once, once a call
    (five launches, kernels/tile_union_triton.py: the backward takes the forward's tiles and unions), the
    same count at two batch sizes: at most 79 as counted (the mask read with the sets' offsets, the rows then
    listed by nonzero_static; 69 with nonzero, a host read of its own, counted as a launch, 68 before the
    counter counted it; 70 while the tiles' starts were copied to the device, where one kernel now cuts
    them, kernels/union_plan_triton.py; 71 before the rows of dL/dh of tokens with a NaN coefficient were
    set NaN, three small ops once a call; 74 before the replay metrics were made NaN by a flagged token,
    five small ops once a call; 79 before dL/dW and dL/db were made NaN everywhere by a NaN coefficient, three
    small ops once a call: at most 81 now; 75 with the plan and unions formed again in the
    backward, 78 with a sort and its host read per tile and pass; 165 with the checks' small ops), no tensor
    from host data (the tiles' starts were one), and no host read beyond the counted rows with the sets'
    offsets (one read: the tiles' plan; two before, the rows' nonzero and the offsets'), the unions' sizes
    (with the device's tile starts) and the backward's one read of the saved plan."""
    small, large = _head_sets_count(4, 3), _head_sets_count(6, 5)
    assert small == large, (small, large)
    assert small[4] == 1 and small[0] <= 81, small
    assert small[1]["_flat_offsets_kernel"] == 1 and small[1]["_set_problems_kernel"] == 1, small
    assert small[1]["_union_plan_kernel"] == 1 and small[1]["_keys_kernel"] == 1, small
    assert small[1]["_columns_kernel"] == 1 and small[2] == 0, small
    import inspect
    from gtpo_kernels.kernels import tile_union
    from gtpo_kernels.pipeline import head_replay
    where = []
    for mod, fn, line in ((head_replay, head_replay.counted_with_offsets, "flat]).tolist()"),
                          (tile_union, tile_union.tile_unions, "# sync: the unions' sizes"),
                          (tile_union, tile_union.Unions.from_saved, "host = plan.tolist()")):
        lines, first = inspect.getsourcelines(fn)
        name = mod.__name__.split("gtpo_kernels.")[1].replace(".", "/")
        where.append(f"{name}.py:{first + next(i for i, x in enumerate(lines) if line in x)}")
    assert small[3] == sorted(where), small


def test_head_over_recorded_sets_ten_launches_a_tile():
    """Spec 11's bound on the head: at most 10 launches per union tile (3 forward: W[U], the GEMM, the
    replay kernel; 7 backward: W[U], the GEMM, the gradient's zeros, the replay's gradient kernel, the two
    gradient GEMMs, the weight gradient's index_add), the rest once per call (the tiles' outputs joined:
    4 more from two tiles on); host reads and copies to the device the same however many tiles."""
    one, three, many = _head_sets_count(4, 3), _head_sets_count(4, 3, budget=700), _head_sets_count(4, 3, budget=400)
    assert one[4] == 1 and 1 < three[4] < many[4], (one[4], three[4], many[4])
    for k in (three, many):
        assert k[0] - one[0] <= 10 * (k[4] - 1) + 4, (one, k)
        assert k[2:4] == one[2:4], (one, k)
        assert k[1]["_replay_fwd_kernel"] == k[1]["_replay_bwd_kernel"] == k[4], k


def test_head_with_rules_rebuilds_its_sets_in_two_kernels_flat_in_tokens():
    """linear_gtpo_loss with top_k and top_p on Triton: each forward tile's sets as thresholds, then listed, in
    two launches (kernels/kept_set_triton.py, where the torch rebuild took some seventy small ops and three
    host reads more): at most 91 launches as counted (171 before), 5 host reads (6 while the backward planned
    its union tiles again), the same at two batch sizes (one tile each)."""
    def count(B, T, warm):
        g = torch.Generator().manual_seed(B)
        D, V = 8, 40
        h, w = torch.randn(B, T, D, generator=g).requires_grad_(), torch.randn(V, D, generator=g).requires_grad_()
        ids, adv = torch.randint(0, V, (B, T), generator=g), torch.randn(B, generator=g)
        call = lambda: linear_gtpo_loss(h, w, ids, adv, config="grpo", group_size=2, top_k=5, top_p=0.9,  # noqa: E731
                                        validate=False, backend="triton").loss.backward()
        if warm:
            call()
            h.grad = w.grad = None
        with counting() as n:
            call()
        return n.launches, dict(n.triton_names), n.host_reads

    small, large = count(4, 3, True), count(6, 5, False)  # (the second without a first call: the same counts)
    assert small == large, (small, large)
    # (86 before the counter counted nonzero as a launch, 87 before the union tiles' starts were cut on the
    # device instead of copied there, 88 before dL/dh's rows of NaN coefficients were set NaN, 91 before the
    # replay metrics were made NaN by a flagged token: five small ops once a call, flat in tiles; 96 before dL/dW
    # was made NaN everywhere by a NaN coefficient: two small ops once a call)
    assert small[0] <= 98 and small[2] <= 5, small
    assert small[1]["_kept_rule_kernel"] == 1 and small[1]["_kept_ids_kernel"] == 1, small
