"""torch.compile around a call on a process group (spec 12 with spec 6's compile): the ranks' agreement, a
collective and the host read of its row, cannot be traced, so a call with `process_group=` (or a Shard(-1)
DTensor) runs eagerly inside the compiled step. fullgraph=False: the compiled step equals the eager one,
loss, log-probs and this rank's gradient, on both backends (before: it failed under Triton's interpreter,
the agreement's Triton kernel traced with fake tensors). fullgraph=True: refused with a reason naming
process_group (before: an internal Dynamo error about a ContextVar). 2 gloo ranks, V = 37 split 20 / 17."""
import torch
import torch.distributed as dist

from gloo import run_ranks_ok

V, SPLIT = 37, 20


def _ranks(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from gtpo_kernels import gtpo_loss, token_logprobs
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 5, V, generator=g)
    ids = torch.randint(0, V, (4, 5), generator=g)
    adv, old = torch.tensor([1.0, -1.0, 0.5, -0.3]), -torch.rand(4, 5, generator=g) - 1.0
    lo, hi = (0, SPLIT) if rank == 0 else (SPLIT, V)
    pg, out = dist.group.WORLD, {}
    mesh = init_device_mesh("cpu", (world,))
    for backend in ("torch", "triton"):
        def step(z, dt=False):
            o = gtpo_loss(z, ids, adv, group_size=2, old_logps=old, config="dapo", backend=backend,
                          **({} if dt else {"process_group": pg}))
            return o.loss, o.logps, token_logprobs(z, ids, 0.8, backend=backend,
                                                   **({} if dt else {"process_group": pg}))[0]
        for what in ("group", "dtensor"):
            def run(fn):
                z = x[..., lo:hi].clone().requires_grad_()
                arg = DTensor.from_local(z, mesh, [Shard(-1)], run_check=False, shape=x.shape, stride=x.stride()) \
                    if what == "dtensor" else z
                loss, lp, tlp = fn(arg, what == "dtensor")
                loss.backward()
                return loss.detach(), lp.detach(), tlp, z.grad
            eager = run(step)
            torch._dynamo.reset()
            compiled = run(torch.compile(step, fullgraph=False, backend="aot_eager"))
            out[f"{backend} {what} equal"] = all(torch.equal(a, b) for a, b in zip(eager, compiled))
            out[f"{backend} {what} grad nonzero"] = bool(eager[3].abs().sum() > 0)
            torch._dynamo.reset()
            try:
                run(torch.compile(step, fullgraph=True, backend="aot_eager"))
                out[f"{backend} {what} fullgraph"] = "traced"
            except Exception as e:  # noqa: BLE001 - its message is checked
                out[f"{backend} {what} fullgraph"] = "process_group" in str(e) and "fullgraph=False" in str(e)
    return out


def test_compile_with_a_process_group_runs_the_call_eagerly():
    for r, res in enumerate(run_ranks_ok(_ranks, 2, watchdog=120)):
        assert res and all(v is True for v in res.values()), (r, res)
