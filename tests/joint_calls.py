"""For tests/test_joint.py: one drawn example (joint_strategies.joints) made comparable, called and checked.
Its inputs kept off the thresholds where float32 and float64 could decide differently, the entropy filter
settled; the rollout weights, num_items_in_batch, the form's keywords and precomputed conflict weights; the
call through each entry point (logits, log-probs, hidden states + head); the float64 reference on the same
values, and the comparison (values, outputs, metrics, gradients; spec 7 tolerances)."""
import contextlib
import sys

import torch
from hypothesis import assume, event

import gtpo_reference as ref
from conftest import TOL, assert_grad_close, assert_value_close
from gtpo_kernels import conflict_weights, gtpo_loss, gtpo_loss_from_logps, linear_gtpo_loss, rollout_is_weights
from joint_strategies import materialize

# gradients of hidden, weight and bias are GEMMs over V: 1e-4 in float32 (issue 8), as tests/test_linear.py
WEIGHT_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float64: 1e-7}
GRAD_SEEN = {}  # entry -> examples whose reference gradient is not zero

def _value_close(name, x, ref, tol):
    assert_value_close(name, x, ref, tol)


def _finite_close(name, x, ref, tol):
    """x right where it is not NaN (NaN: the call flagged input it could not verify)."""
    x = torch.as_tensor(x)
    assert_value_close(name, x, ref, tol, where=~x.double().isnan())


def completion_entropy(H, m):
    return (H * m).sum(1) / m.sum(1).clamp(min=1)


def settle_filter(j, cfg, hbar, m):
    """Like tests/batches.cases_and_configs: when the filter would drop every completion, move its threshold
    between two completion entropies (or above all) so that the gradient is not zero merely for that."""
    thr, h0 = cfg.entropy_threshold, cfg.initial_entropy
    if thr is None or (h0 is not None and h0 > thr) or not j.filter_between:
        return cfg
    h = hbar[m.any(1)].sort().values
    if h.numel() and not (h <= thr).any():
        k = int(torch.randint(0, h.numel(), (1,)))
        thr = float((h[k] + h[k + 1]) / 2) if k + 1 < h.numel() else float(h[-1]) + 0.5
        cfg = cfg.replace(entropy_threshold=thr)
    return cfg


def away_from_thresholds(cfg, m, rlp, rent, old, sampling):
    """Decisions taken on float32 values and on float64 ones must not sit on their thresholds."""
    edges = (1 - cfg.eps_low, 1 + cfg.eps_high) + ((cfg.delta,) if cfg.delta else ())
    if cfg.policy_loss == "cispo":
        edges = (cfg.eps_high,)
    if old is not None and cfg.policy_loss in ("ppo", "cispo"):
        lr = torch.where(m, rlp - old.double(), torch.zeros(()))
        if cfg.importance_sampling_level == "sequence":
            r = torch.exp(lr.sum(1) / m.sum(1).clamp(min=1))[m.any(1)]
        else:
            r = torch.exp(lr)[m]
        for e in edges:
            assume(r.numel() == 0 or (r - e).abs().min() > 1e-4)
    if cfg.top_entropy_quantile < 1.0 and m.sum() > 1:
        gaps = rent[m].sort().values.diff()
        assume(bool(((gaps == 0) | (gaps > 1e-4)).all()))
    if cfg.off_policy_mask_threshold is not None and sampling is not None:
        kl = torch.where(m, (sampling.double() - rlp).nan_to_num(0.0), torch.zeros(())).sum(1) / m.sum(1).clamp(min=1)
        assume(bool(((kl - cfg.off_policy_mask_threshold).abs() > 1e-4)[m.any(1)].all()))
    gated = cfg.initial_entropy is not None and cfg.entropy_threshold is not None and \
        cfg.initial_entropy > cfg.entropy_threshold
    if cfg.entropy_threshold is not None and not gated:
        hbar = completion_entropy(rent, m)[m.any(1)]
        assume(bool(((hbar - cfg.entropy_threshold).abs() > 1e-4).all()))


