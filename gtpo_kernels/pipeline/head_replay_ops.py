"""The head over the sampler's kept sets (head_replay.py) through `torch.library` custom ops, as the full
head (head_ops.py), so that a step calling linear_gtpo_loss / linear_token_logprobs with `sampling_mask`,
`top_k`, `top_p` or `min_p` traces whole under torch.compile(fullgraph=True) (spec 6, 13):

    head_replay_fwd  (hidden, weight, bias, tokens, the recorded sets or the rules) -> per flat token
                     (logp, H, flags), the rebuilt sets (flat layout; empty for recorded ones), the
                     metrics of spec 13, the replay's statistics (n, 3) (with a vocabulary split, the sets'
                     merged LSE (n, 1): the backward communicates nothing)
                     and, when a gradient is wanted, the counted rows and the union tiles as planned and
                     formed (tile_union.Unions.saved); its autograd rule runs head_replay_bwd
    head_replay_bwd  the union tiles' backward from those statistics, entropies and tiles: dL/dh, dL/dW,
                     dL/db, with one host read (the tiles' plan), no plan or union formed again

The forward reads the counted rows and plans its tiles inside (host reads that tracing does not see); the
rebuilt sets' total size and the saved plan's sizes are known only when the op runs (unbacked sizes while
tracing). Numbers (the temperature, the rules given as numbers) and the head's options travel by key.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import List, Optional

import torch

from ..core import checks
from ..core.layout import float_dtype_for
from ..core.sampling import check_sampling_mask_flat, unpack_mask
from ..distributed import vocab_replay
from ..distributed.vocab_parallel import VocabParallel
from ..kernels import replay as rp
from ..kernels.set_check_triton import flat_set_checks
from . import head as hd
from . import head_replay as hr
from .replay import _any, at

Tensor = torch.Tensor
METRICS = ("mean_kept_size", "replay_restored_frac", "kept_mass")


@dataclasses.dataclass(frozen=True)
class ReplayOptions:
    """A call's options that are not tensors: the head's transforms, the backend, the budget, the
    vocabulary split (or None), the temperature and the rules where they are numbers."""
    backend: str
    scale: float
    cap: Optional[float]
    proj: object
    budget: int
    vp: object
    tau: object
    rules: tuple  # (top_k, top_p, min_p): a number, or None (off, or given as a tensor)


_KEYS: dict = {}
_OPTIONS: dict = {}
_COUNTER = itertools.count()


@hd._assume_constant_result
def options_key(backend, scale, cap, proj, budget, vp, tau, rules) -> str:
    """The key the ops take for their options (equal options share one); torch.compile calls it once
    while tracing. A vocabulary split is kept by its group and slice (the ops read no more of it)."""
    split = None if vp is None else (id(vp.group), vp.start, vp.V, vp.V_max)
    sig = (backend, float(scale), cap, proj, int(budget), split, tau, rules)
    key = _KEYS.get(sig)
    if key is None:
        key = _KEYS[sig] = f"head_replay{next(_COUNTER)}"
        _OPTIONS[key] = ReplayOptions(backend, float(scale), cap, proj, int(budget),
                                      None if vp is None else VocabParallel(vp.group, vp.start, vp.V, vp.V_max),
                                      tau, rules)
    return key


def _autograd_inside():
    """Autograd recording inside an op's implementation, which the dispatcher runs below autograd: the
    union tiles' backward differentiates the replay (with a vocabulary split, its values' gather) per tile."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for k in (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther):
        exclude = exclude.remove(k)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def _acc(weight, proj):
    return float_dtype_for(torch.empty(0, dtype=hd.project_dtype(weight, proj)))


