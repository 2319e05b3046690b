"""The custom ops called eagerly (kernels/eager.py): outside torch.compile a call runs the ops' own bodies,
setup_context and backward directly, without torch.library's per-call Python, and gives bitwise the
values and gradients of the registered ops' path (forced here by making torch.compiler.is_compiling()
true, the path a compiled graph takes); under torch.compile the graph holds the registered op."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gtpo_kernels import GTPOConfig, gtpo_loss, gtpo_loss_from_logps, token_logprobs
from gtpo_kernels.kernels import ops


class CustomOps(TorchDispatchMode):
    """The package's custom ops that reach the dispatcher, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "gtpo_kernels":
            self.names.append(func._opname)
        return func(*args, **(kwargs or {}))


def _inputs(seed, B=4, T=5, V=29):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, V, generator=g) * 6  # peaked: the entropy filter keeps completions
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[:, 0] = True
    return dict(x=x, ids=ids, mask=mask, adv=torch.randn(B, generator=g),
                old=-torch.rand(B, T, generator=g) * 2 - 0.5, tau=torch.rand(B, T, generator=g) + 0.5)


def _loss(d, kind, validate):
    """(outputs, gradients) of one call of `kind` on d's inputs, forward + backward."""
    torch.manual_seed(0)  # (clip_cov draws its tokens at random)
    x = d["x"].clone().requires_grad_()
    if kind == "token_logprobs":
        return list(token_logprobs(d["x"], d["ids"], d["tau"], d["mask"], backend="triton", validate=validate)), []
    if kind == "from_logps":
        lp = (-torch.rand_like(d["old"]) - 0.2).requires_grad_()
        out = gtpo_loss_from_logps(lp, d["ids"], d["adv"], d["mask"], group_size=2, old_logps=d["old"],
                                   entropy=torch.rand_like(d["old"]), backend="triton", validate=validate)
        out.loss.backward()
        return [out.loss, out.logps], [lp.grad]
    kw = dict(config=kind) if kind in ("gtpo", "grpo", "clip_cov") else {}
    if kind == "replay":
        kw = dict(config="dapo", top_k=5, temperature=d["tau"])
    if kind == "conflicts":
        kw = dict(config=GTPOConfig.preset("gtpo"))
    out = gtpo_loss(x, d["ids"], d["adv"], d["mask"], group_size=2, old_logps=d["old"], backend="triton",
                    validate=validate, **kw)
    out.loss.backward()
    return [out.loss, out.logps, out.entropy], [x.grad]


KINDS = ["gtpo", "grpo", "clip_cov", "replay", "conflicts", "token_logprobs", "from_logps"]


@pytest.mark.parametrize("kind", KINDS)
def test_eager_calls_equal_the_registered_ops(kind, monkeypatch):
    """Bitwise the registered ops' values and gradients, and no custom op reaches the dispatcher eagerly
    (the registered path's call dispatches them)."""
    d = _inputs(3)
    with CustomOps() as mode:
        outs, grads = _loss(d, kind, validate=True)
    assert mode.names == [], mode.names
    assert all(torch.isfinite(t).all() for t in outs)
    assert all(g.abs().sum() > 0 for g in grads)  # (not all zero where compared)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # every call takes the registered op
    with CustomOps() as mode:
        ref_outs, ref_grads = _loss(d, kind, validate=True)
    assert mode.names, "the registered path dispatched no custom op"
    for a, b in zip(outs + grads, ref_outs + ref_grads):
        assert torch.equal(a, b), (kind, a, b)


def test_eager_call_arguments():
    """Keywords and defaults filled as the op fills them; a wrong keyword is refused naming it; a tensor
    subclass (here a meta tensor's fake) goes to the registered op."""
    d = _inputs(5)
    lg = d["x"].reshape(d["x"].shape[0], d["x"].shape[1], -1)
    t = torch.ones(1)
    a = ops.vocab_fwd(lg, d["ids"], d["mask"], t, 0, backend="triton")
    b = ops.vocab_fwd.op(lg, d["ids"], d["mask"], t, 0, 1.0, None, "triton")
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(TypeError, match="unexpected or missing arguments.*'bogus'"):
        ops.vocab_fwd(lg, d["ids"], d["mask"], t, 0, bogus=1)
    with pytest.raises(TypeError, match="unexpected or missing arguments"):
        ops.vocab_fwd(lg, d["ids"])
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as fake:
        out = ops.vocab_fwd(fake.from_tensor(lg), fake.from_tensor(d["ids"]), fake.from_tensor(d["mask"]),
                            fake.from_tensor(t), 0, backend="triton")
    assert [tuple(o.shape) for o in out] == [(20,), (20,), (20, 3), (20,)]


def test_eager_ops_without_gradient_record_no_history():
    """An op with no registered gradient runs below autograd eagerly too: its outputs carry no history
    even when its body computes with torch on an input that requires grad (the torch replay; the op's own
    outputs carry a node that refuses a backward)."""
    from gtpo_kernels.kernels import replay_ops
    d = _inputs(7)
    lg = d["x"].clone().requires_grad_()
    rows_t = torch.arange(5).repeat(4)
    rows_b = torch.arange(4).repeat_interleave(5)
    y = d["ids"].reshape(-1)
    sets = torch.stack([y, (y + 1) % lg.shape[-1], (y + 2) % lg.shape[-1]], 1).reshape(-1)
    offsets = torch.arange(0, 3 * 20 + 1, 3)
    out = replay_ops.replay_fwd(lg, rows_b, rows_t, y, torch.ones(1), sets, offsets, None, None, backend="torch")
    ref = replay_ops.replay_fwd.op(lg, rows_b, rows_t, y, torch.ones(1), sets, offsets, None, None, backend="torch")
    assert not any(o.requires_grad for o in out)
    assert all(torch.equal(a, b) for a, b in zip(out, ref)) and torch.isfinite(out[0]).all()


def test_bench_host_time_runs():
    """python -m bench.host_time's measurement: both paths timed for a call (positive times; the kernels'
    launches restored afterwards, so the next call computes)."""
    from bench import host_time
    from triton.runtime import interpreter as ti
    saved = ti.InterpretedFunction.run
    (name, eager, registered), = host_time.measure(calls=("token_logprobs",), reps=4, rounds=2)
    assert name == "token_logprobs" and min(eager + registered) > 0
    assert ti.InterpretedFunction.run is saved and not torch.compiler.is_compiling()


def test_second_order_and_meta_inputs_take_the_registered_ops():
    """A backward that builds a graph (create_graph=True) calls the registered ops, whose missing second-order
    formula then raises as it did before the eager calls (never a second-order term silently 0); meta inputs
    get the ops' fake shapes."""
    d = _inputs(9)
    x = d["x"].clone().requires_grad_()
    out = gtpo_loss(x, d["ids"], d["adv"], d["mask"], group_size=2, old_logps=d["old"], config="grpo",
                    backend="triton")
    g, = torch.autograd.grad(out.loss, x, create_graph=True)
    assert torch.isfinite(g).all() and g.abs().sum() > 0
    with pytest.raises(RuntimeError, match="no autograd formula"):
        (g ** 2).sum().backward()
    meta = [t.to("meta") for t in (d["x"], d["ids"], d["mask"], torch.ones(1))]
    outs = ops.vocab_fwd(*meta, 0, backend="triton")
    assert [tuple(o.shape) for o in outs] == [(20,), (20,), (20, 3), (20,)] and all(o.is_meta for o in outs)
