"""The head's `auto` schedule (spec 11) runs the faster of the two by the time model (FLOPs, bytes,
launches: pipeline.schedule.predict), on the accounting's cases (bench's head accounting: grpo, shaping over long completions, the
entropy filter at the median, bias and transforms, zero advantages), at a smaller V and D (the choice
depends on row counts only); and pipeline.schedule.schedule_cost, given the measured rows, ranks the
schedules as the measurement does."""
import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gtpo_kernels import linear_gtpo_loss
from gtpo_kernels.pipeline.head import row_bytes
from gtpo_kernels.pipeline.schedule import predict, schedule_cost

try:  # bench's head accounting: a package, or one module
    ha = importlib.import_module("bench.head_accounting.measure")
except ModuleNotFoundError:
    ha = importlib.import_module("bench.head_accounting")

GEMMS = {"mm": (0, 1), "addmm": (1, 2), "addmm_": (1, 2)}


class GemmFlops(TorchDispatchMode):
    """2 M N K of every mm / addmm a call runs, inside custom ops too."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace not in ("aten", "prims", "prim"):
            from torch._library import custom_ops
            body = getattr(custom_ops.OPDEFS.get(f"{func.namespace}::{func._opname}"), "_init_fn", None)
            if body is not None:
                with self:
                    return body(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in GEMMS:
            a, b = (args[i] for i in GEMMS[name])
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **kwargs)


def _run(case, schedule):
    """(GEMM FLOPs of forward + backward, whether the fused schedule ran), or (None, None) if refused."""
    mode = GemmFlops()
    try:
        with mode:
            out = linear_gtpo_loss(case.hidden, case.weight, case.ids, case.adv, case.mask, bias=case.bias,
                                   logit_scale=case.scale, logit_softcap=case.cap, memory_budget=case.budget,
                                   schedule=schedule, old_logps=case.old, config=case.cfg, lam=case.lam,
                                   n_conf=case.n_conf, validate=False, backend="torch")
            torch.autograd.grad(out.loss, case.wrt())
    except ValueError:
        return None, None
    return mode.flops, bool(out.metrics["grad_in_forward"])


@pytest.mark.parametrize("V,D", [(256, 16), (4096, 512)])
@pytest.mark.parametrize("name", list(ha.CASES))
def test_auto_runs_the_schedule_the_time_model_predicts_faster(name, V, D):
    """auto runs the schedule of pipeline.schedule.predict (a refused fused schedule: recompute), and
    the FLOPs each schedule runs are the model's (schedule_cost)."""
    case = ha.make_case(name, D=D, V=V)
    flops = {s: _run(case, s)[0] for s in ("fused", "recompute")}
    auto_flops, auto_fused = _run(case, "auto")
    per_tile = case.budget // row_bytes(V, case.weight.dtype, case.weight.device)
    model = predict(case.cfg, V, D, case.hidden[..., 0].numel(), per_tile, case.weight.element_size())
    faster = model.choice if flops["fused"] is not None else "recompute"
    print(f"{name}: GEMM FLOPs {flops}, predicted ms {model[:2]}, auto ran {'fused' if auto_fused else 'recompute'}")
    assert ("fused" if auto_fused else "recompute") == faster, f"{name}: auto did not run the faster {model}"
    assert auto_flops == flops[faster]
    modeled = schedule_cost(case.cfg, V, D, case.N, N_nz=case.N_nz, fused_ok=flops["fused"] is not None)
    if flops["fused"] is not None:  # the model's fused cost assumes no row known zero: an upper bound
        assert modeled.fused >= flops["fused"]
    assert modeled.recompute == flops["recompute"]


def test_vocab_split_schedule_needs_no_host_read():
    """Ranks of a vocabulary split choose the head's schedule without a host read (issue: a compiled rank
    cannot make one and assumed 'does not fit' while an eager rank read 'fits': different schedules,
    different all-reduces, a hang). Packed completions that do fit a tile, max_seqlen not validated:
    alone, the host read lets 'fused' run; as a rank of a split, 'fused' is refused the same way a compiled
    rank refuses it, and 'auto' runs recompute; a validated max_seqlen lets both run 'fused'."""
    from gtpo_kernels import GTPOConfig
    from gtpo_kernels.core.batch import prepare_tokens
    from gtpo_kernels.pipeline.head_ops import choose_schedule
    g = torch.Generator().manual_seed(7)
    lens = [5, 7, 3, 6]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    ids = torch.randint(0, 50, (int(cu[-1]),), generator=g)
    cfg = GTPOConfig(importance_sampling_level="sequence", entropy_threshold=None)  # a ratio per completion
    b = prepare_tokens(ids, advantages=torch.randn(len(lens), generator=g), cu_seqlens=cu, validate=False)
    assert choose_schedule(b, cfg, "fused", per_tile=8, host=False) is True
    with pytest.raises(ValueError, match="validated max_seqlen"):
        choose_schedule(b, cfg, "fused", per_tile=8, host=False, collective=True)
    assert choose_schedule(b, cfg, "auto", per_tile=8, host=False, collective=True) is False
    bv = prepare_tokens(ids, advantages=torch.randn(len(lens), generator=g), cu_seqlens=cu, max_seqlen=7,
                        validate=True)
    assert choose_schedule(bv, cfg, "fused", per_tile=8, host=True, collective=True) is True
    assert choose_schedule(bv, cfg, "fused", per_tile=8, host=True) is True


def test_docs_quote_the_time_model_and_the_accumulators():
    """docs/head.md's table of predicted head times and accumulator bytes is the model's (bench.head_accounting
    prints the same): every row recomputed here. The vocabulary-ordered backward moves less than half the
    accumulator bytes of tiles of whole rows at the GPU record's sizes."""
    import os
    from bench.head_accounting.model import BUDGETS, GPU_SIZES, accumulator_bytes, per_tile
    from gtpo_kernels import GTPOConfig
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "head.md")).read()
    cfg = GTPOConfig.preset("grpo")
    for N, D, V in GPU_SIZES:
        for budget in BUDGETS:
            rows = per_tile(V, 2, budget)
            m = predict(cfg, V, D, N, rows, 2)
            f, before, now = (x / 1e9 for x in accumulator_bytes(N, V, D, rows))
            assert now < before / 2, (N, D, budget, before, now)
            row = (f"| {N} x {D} x {V} | ", f" | {rows} | {m.fused:.1f} / {m.recompute:.1f} | {m.choice} | "
                   f"{f:.1f}; {before:.1f} -> {now:.1f} |")
            assert any(line.startswith(row[0]) and line.endswith(row[1]) for line in text.splitlines()), row