@torch.library.custom_op("gtpo_kernels::head_replay_fwd", mutates_args=())
def head_replay_fwd(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], ids: Tensor, counted: Tensor,
                    tau: Optional[Tensor], token_ids: Optional[Tensor], flat: Optional[Tensor],
                    invalid: Optional[Tensor], top_k: Optional[Tensor], top_p: Optional[Tensor],
                    min_p: Optional[Tensor], key: str, need_plan: bool) -> List[Tensor]:
    o = _OPTIONS[key]
    n = counted.numel()
    # the recorded sets: the counted rows and the sets' offsets read in one (else the rows read alone)
    pos, off_host = (None, None) if token_ids is None else hr.counted_with_offsets(counted, flat)
    p = hr.state(hidden, weight, bias, ids, counted, tau, o, pos=pos)
    p.with_plan = need_plan
    if token_ids is not None:  # the recorded sets
        hr.with_sets(p, token_ids, flat, invalid, off_host)
        sets = [token_ids.new_empty(0), token_ids.new_empty(0), counted.new_empty(0)]
    else:  # the rules: the sets rebuilt in the forward's tiles
        p.rules = tuple(at(num if t is None else t, p.pos) for t, num in zip((top_k, top_p, min_p), o.rules))
        p.invalid = None if invalid is None else invalid[p.pos]
    lp, ent, stats, flags = hr.forward(hidden, p)
    if token_ids is None:
        sets = list(hr.flat_sets(p, counted))
        if need_plan:  # the backward's union tiles, formed here once
            hr.unions(p)
    plan = hr.saved_plan(p) if need_plan else _no_plan(counted)
    metrics = p.metrics if token_ids is None else rp.replay_metrics(p.offsets)
    bad = flags.any() if p.invalid is None else flags.any() | p.invalid.any()  # NaN metrics (rp.poisoned)
    zero = torch.zeros(n, dtype=lp.dtype, device=lp.device)
    stats = lp.new_zeros(n, stats.shape[1]).index_copy_(0, p.pos, stats)  # (a split: (n, 1), the sets' LSE)
    return [zero.scatter(0, p.pos, lp), zero.scatter(0, p.pos, ent),
            torch.zeros(n, dtype=torch.int8, device=lp.device).scatter(0, p.pos, flags), *sets,
            torch.stack([metrics.get(k, torch.zeros((), dtype=torch.float64, device=lp.device)).to(torch.float64)
                         for k in METRICS]) + torch.where(bad, float("nan"), 0.0), stats, *plan]


@head_replay_fwd.register_fake
def _(hidden, weight, bias, ids, counted, tau, token_ids, flat, invalid, top_k, top_p, min_p, key, need_plan):
    n = counted.numel()
    acc = _acc(weight, _OPTIONS[key].proj)
    K = 0 if token_ids is not None else torch.library.get_ctx().new_dynamic_size()
    m = 0 if token_ids is not None else n + 1
    return [hidden.new_empty(n, dtype=acc), hidden.new_empty(n, dtype=acc), hidden.new_empty(n, dtype=torch.int8),
            hidden.new_empty(K, dtype=torch.long), hidden.new_empty(m, dtype=torch.long),
            hidden.new_empty(max(m - 1, 0), dtype=torch.bool), hidden.new_empty(len(METRICS), dtype=torch.float64),
            hidden.new_empty(n, 3 if _OPTIONS[key].vp is None else 1, dtype=acc), *_fake_plan(need_plan, hidden)]


def _no_plan(like):
    """The six plan outputs of a forward that no backward follows: empty (distinct tensors, as outputs must be)."""
    return [like.new_empty(0, dtype=torch.long) for _ in range(6)]


def _fake_plan(need_plan, like):
    """The saved plan's outputs while tracing: counted rows M, unions' ids, local ids K, local offsets,
    local sampled ids (M), the plan; sizes known when the op runs."""
    if not need_plan:
        return _no_plan(like)
    ctx = torch.library.get_ctx()
    M = ctx.new_dynamic_size()
    return [like.new_empty(M, dtype=torch.long), *(like.new_empty(ctx.new_dynamic_size(), dtype=torch.long)
                                                   for _ in range(3)),
            like.new_empty(M, dtype=torch.long), like.new_empty(ctx.new_dynamic_size(), dtype=torch.long)]


@torch.library.custom_op("gtpo_kernels::head_replay_bwd", mutates_args=())
def head_replay_bwd(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], tau: Optional[Tensor],
                    invalid: Optional[Tensor], plan: List[Tensor], stats: Tensor, ent: Tensor, g_logp: Tensor,
                    g_ent: Tensor, key: str, need: List[bool]) -> List[Tensor]:
    p = hr.with_saved(hr.state(hidden, weight, bias, None, None, tau, _OPTIONS[key], pos=plan[0]), plan[1:], invalid)
    acc = _acc(weight, p.head.proj)
    saved = (stats[p.pos], ent[p.pos])  # the forward's, at the counted rows (a split: the sets' LSE, H)
    with _autograd_inside():
        dh, dw, db = hr.backward(hidden, weight, bias, p, g_logp[p.pos].to(acc), g_ent[p.pos].to(acc), need, *saved)
    return [hidden.new_empty(0) if dh is None else dh,
            hidden.new_empty(0) if dw is None else dw.to(weight.dtype),
            hidden.new_empty(0) if db is None else db.to(bias.dtype)]


