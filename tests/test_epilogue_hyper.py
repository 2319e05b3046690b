"""Hyper-parameters given as 0-d tensors (a schedule the trainer updates in place) on the epilogue kernel's
path (pipeline/epilogue.py hyper, the kernel's HP code): the kernel reads them by pointer, in the form the
eager path uses (1 - eps_low, 1 + eps_high, 1 - top_entropy_quantile), so a call with tensors is bitwise the
call with the same values as numbers (float32 or float64 tensors, mixed), within spec 7's float32 tolerance
of the eager twin (the torch backend with the same tensors), in at most one launch more (a cat, for two
tensors or more), and a value changed in place reaches the next call on every entry point. The entropy
filter's threshold and initial entropy as tensors: the paper's gate is the eager comparison itself, one
launch, read by the kernel."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.launches import counting
from conftest import assert_grad_close, assert_value_close, examples
from gtpo_kernels import GTPOConfig, gtpo_loss, gtpo_loss_from_logps, linear_gtpo_loss
from gtpo_kernels.pipeline import epilogue
from test_epilogue import FAST, OTHER, _inputs, calls

TOL = 1e-5
# the config fields the kernel reads by pointer when they are tensors, by the policy terms that read them
_FIELDS = ("delta", "dual_clip_c", "beta", "entropy_coef", "entropy_penalty", "off_policy_mask_threshold",
           "top_entropy_quantile", "entropy_threshold")
_TERM = {"ppo": ("eps_low", "eps_high"), "verl-cispo": ("eps_low", "eps_high"), "cispo": ("eps_high",),
         "dppo-tv": ("eps_low", "eps_high"), "dppo-kl": ("eps_low", "eps_high"),
         "sapo": ("sapo_temperature_pos", "sapo_temperature_neg"), "dro": ("dro_beta",), "gpg": (),
         "geo-mean": ("eps_low", "eps_high"), "vespo": ()}


def _as_tensors(cfg, fields, dtypes):
    """(the config with `fields` as 0-d tensors of `dtypes`, the same config with their values as numbers)."""
    t = {f: torch.tensor(getattr(cfg, f), dtype=dt) for f, dt in zip(fields, dtypes)}
    return cfg.replace(**t), cfg.replace(**{f: float(v) for f, v in t.items()})


def _call(c, cfg, backend, count=False):
    logits, ids, mask, adv, old, ref, _tau = _inputs(c)
    x = logits.clone().requires_grad_()
    kw = dict(old_logps=old if c["old"] else None, ref_logps=ref, config=cfg, backend=backend, validate=False,
              group_size=c["G"])
    if c["packed"]:
        lengths = mask.sum(1)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        keep = mask.reshape(-1)
        flat = lambda v: None if v is None else v.reshape(-1)[keep]  # noqa: E731
        kw.update(old_logps=flat(kw["old_logps"]), ref_logps=flat(ref))
        x = logits.reshape(-1, logits.shape[-1])[keep].requires_grad_()  # a leaf: its index is not counted
        ids_p = ids.reshape(-1)[keep]
        call = lambda: gtpo_loss(x, ids_p, adv, cu_seqlens=cu, **kw)  # noqa: E731
    else:
        call = lambda: gtpo_loss(x, ids, adv, mask, **kw)  # noqa: E731
    with counting() as n:
        out = call()
        out.loss.sum().backward()
    return out, x.grad, (n.launches, n.host_reads, dict(n.triton_names), dict(n.reads)) if count else None


def _equal(a, b, what):
    assert a.shape == b.shape and torch.equal(torch.isnan(a), torch.isnan(b)), what
    assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)), (what, (a - b).abs().max())


@settings(max_examples=examples(9), deadline=None)
@given(c=calls(FAST + OTHER), data=st.data())
def test_tensor_hyper_parameters_are_bitwise_the_numbers(c, data):
    cfg = c["cfg"]
    if c["off"]:
        cfg = cfg.replace(off_policy_mask_threshold=0.05)
    cfg = cfg.replace(top_entropy_quantile=c["top"])
    fields = [f for f in _TERM[cfg.policy_loss] + _FIELDS if getattr(cfg, f) is not None]
    chosen = data.draw(st.lists(st.sampled_from(fields), min_size=1, max_size=len(fields), unique=True))
    dtypes = data.draw(st.lists(st.sampled_from([torch.float32, torch.float64]), min_size=len(chosen),
                                max_size=len(chosen)))
    cfg_t, cfg_n = _as_tensors(cfg, chosen, dtypes)
    assert epilogue.covers(cfg_t)
    on, g_n, n_n = _call(c, cfg_n, "triton", count=True)
    ot, g_t, n_t = _call(c, cfg_t, "triton", count=True)
    for k in ("loss", "logps", "entropy", "per_token_loss", "lam", "seq_entropy"):
        _equal(getattr(ot, k).detach(), getattr(on, k).detach(), k)
    for k in on.metrics:
        _equal(ot.metrics[k], on.metrics[k], k)
    _equal(g_t, g_n, "grad")
    # the same path (the epilogue), no host read, at most one launch more; a tensor quantile or beta is never
    # assumed 1 or 0 (the mask's two launches, the KL term on)
    assert n_t[2].get("_epilogue_kernel") == 1 and n_t[1] == 0, n_t
    top_on = "top_entropy_quantile" in chosen and c["top"] == 1.0
    assert n_t[0] == n_n[0] + (len(chosen) > 1) + 2 * top_on, (n_t, n_n, chosen)
    # the eager twin with the same tensors (a tensor beta of 0 makes the KL term 0 there too)
    oe, g_e, _ = _call(c, cfg_t, "torch")
    assert_value_close("loss", ot.loss.detach(), oe.loss.detach(), TOL)
    assert_grad_close("grad", g_t, g_e, TOL)


def _schedule_cfg():
    return GTPOConfig.preset("grpo", beta=torch.tensor(0.04), eps_high=torch.tensor(0.28, dtype=torch.float64),
                             entropy_coef=torch.tensor(0.01), top_entropy_quantile=torch.tensor(0.5))


def _numbers(cfg):
    return cfg.replace(**{f: float(getattr(cfg, f)) for f in ("beta", "eps_high", "entropy_coef",
                                                              "top_entropy_quantile")})


def _entry_points():
    g = torch.Generator().manual_seed(11)
    B, T, V, D = 4, 5, 24, 8
    logits = torch.randn(B, T, V, generator=g) * 3
    ids = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    lp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    old, ref = lp + 0.1 * torch.randn(B, T, generator=g), lp + 0.2 * torch.randn(B, T, generator=g)
    ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    h, w = torch.randn(B, T, D, generator=g), torch.randn(V, D, generator=g) / 2
    sets = [sorted(set(logits[mask][r].topk(5).indices.tolist()) | {int(ids[mask][r])}) for r in range(int(mask.sum()))]
    kept = (torch.tensor([v for s in sets for v in s]), torch.tensor([0] + [len(s) for s in sets]).cumsum(0))
    kw = dict(old_logps=old, ref_logps=ref, backend="triton", validate=False)

    def logits_call(cfg):
        x = logits.clone().requires_grad_()
        return gtpo_loss(x, ids, adv, mask, config=cfg, **kw), x

    def logps_call(cfg):
        x = lp.clone().requires_grad_()
        return gtpo_loss_from_logps(x, ids, adv, mask, entropy=ent, config=cfg, **kw), x

    def head_call(cfg):
        x = h.clone().requires_grad_()
        return linear_gtpo_loss(x, w, ids, adv, mask, config=cfg, schedule="recompute", **kw), x

    def sets_call(cfg):
        x = logits.clone().requires_grad_()
        return gtpo_loss(x, ids, adv, mask, config=cfg, sampling_mask=kept, **kw), x
    return dict(logits=logits_call, logps=logps_call, head=head_call, sets=sets_call)


@pytest.mark.parametrize("entry", ["logits", "logps", "head", "sets"])
def test_a_schedule_changed_in_place_reaches_the_next_call(entry):
    """The tensors are read by pointer at each launch: values filled in place between two calls give each
    call the numbers' result, bitwise, on every entry point that runs the epilogue kernel (the loss on logits,
    on log-probs, the LM head, recorded kept sets)."""
    call = _entry_points()[entry]
    cfg = _schedule_cfg()
    for beta, eps, coef, q in ((0.04, 0.28, 0.01, 0.5), (0.3, 0.05, 0.2, 0.25)):
        cfg.beta.fill_(beta), cfg.eps_high.fill_(eps), cfg.entropy_coef.fill_(coef)
        cfg.top_entropy_quantile.fill_(q)
        counts = []
        for c in (cfg, _numbers(cfg)):
            with counting() as n:
                out, x = call(c)
                out.loss.backward()
            counts.append((n.launches, n.host_reads, n.creations, dict(n.triton_names)))
        (out_t, x_t), (out_n, x_n) = call(cfg), call(_numbers(cfg))
        out_t.loss.backward(), out_n.loss.backward()
        # the epilogue on both; one launch more (the four tensors' cat), the same host reads (none but the
        # LM head's planner's), no tensor from host data
        assert counts[0][3].get("_epilogue_kernel") == 1 and counts[0][3] == counts[1][3], counts
        assert counts[0][0] == counts[1][0] + 1 and counts[0][1:3] == counts[1][1:3], counts
        assert counts[0][1] == (0 if entry != "head" else counts[0][1]) and counts[0][2] == 0, counts
        assert torch.isfinite(out_n.loss) and x_n.grad.abs().sum() > 0
        _equal(out_t.loss.detach(), out_n.loss.detach(), "loss")
        _equal(out_t.per_token_loss, out_n.per_token_loss, "per_token_loss")
        _equal(x_t.grad, x_n.grad, "grad")


def test_host_tensors_with_device_inputs_go_by_value():
    """A CPU tensor with inputs on another device is read on the host (no device sync), in the eager form;
    a half-precision one keeps the eager path (covers)."""
    cfg = GTPOConfig.preset("grpo", beta=torch.tensor(0.04), eps_low=torch.tensor(0.2, dtype=torch.float64),
                            top_entropy_quantile=torch.tensor(0.3))
    meta = torch.empty(0, device="meta")
    values, code = epilogue._slot_values(cfg, meta)
    assert epilogue.hyper(cfg, meta) is None and code == 0
    slot = dict(zip(epilogue.HP_SLOTS, values))
    assert slot["lo"] == 1.0 - 0.2 and slot["beta"] == float(torch.tensor(0.04))
    assert slot["top_q"] == float(1.0 - torch.tensor(0.3)) and slot["hi"] == 1.0 + cfg.eps_high
    values, code = epilogue._slot_values(cfg, torch.empty(0))  # on the device: by pointer, in HP_SLOTS' order
    assert values[0] == values[4] == values[11] == 0.0
    assert code == epilogue.PPO_BOUNDS | 1 | 2 << 16 | 3 << 44
    assert epilogue._slot_values(cfg.replace(beta=0.04, eps_low=0.2, top_entropy_quantile=0.3), torch.empty(0))[1] == 0
    assert not epilogue.covers(cfg.replace(beta=torch.tensor(0.04, dtype=torch.bfloat16)))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_zero_beta_tensor_is_no_kl_term(backend, bias):
    """A KL schedule at 0 (a tensor beta of 0, never assumed 0 on the host, so the term is formed) adds
    nothing, as the number 0, where the KL itself overflows float32 (ref - logp = 95): a finite loss and
    gradient equal to the number's, and to the float64 reference's."""
    lp = torch.tensor([[-0.5, -95.0, -1.0], [-0.2, -0.3, -2.0]])
    ref = torch.tensor([[-0.4, -0.01, -1.1], [-0.25, -0.3, -1.9]])
    ids, adv = torch.zeros(2, 3, dtype=torch.long), torch.tensor([1.0, -1.0])
    old = lp - 0.05
    outs = []
    for beta, be in ((torch.tensor(0.0), backend), (0.0, backend), (0.0, "reference")):
        x = (lp.double() if be == "reference" else lp).clone().requires_grad_()
        cfg = GTPOConfig.preset("grpo", beta=beta, use_bias_correction_kl=bias)
        out = gtpo_loss_from_logps(x, ids, adv, ref_logps=ref, old_logps=old, config=cfg, backend=be)
        out.loss.backward()
        outs.append((out.loss.detach(), x.grad))
    assert torch.isfinite(outs[0][0]) and torch.isfinite(outs[0][1]).all() and outs[2][1].abs().sum() > 0
    assert_value_close("loss", outs[0][0], outs[1][0], TOL)
    assert_grad_close("grad", outs[0][1], outs[1][1], TOL)
    assert_grad_close("grad vs reference", outs[0][1], outs[2][1], TOL)


# (entropy_threshold, initial_entropy): a number or a tensor of that dtype; "above": initial_entropy above the
# threshold (the gate turns the filter off; "equal": not above, the filter on). A tensor threshold alone: the drawn test above (_FIELDS)
_GATES = [("number", torch.float64, "above"), ("number", torch.float32, "below"),
          (torch.float64, torch.float32, "above"), (torch.float32, torch.float64, "below"),
          (torch.float32, "number", "below"), (torch.float32, torch.float32, "equal")]
_NAME = {"number": "number", torch.float32: "f32", torch.float64: "f64"}


_GATE_CASES = [pytest.param(*g, id=f"{_NAME[g[0]]}-{_NAME[g[1]]}-{g[2]}") for g in _GATES]


@pytest.mark.parametrize("thr_kind,init_kind,side", _GATE_CASES)
def test_the_entropy_filter_numbers_as_tensors(thr_kind, init_kind, side):
    """entropy_threshold and initial_entropy as 0-d tensors (initial_entropy measured on the device, no
    .item()) take the epilogue: bitwise the numbers' call, no host read, one launch more for the gate
    (initial_entropy > entropy_threshold, formed as the eager path forms it) and one for the cat of two
    tensors; the filter drops completions below the gate and none above it; the eager twin agrees."""
    c = dict(B=6, T=5, V=16, G=2, seed=5, packed=False, old=True)
    logits = _inputs(c)[0]
    mask = _inputs(c)[2]
    H = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    hbar = ((H * mask).sum(1) / mask.sum(1)).sort().values
    thr = float(hbar[2] + hbar[3]) / 2  # between two completions' mean entropies
    init = None if side is None else thr + {"above": 0.5, "below": -0.5, "equal": 0.0}[side]
    as_kind = lambda v, k: v if k == "number" or v is None else torch.tensor(v, dtype=k)  # noqa: E731
    cfg_t = GTPOConfig.preset("gtpo", entropy_threshold=as_kind(thr, thr_kind),
                              initial_entropy=as_kind(init, init_kind))
    cfg_n = GTPOConfig.preset("gtpo", entropy_threshold=float(cfg_t.entropy_threshold),
                              initial_entropy=None if init is None else float(cfg_t.initial_entropy))
    assert epilogue.covers(cfg_t)
    on, g_n, n_n = _call(c, cfg_n, "triton", count=True)
    ot, g_t, n_t = _call(c, cfg_t, "triton", count=True)
    for k in ("loss", "per_token_loss", "seq_entropy", "kept"):
        _equal(getattr(ot, k).detach(), getattr(on, k).detach(), k)
    _equal(g_t, g_n, "grad")
    assert bool(ot.kept.all()) == (side == "above"), ot.kept  # the gate, or the filter dropping some
    gate = side is not None and not (thr_kind == "number" and init_kind == "number")
    tensors = (thr_kind != "number") + gate
    assert n_t[2].get("_epilogue_kernel") == 1 and n_t[1] == 0, n_t
    assert n_t[0] == n_n[0] + gate + (tensors > 1), (n_t, n_n)
    oe, g_e, _ = _call(c, cfg_t, "torch")
    assert_value_close("loss", ot.loss.detach(), oe.loss.detach(), TOL)
    assert_grad_close("grad", g_t, g_e, TOL)