def rollout_weights(j, d, old, roll):
    """(the call's weights, the reference's (B, T) or (B, 1)), or (None, None)."""
    B, T, gen = j.B, j.T, d.gen
    if j.rollout == "none":
        return None, None
    if j.rollout == "token":
        w = torch.rand(B, T, generator=gen) * 1.5 + 0.25
        return (d.pack(w) if j.packed else w), w
    if j.rollout in ("b1", "b"):
        w = torch.rand(B, 1, generator=gen) * 1.5 + 0.25
        if j.rollout == "b" and j.packed and int(d.lengths.sum()) == B:  # (B,) = (N,): per-token weights
            return w[:, 0], d.unpack(w[:, 0], fill=1.0)
        return (w if j.rollout == "b1" else w[:, 0]), w
    w = rollout_is_weights(old, roll, d.mask, j.rollout, clip_min=j.clip_min, clip_max=j.clip_max)
    # spec 9: sequence-mode weights are per completion, read once per completion by every consumer
    w_ref = w[:, :1] if j.rollout.startswith("sequence") else w
    if j.packed and tuple(w.shape) == (B, T):
        w = d.pack(w)
    return w, w_ref


def num_items(j, m):
    if j.num_items is None:
        return None
    kind, k = j.num_items
    v = float(k * int(m.sum()) + 1) if k else 0.0
    return v if kind == "float" else torch.tensor(v)


def api_side(j, d, old, refl, roll):
    """The call's per-token tensors (packed when the form is) and the form's keywords: max_seqlen the
    padded T, or a lie (shorter than the longest completion), and validate=False when drawn."""
    pk = d.pack if j.packed else (lambda x: x)
    kw = {} if j.validate else {"validate": False}
    if j.packed:
        kw["cu_seqlens"] = d.cu_seqlens
        longest = int(d.lengths.max()) if j.B else 0
        if j.lie and longest > 0:
            kw["max_seqlen"] = int(torch.randint(0, longest, (1,), generator=d.gen))
        elif j.max_seqlen:
            kw["max_seqlen"] = j.T
    return pk(d.ids), pk(d.mask), (pk(old) if j.with_old else None), (pk(refl) if j.with_ref else None), \
        (pk(roll) if j.with_roll_lp else None), kw


def precomputed(j, d, cfg, ids, mask, form_kw, dt, nan_ok=False):
    """conflict_weights (the public call) against the reference's; -> ((lam, n_conf) call, reference).
    nan_ok: NaN entries accepted (input the call could not verify), finite ones must be right."""
    lam, n_conf = conflict_weights(ids, mask, d.adv, j.G, config=cfg, dtype=dt, backend=j.backend, **form_kw)
    lr, nr = ref.conflict_weights(d.ids, d.mask, d.adv.double(), j.G, cfg.conflict_pos_weight,
                                  cfg.conflict_neg_weight)
    close = _finite_close if nan_ok else _value_close
    close("conflict_weights lam", lam, d.pack(lr) if j.packed else lr, 0.0)
    close("conflict_weights n_conf", n_conf, nr, 0.0)
    return (lam, n_conf), (lr, nr)


def lying(j, d, kw):
    """The call was given a max_seqlen shorter than the longest completion."""
    return j.packed and kw.get("max_seqlen") is not None and kw["max_seqlen"] < int(d.lengths.max())