@head_replay_bwd.register_fake
def _(hidden, weight, bias, tau, invalid, plan, stats, ent, g_logp, g_ent, key, need):
    return [torch.empty_like(hidden, memory_format=torch.contiguous_format) if need[0] else hidden.new_empty(0),
            torch.empty_like(weight) if need[1] else hidden.new_empty(0),
            torch.empty_like(bias) if need[2] and bias is not None else hidden.new_empty(0)]


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, ids, counted, tau, token_ids, flat, invalid, _k, _p, _m, key, _need = inputs
    if token_ids is None:  # the sets the forward rebuilt: their invalid tokens
        invalid = output[5]
    # the forward's replay statistics and (finished) entropies, its counted rows and union tiles: the
    # backward's replay gradient reads them
    ctx.save_for_backward(hidden, weight, bias, tau, invalid, output[7], output[1], *output[8:])
    ctx.key = key
    ctx.set_materialize_grads(False)  # (the outputs without a gradient: no zeros made for them)


def _backward(ctx, grads):
    hidden, weight, bias, tau, invalid, stats, ent, *plan = ctx.saved_tensors
    need = [bool(x) for x in ctx.needs_input_grad[:3]]
    g_logp, g_ent = grads[0], grads[1]
    if not any(need) or (g_logp is None and g_ent is None):
        return (None,) * 14
    g_logp = torch.zeros_like(g_ent) if g_logp is None else g_logp
    g_ent = torch.zeros_like(g_logp) if g_ent is None else g_ent
    grads = head_replay_bwd(hidden, weight, bias, tau, invalid, plan, stats, ent, g_logp, g_ent, ctx.key, need)
    return (*(g if n else None for g, n in zip(grads, need)),) + (None,) * 11


head_replay_fwd.register_autograd(_backward, setup_context=_setup_context)


def _tensor_or_number(x):
    return (x, None) if isinstance(x, Tensor) else (None, x)


def replayed(b, head, hidden, tau, sampling_mask, rules, budget, backend, host, vp=None):
    """(logp, entropy, metrics): logp, entropy (n,) of the flat tokens over their kept sets (0 where not
    counted, NaN where invalid; differentiable w.r.t. hidden, weight, bias), from the recorded sets or
    the rules (pipeline.replay.check_rules' output); validating, a flagged token raises. vp: the
    vocabulary-parallel layout (this rank's weight rows are a slice; the ranks' tiles are alike)."""
    V = head.weight.shape[0] if vp is None else vp.V
    tau_t, tau_n = _tensor_or_number(tau)
    token_ids = flat = invalid = None
    rule_t, rule_n = (None,) * 3, (None,) * 3
    if sampling_mask is not None:
        # a kept id outside [0, V) (unvalidated) makes its token invalid (NaN, spec 13); one process reads only
        # its weight's rows: such an id stands as 0 in the union (with a split, each rank keeps its own slice)
        if backend == "triton":  # the checks in two launches (kernels/set_check_triton.py)
            token_ids, offsets = unpack_mask(sampling_mask, None, b.ids.device)
            flat, invalid, token_ids = flat_set_checks(token_ids, offsets, b.ids, b.counted, V, vp is None)
            if host:  # one read; a problem runs the host's checks, whose error names it (with a group the
                # sets are agreed: every rank reads the same and raises the same)
                with checks.one_host_read():
                    checks.check_on_device(invalid.any(), lambda: check_sampling_mask_flat(
                        sampling_mask, b.ids, b.counted, V, True))
        else:
            with checks.one_host_read():  # with a group every rank holds the same sets (agreed): the same error
                token_ids, flat, invalid = check_sampling_mask_flat(sampling_mask, b.ids, b.counted, V, host)
            if vp is None:
                token_ids = torch.where((token_ids >= 0) & (token_ids < V), token_ids, torch.zeros_like(token_ids))
    else:
        (top_k, top_p, min_p), rule_bad = rules
        rule_t, rule_n = zip(*(_tensor_or_number(x) for x in (top_k, top_p, min_p)))
        invalid = _any(*rule_bad)
        if vp is not None:
            invalid = _any(invalid, vocab_replay.missing_k(top_k, b.ids.reshape(-1), host, b.counted.reshape(-1)))
    key = options_key(backend, head.scale, head.cap, head.proj, budget, vp, tau_n, tuple(rule_n))
    need_plan = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                for t in (hidden, head.weight, head.bias))
    out = head_replay_fwd(hidden, head.weight, head.bias, b.ids, b.counted, tau_t, token_ids, flat, invalid,
                          *rule_t, key, need_plan)
    logp, ent, flags, metrics = out[0], out[1], out[2], out[6].detach()
    if vp is not None and rules is not None:
        vocab_replay.refuse_unbuilt(out[5], host)
    if host:
        checks.raise_on_flags(flags, b.tok_shape)
    names = METRICS if sampling_mask is None else METRICS[:2]
    return logp, ent, {k: metrics[i] for i, k in enumerate(names)}
