"""The head's `auto` schedule (spec 11) picks the cheaper of the two by the head accounting's own measure,
GEMM FLOPs, on the accounting's cases (bench's head accounting: grpo, shaping over long completions, the
entropy filter at the median, bias and transforms, zero advantages), at a smaller V and D (the choice
depends on row counts only); and pipeline.schedule.schedule_cost, given the measured rows, ranks the
schedules as the measurement does."""
import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gtpo_kernels import linear_gtpo_loss
from gtpo_kernels.pipeline.schedule import schedule_cost

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


@pytest.mark.parametrize("name", list(ha.CASES))
def test_auto_runs_the_cheaper_schedule(name):
    case = ha.make_case(name, D=16, V=256)
    flops = {s: _run(case, s)[0] for s in ("fused", "recompute")}
    auto_flops, auto_fused = _run(case, "auto")
    cheaper = min((f, s) for s, f in flops.items() if f is not None)[1]
    print(f"{name}: GEMM FLOPs {flops}, auto ran {'fused' if auto_fused else 'recompute'}")
    assert ("fused" if auto_fused else "recompute") == cheaper, f"{name}: auto did not run the cheaper {flops}"
    assert auto_flops == flops[cheaper]
    V, D = case.weight.shape
    modeled = schedule_cost(case.cfg, V, D, case.N, N_nz=case.N_nz, fused_ok=flops["fused"] is not None)
    if flops["fused"] is not None:  # the model's fused cost assumes no row known zero: an upper bound
        assert modeled.fused >= flops["fused"]
    assert modeled.recompute == flops["recompute"]