def autocast(f):
    """f() inside a bfloat16 autocast region (as a trainer's forward under mixed precision)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return f()


def backward(loss, up):
    """The upstream gradient: 1, or `up` per token with loss_agg='none'."""
    (loss if loss.dim() == 0 else (loss.double() * up).sum()).backward()


def call_logits(j, d, Z, cfg, tensors, kw, up, around=lambda f: f()):
    """gtpo_loss on the logits (offset rows when logits_start is given) -> (out, {name: (grad, ref place)})."""
    ids, mask = tensors
    s = j.logits_start
    rows = d.pack(Z) if j.packed else Z
    if s:  # rows before and after the ones that predict completion tokens
        g = torch.Generator().manual_seed(j.seed + 1)
        pad = lambda n: torch.randn(*((n,) if j.packed else (j.B, n)), j.V, generator=g, dtype=torch.float64)  # noqa: E731
        rows = torch.cat([pad(s), rows, pad(1)], dim=0 if j.packed else 1)
    x = rows.to(j.dtype).clone().requires_grad_()
    start = {} if s is None else {"logits_start": s}
    out = around(lambda: gtpo_loss(x, ids, d.adv, mask, backend=j.backend, **start, **kw))
    backward(out.loss, up)

    def place(gref):  # the reference's (B, T, V) gradient where the call's rows are, 0 elsewhere
        full = torch.zeros_like(x, dtype=torch.float64)
        g = d.pack(gref) if j.packed else gref
        if j.packed:
            full[(s or 0):(s or 0) + g.shape[0]] = g
        else:
            full[:, (s or 0):(s or 0) + j.T] = g
        return full
    return out, {"grad logits": (x.grad, place)}


def call_logps(j, d, Z, cfg, tensors, kw, up, around=lambda f: f()):
    """gtpo_loss_from_logps on the reference's log-probs and entropies of Z, chained back to Z."""
    ids, mask = tensors
    z = Z.detach().clone().requires_grad_()
    lp, H = ref.token_logprobs(z, d.ids, cfg.temperature, d.mask)
    lp, H = lp.to(j.dtype), H.to(j.dtype)
    if j.packed:
        lp, H = d.pack(lp), d.pack(H)
    out = around(lambda: gtpo_loss_from_logps(lp, ids, d.adv, mask, entropy=H if j.with_entropy else None, **kw))
    backward(out.loss, up)
    return out, {"grad logits (through the log-probs)": (z.grad, lambda g: g)}


def call_linear(j, d, head, cfg, tensors, kw, up, around=lambda f: f()):
    hidden, weight, bias = head
    ids, mask = tensors
    h = (d.pack(hidden) if j.packed else hidden).clone().requires_grad_()
    w = weight.clone().requires_grad_()
    b = None if bias is None else bias.clone().requires_grad_()
    # about budget_rows rows a tile: a row of logits and its gradient, plus a float32 copy of the gradient
    budget = j.head["budget_rows"] * (2 * hidden.element_size() + 4) * j.V
    out = around(lambda: linear_gtpo_loss(h, w, ids, d.adv, mask, bias=b, logit_scale=j.head["scale"],
                                          logit_softcap=j.head["cap"], memory_budget=budget,
                                          schedule=j.head["schedule"], backend=j.backend, **kw))
    backward(out.loss, up)
    grads = {"grad hidden": (h.grad, (lambda g: d.pack(g)) if j.packed else (lambda g: g)),
             "grad weight": (w.grad, lambda g: g)}
    if b is not None:
        grads["grad bias"] = (None if b.grad is None else b.grad[None], lambda g: g[None])
    return out, grads


def held_values(j, d, out):
    """The per-token log-probs and entropies the call formed and its loss read, padded (B, T) float64, NaN
    where it reports none (an uncounted or unverified token; the entropies of the log-probs entry without
    them): the log-probs entry's inputs as the call holds them (float32), the other entries' float32 values.
    Each is checked against the reference on its own (compare: spec 7's logp and entropy target)."""
    def padded(x):
        x = x.detach().double()
        x = d.unpack(x, fill=float("nan")) if j.packed else x.clone()
        return torch.where(d.mask, x, torch.full((), float("nan"), dtype=torch.float64))
    no_entropy = j.entry == "logps" and not j.with_entropy
    return padded(out.logps), None if no_entropy else padded(out.entropy)


