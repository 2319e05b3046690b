"""torch.compile(fullgraph=True) with 0-d tensor hyper-parameters and forward-only calls (spec 8: every float
option may be a 0-d tensor, a graph input under torch.compile): the compiled call equals the eager one.
Before, (1) a `temperature=` keyword as a 0-d tensor, or any `temperature=` with a config holding a tensor
field, failed to trace (the config's checks read the tensors' values when the call put the temperature in
it); (2) eps_low / eps_high / delta as 0-d tensors failed on the torch backend (torch.clamp with tensor
bounds); (3) token_logprobs on logits that require grad failed on Triton (an op with no autograd formula)."""
import dataclasses

import pytest
import torch

from gtpo_kernels import GTPOConfig, gtpo_loss, token_logprobs


def _batch(seed=0, B=4, T=3, V=11):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T), generator=g),
            torch.tensor([1.0, -0.5, 0.7, -0.3]), -torch.rand(B, T, generator=g) - 0.5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", ["tau-tensor", "tau-number-beta-tensor", "eps-low-tensor", "eps-high-tensor",
                                  "delta-tensor"])
def test_tensor_hyper_parameters_trace_with_fullgraph(case, backend):
    x, ids, adv, old = _batch()
    cfg, kw = GTPOConfig.preset("dapo"), {}
    if case == "tau-tensor":
        kw["temperature"] = torch.tensor(0.7)
    elif case == "tau-number-beta-tensor":
        cfg, kw["temperature"] = GTPOConfig.preset("grpo", beta=torch.tensor(0.05)), 0.7
        kw["ref_logps"] = old + 0.2
    elif case == "eps-low-tensor":
        cfg = GTPOConfig.preset("grpo", eps_low=torch.tensor(0.1))
    elif case == "eps-high-tensor":
        cfg = GTPOConfig.preset("dapo", eps_high=torch.tensor(0.25))
    else:
        cfg = GTPOConfig.preset("grpo", delta=torch.tensor(1.3))

    def step(z):
        out = gtpo_loss(z, ids, adv, group_size=2, old_logps=old, config=cfg, backend=backend, **kw)
        return out.loss, out.logps

    _compiled_equals_eager(step, x)


def _compiled_equals_eager(step, x, *args):
    """step(x, *args) -> (loss, log-probs), eager and under torch.compile(fullgraph=True): the same loss,
    log-probs and gradient with respect to x (not all zero)."""
    torch._dynamo.reset()
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    (l1, p1), (l2, p2) = step(x1, *args), torch.compile(step, fullgraph=True, backend="aot_eager")(x2, *args)
    l1.backward()
    l2.backward()
    assert x1.grad.abs().sum() > 0
    torch.testing.assert_close(l2, l1, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(p2, p1, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_token_logprobs_on_logits_with_grad_trace_with_fullgraph(backend):
    x, ids, _, _ = _batch(1)
    x = x.requires_grad_()
    step = lambda z: token_logprobs(z, ids, torch.tensor(0.8), top_k=4, backend=backend)  # noqa: E731
    torch._dynamo.reset()
    (a, h), (b, k) = step(x), torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    assert not a.requires_grad and not b.requires_grad
    assert torch.equal(a, b) and torch.equal(h, k)


@pytest.mark.parametrize("change", [dict(loss_agg="token_mean"), dict(loss_agg="seq_mean_token_sum"),
                                    dict(policy_loss="verl_cispo")])
def test_replace_under_compile_normalises_as_eager(change):
    """GTPOConfig.replace while compiling builds the same config as eager: names normalised ('_' or '-'),
    so the compiled loss is the eager one (before, the raw name passed: a finite wrong loss)."""
    x, ids, adv, old = _batch(2)
    base = GTPOConfig.preset("grpo", eps_low=torch.tensor(0.15))

    def step(z):
        return gtpo_loss(z, ids, adv, old_logps=old, config=base.replace(**change), backend="torch").loss

    torch._dynamo.reset()
    eager, compiled = step(x), torch.compile(step, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)
    assert base.replace(**change) == GTPOConfig.preset("grpo", eps_low=base.eps_low, **change)
    assert set(vars(base.replace(**change))) == set(vars(base)) == {f.name for f in dataclasses.fields(base)}


@pytest.mark.parametrize("change", [dict(loss_agg="bogus"), dict(eps_low=1.5), dict(importance_sampling_level="seq"),
                                    dict(temperature=torch.tensor(2)), dict(no_such_field=1)])
def test_replace_under_compile_refuses_as_eager(change):
    """What eager refuses is refused while compiling too (a number out of range, an unknown name, a 0-d integer
    tensor), never traced into a loss; a 0-d floating tensor's value alone is not read there."""
    base = GTPOConfig.preset("grpo")
    with pytest.raises((ValueError, TypeError)):
        base.replace(**change)

    def step(z):
        return z.sum() * base.replace(**change).eps_high

    torch._dynamo.reset()
    with pytest.raises(Exception) as e:
        torch.compile(step, fullgraph=True, backend="aot_eager")(torch.randn(3))
    assert "GTPOConfig" in str(e.value) or "Observed exception" in str(e.value) or "repr" in str(e.value), e.value


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("rule", [dict(top_k=4), dict(top_p=0.7)])
@pytest.mark.parametrize("where", ["call", "config"])
def test_a_0d_temperature_with_rules_traces_with_fullgraph(where, rule, backend):
    """A 0-d tensor temperature (the call's or the config's schedule) with sets rebuilt by top_k / top_p, the
    batch's tensors graph inputs (a trainer's compiled step): the torch backend read its value on the host
    (float(tau)), which fullgraph cannot trace ('Could not guard on data-dependent expression'); traced it now
    stays a tensor. The compiled loss, log-probs and gradient equal the eager ones."""
    x, ids, adv, old = _batch(3)
    tau = torch.tensor(0.8)
    cfg = GTPOConfig.preset("dapo", temperature=tau) if where == "config" else "dapo"
    kw = dict(rule, **({} if where == "config" else dict(temperature=tau)))

    def step(z, ids, adv, old):
        out = gtpo_loss(z, ids, adv, group_size=2, old_logps=old, config=cfg, backend=backend, **kw)
        return out.loss, out.logps

    _compiled_equals_eager(step, x, ids, adv, old)


def test_a_preset_made_inside_a_compiled_step():
    """GTPOConfig.preset(...) inside torch.compile(fullgraph=True) traces (it read dataclasses.fields(cls),
    which dynamo refused: 'dataclass fields failure'), and gives eager's loss."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 8, generator=g)
    ids = torch.randint(0, 8, (4, 3), generator=g)
    adv = torch.tensor([1.0, -0.7, 0.4, -1.3])
    old = -torch.rand(4, 3, generator=g) - 1

    def step(z):
        return gtpo_loss(z, ids, adv, old_logps=old, config=GTPOConfig.preset("grpo", eps_high=0.28),
                         backend="torch").loss
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="eager")(x)
    assert torch.equal(got, step(x)) and got != 0