@contextlib.contextmanager
def reference_at(held):
    """Inside, the reference's per-token log-probs and entropies take the values `held` gives (where it
    gives one), their gradients still those of the float64 logits; held None: the reference as it is."""
    if held is None:
        yield
        return
    mod = sys.modules[ref.gtpo_loss.__module__]
    full = mod._full_logp_entropy

    def at(x, v):
        if v is None:
            return x
        return x + torch.where(torch.isfinite(v) & torch.isfinite(x), v - x.detach(), torch.zeros((), dtype=x.dtype))

    mod._full_logp_entropy = lambda *a: tuple(at(x, v) for x, v in zip(full(*a), held))
    try:
        yield
    finally:
        mod._full_logp_entropy = full


def _relative(a, b):
    return {n: 0.0 if b[n].norm() == 0 else float((a[n] - b[n]).norm() / b[n].norm()) for n in b}


def reference(j, d, Z, head, kw_ref, up, tau=None, sampler=None, held=None):
    """The float64 reference on the same values -> (result, {grad name: gradient}, {grad name: slack}).
    Hidden states: the values of the logits as the call's dtype holds them, gradients by float64 autograd
    through the projection; 16-bit: plus the error of storing dL/dlogits in 16 bits (as tests/test_linear.py).
    tau: the call's per-token temperature (B, T), or None: each row divided by its own (after the soft-cap).
    sampler: the kept sets (joint_replay.Replay), or None: every entry outside a set at -inf (spec 13).

    held: the call's own per-token log-probs and entropies (held_values), or None. The slack then holds,
    besides, how far the reference's gradient moves when its log-probs and entropies take those values:
    the part of the gradient's error that the float32 log-probs make, which spec 7 bounds on the log-probs
    themselves (1e-5), not on the gradient. The log-probs entry receives them in float32 (spec 7: the
    reference "on the same inputs"); the other entries form them in float32 (spec 7: accumulate in float32),
    within an ulp or a few of |logp|. Where the gradient is ill-conditioned in logp, its relative error grows
    far past 1e-5 from those ulps alone: the KL term's d/dlogp = beta (1 - exp(ref - logp)) ~ -beta (ref -
    logp) near ref = logp, a token's only gradient where the policy term has none (clipped, filtered, A = 0).
    At logp = -16.7 (ulp 1.9e-6) and ref - logp = -9.5e-4, rounding logp to float32 (5e-7) moves that
    gradient by 5.3e-4 of its norm. Elsewhere this slack is of the order of the log-probs' own rounding:
    over 446 compared draws of the nightly profile it was above 1e-7 in 23 and above 1e-6 in 3 (beta > 0 with
    one or two tokens a completion, and VESPO, whose weight is exponential in logp), 4.3e-6 at most; the
    gradient stays held to spec 7's target beyond it (tests/test_kl_conditioning.py)."""
    cut = (lambda z: z) if sampler is None else sampler.masked
    if head is None:  # tau (B, T): each row divided by its own temperature, in autograd (kw_ref's is 1)
        def grads(values):
            z = Z.detach().clone().requires_grad_()
            with reference_at(values):
                r = ref.gtpo_loss(cut(z) if tau is None else cut(z) / tau[..., None], d.ids, d.adv, d.mask,
                                  **kw_ref)
            backward(r["loss"], up)
            name = "grad logits" if j.entry == "logits" else "grad logits (through the log-probs)"
            return r, {name: z.grad}
        r, exact = grads(None)
        return r, exact, ({} if held is None else _relative(grads(held)[1], exact))
    low = j.dtype == torch.bfloat16

    def run(round_grad, values=None):
        # fresh leaves each run (float64 inputs: .double() would return them, and a second run would add
        # its gradients into the first's)
        leaves = [None if x is None else x.detach().to(torch.float64, copy=True).requires_grad_() for x in head]
        z = materialize(*leaves, j.head["scale"], j.head["cap"])
        if low:
            z = z + (Z - z).detach()
        if round_grad:
            z.register_hook(lambda g: g.to(j.dtype).double())
        z = cut(z)
        with reference_at(values):
            r = ref.gtpo_loss(z if tau is None else z / tau[..., None], d.ids, d.adv, d.mask, **kw_ref)
        backward(r["loss"], up)
        return r, {n: x.grad for n, x in zip(("grad hidden", "grad weight", "grad bias"), leaves) if x is not None}
    r, exact = run(False)
    slack = {n: 0.0 for n in exact}
    if low:
        slack = _relative(run(True)[1], exact)
    if held is not None:
        slack = {n: slack[n] + v for n, v in _relative(run(False, held)[1], exact).items()}
    return r, exact, slack


def compare(j, d, out, r, grads, rgrads, slack, nan_ok=False, sampler=None):
    """Every output and gradient against the reference. nan_ok (input the call could not verify): NaN
    entries are accepted, every finite one must still be right, and a gradient with NaN needs a NaN loss.
    sampler (joint_replay.Replay), with kept sets: their metrics (spec 13: mean_kept_size and
    replay_restored_frac reported with every kept set, kept_mass with the rules, and compared wherever the
    call reports it), and the logits' gradient exactly 0 outside each counted token's set."""
    tol = TOL[j.dtype]
    pk = d.pack if j.packed else (lambda x: x)
    rl = r["loss"].detach()
    if nan_ok:
        event("unverified input: " + ("NaN loss" if bool(out.loss.detach().isnan().any()) else "finite loss"))
        close = _finite_close
        if not bool(torch.isfinite(out.loss.detach()).all()):
            assert bool(out.loss.detach().isnan().any()), f"loss {out.loss} is infinite, not NaN"
    else:
        close = _value_close
    close("loss", out.loss.detach(), rl if rl.dim() == 0 else pk(rl), tol["loss"])
    no_entropy = j.entry == "logps" and not j.with_entropy  # then nothing reads or reports entropies
    for name in ("logps", "entropy", "per_token_loss", "lam"):
        if not (no_entropy and name == "entropy"):
            close(name, getattr(out, name), pk(r[name]), tol["value"])
    for name in ("n_conf", "seq_entropy"):
        if not (no_entropy and name == "seq_entropy"):
            close(name, getattr(out, name), r[name], tol["value"])
    sure = ~out.seq_entropy.isnan() if nan_ok else torch.ones_like(out.kept)
    assert torch.equal(out.kept[sure], r["kept"][sure]), f"kept {out.kept} != reference {r['kept']}"
    for k, v in r["metrics"].items():
        if no_entropy and k == "mean_entropy":
            continue
        close(f"metrics[{k!r}]", out.metrics[k], v, tol["value"])
    for k, v in ({} if sampler is None else sampler.metrics).items():
        if k in out.metrics or k != "kept_mass" or j.replay == "rules":
            assert k in out.metrics, f"metrics[{k!r}] missing with replay={j.replay!r}: {sorted(out.metrics)}"
            close(f"metrics[{k!r}]", out.metrics[k], v, tol["value"])
    nonzero = False
    for name, (g, place) in grads.items():
        gref = place(rgrads[name])
        g = torch.zeros_like(gref) if g is None else g
        if nan_ok and not bool(torch.isfinite(g).all()):
            assert bool(out.loss.detach().isnan().any()), f"{name}: NaN gradient with a finite loss"
            continue
        gtol = (WEIGHT_TOL[j.dtype] if name != "grad logits" and j.entry == "linear" else tol["grad"]) + \
            slack.get(name, 0.0)
        assert_grad_close(name, g, gref, gtol)
        if name == "grad logits" and sampler is not None and sampler.keep is not None:
            outside = place((~sampler.keep & d.mask[..., None]).double()) > 0
            assert bool((g[outside] == 0).all()), f"{name}: not exactly 0 outside the kept sets"
        nonzero |= bool(gref.norm() > 0)
    if nonzero:
        GRAD_SEEN[j.entry] = GRAD_SEEN.get(j.entry, 0) + 1
        event("reference gradient not zero")
