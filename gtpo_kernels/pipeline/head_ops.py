"""The fused LM head through torch.library custom ops, as the logits path (kernels/ops.py, autograd.py):

    head_fwd     (hidden, weight, bias, tokens) -> per token (logp, H, stats, flags); with the fused
                 schedule also the gradients dL/dh, dL/dW, dL/db, formed tile by tile (tiles.py)
    head_attach  (value, ...) -> value; its autograd rule scales the fused schedule's gradients by the
                 upstream gradient, or runs head_bwd (the recompute schedule)
    head_bwd     the recompute schedule's backward

The ops plan their tiles inside (host reads that torch.compile cannot trace), so a step calling
linear_gtpo_loss compiles with fullgraph=True; the options travel by key (head.options_key). The
loss value, the surrogate and the gradient scaling are the logits path's (loss.py, autograd.py).
"""
from __future__ import annotations

import types
from typing import List, Optional

import torch

from ..core import checks
from ..core.layout import float_dtype_for
from ..kernels import loss_ops, ops
from ..objective.surrogate import seg_sum
from . import head as hd
from . import epilogue, head_backward, loss, tiles
from . import schedule as sched

EXTRAS = ("adv", "old", "ref", "lam", "n_conf", "rollout_w", "rollout_w_seq", "rollout_logps", "num_items",
          "max_len", "mask", "cu", "adv_given", "hp", "draws")  # the last five: what the epilogue kernel reads
Tensor = torch.Tensor


def _tensors(hidden, weight, bias, ids, kernel_ids, counted, seg, extras, temperature):
    x = types.SimpleNamespace(**dict(zip(EXTRAS, extras or [None] * len(EXTRAS))))
    return types.SimpleNamespace(hidden=hidden, weight=weight, bias=bias, ids=ids, kernel_ids=kernel_ids,
                                 counted=counted, seg=seg, extras=x, temperature=temperature)


def _grads_or_empty(grads, hidden):
    return [hidden.new_empty(0) if x is None else x for x in grads]


def _fake_grads(opts, hidden, weight, bias, need, acc):
    """The gradients' shapes: what head_fwd (fused) and head_bwd return, empty where not needed."""
    acc = float_dtype_for(weight) if acc else None
    return [torch.empty_like(hidden) if need[0] else hidden.new_empty(0),
            weight.new_empty(weight.shape, dtype=acc or weight.dtype) if need[1] else hidden.new_empty(0),
            weight.new_empty(weight.shape[0], dtype=acc or weight.dtype) if need[2] and bias is not None
            else hidden.new_empty(0)]


@torch.library.custom_op("gtpo_kernels::head_fwd", mutates_args=())
def head_fwd(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], ids: Tensor, kernel_ids: Tensor,
             counted: Tensor, seg: Tensor, extras: List[Optional[Tensor]], temperature: Tensor, key: str,
             need: List[bool], epi_floats: List[float], epi_flags: List[int]) -> List[Tensor]:
    """[logp, H, stats, flags, dh, dw, db, then the epilogue's 12 outputs (loss_ops.epilogue_outputs) when
    epi_flags are given (the loss math in the epilogue kernel), else 12 empty tensors]."""
    opts = hd.options(key)
    t = _tensors(hidden, hd.upcast(weight, opts.proj), hd.upcast(bias, opts.proj), ids, kernel_ids, counted, seg,
                 extras, temperature)
    with hd.autocast_off(hidden.device):
        logp, ent, stats, bad, grads, epi = tiles.forward_tiles(opts, t, need,
                                                                (epi_floats, epi_flags) if epi_flags else None)
    # (the epilogue's logp and H are logp and H themselves: not returned twice; no output aliases another)
    epi = [hidden.new_empty(0) if epi is None or j in (1, 2) else epi[j] for j in range(12)]
    return [logp, ent, stats, bad, *_grads_or_empty(grads, hidden), *epi]


@head_fwd.register_fake
def _(hidden, weight, bias, ids, kernel_ids, counted, seg, extras, temperature, key, need, epi_floats, epi_flags):
    opts, n = hd.options(key), ids.numel()
    acc = ops.acc_dtype(hidden, opts.backend)
    grads = _fake_grads(opts, hidden, weight, bias, need if opts.fused else [False] * 3, True)
    epi = [hidden.new_empty(0)] * 12
    if epi_flags:
        epi = [x if j not in (1, 2) else epi[j] for j, x in enumerate(loss_ops.epilogue_outputs(hidden, n, opts.B,
                                                                                                 epi_flags))]
    return [hidden.new_empty(n, dtype=acc), hidden.new_empty(n, dtype=acc), hidden.new_empty((n, 3), dtype=acc),
            hidden.new_empty(n, dtype=torch.int8), *grads, *epi]


@torch.library.custom_op("gtpo_kernels::head_bwd", mutates_args=())
def head_bwd(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], kernel_ids: Tensor, stats: Tensor,
             ent: Tensor, c: Tensor, e: Optional[Tensor], temperature: Tensor, key: str,
             need: List[bool], g: Tensor) -> List[Tensor]:
    """The recompute schedule's [dh, dw, db]; g: the upstream gradient (one element or one per token),
    which the gradient kernel multiplies c and e by."""
    opts = hd.options(key)
    t = _tensors(hidden, hd.upcast(weight, opts.proj), hd.upcast(bias, opts.proj), kernel_ids, kernel_ids, None,
                 None, None, temperature)
    with hd.autocast_off(hidden.device):
        dh, dw, db = head_backward.backward_tiles(opts, t, stats, ent, c, e, need, g)
    dw = None if dw is None else dw.to(weight.dtype)  # cast once
    db = None if db is None else db.to(bias.dtype)
    return _grads_or_empty([dh, dw, db], hidden)


@head_bwd.register_fake
def _(hidden, weight, bias, kernel_ids, stats, ent, c, e, temperature, key, need, g):
    return _fake_grads(hd.options(key), hidden, weight, bias, need, False)


@torch.library.custom_op("gtpo_kernels::head_attach", mutates_args=())
def head_attach(value: Tensor, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], kernel_ids: Tensor,
                stats: Tensor, ent: Tensor, c: Tensor, e: Optional[Tensor], dh: Tensor, dw: Tensor, db: Tensor,
                temperature: Tensor, key: str) -> Tensor:
    return value.clone()


@head_attach.register_fake
def _(value, hidden, weight, bias, kernel_ids, stats, ent, c, e, dh, dw, db, temperature, key):
    return torch.empty_like(value)


def _setup_context(ctx, inputs, output):
    _value, hidden, weight, bias, kernel_ids, stats, ent, c, e, dh, dw, db, temperature, key = inputs
    ctx.save_for_backward(hidden, weight, bias, kernel_ids, stats, ent, c, e, dh, dw, db, temperature)
    ctx.key = key


def _scaled(acc, g, dtype):
    """acc * g in `dtype`: one new tensor (the cast, scaled in place), acc left as it is (a second
    backward reads it again)."""
    return acc * g.to(dtype) if acc.dtype == dtype else acc.to(dtype).mul_(g.to(dtype))


def _backward(ctx, grad):
    hidden, weight, bias, kernel_ids, stats, ent, c, e, dh, dw, db, temperature = ctx.saved_tensors
    opts = hd.options(ctx.key)
    need = [bool(x) for x in ctx.needs_input_grad[1:4]]  # hidden, weight, bias
    if opts.fused:  # a scalar loss: the gradients were formed in the forward
        dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        out = [_scaled(x, grad, d) if n else None for x, d, n in zip((dh, dw, db), dtypes, need)]
    else:
        g = grad.reshape(-1).to(c.dtype)  # scalar loss: (1,); loss_agg='none': one per token
        out = head_bwd(hidden, weight, bias, kernel_ids, stats, ent, c, e, temperature, ctx.key, need, g)
        out = [x if n else None for x, n in zip(out, need)]
    return (None, *out) + (None,) * 10


head_attach.register_autograd(_backward, setup_context=_setup_context)


def coefficient_span(cfg):
    """What a token's gradient coefficients depend on beyond the token: None, 'completion' or 'batch'."""
    if cfg.top_entropy_on or cfg.batch_term:
        return "batch"  # the quantile (clip_cov's, kl_cov's covariances) spans every counted token
    if cfg.shapes_advantages or cfg.sequence_term or \
            cfg.off_policy_mask_threshold is not None or cfg.policy_loss == "vespo":
        return "completion"
    return None


def _longest_fits(b, per_tile, host, collective=False):
    """Whether every completion's counted tokens fit in one tile: from the padded length T when it tells,
    from max_seqlen only when validated (host: checked against the longest completion; unverified, it
    never plans the tiles), else one host read of the counted tokens (none under torch.compile: then
    assume not). The answer is the counted tokens' own, so ranks holding the same tokens agree; with
    `collective` (ranks of a vocabulary split) the host read is never made, so that a compiled rank and
    an eager one choose the same schedule (they would otherwise run different all-reduces and hang)."""
    bound = b.tok_shape[1] if not b.packed else (b.max_seqlen if host else None)
    if bound is not None and bound <= per_tile:
        return True
    if collective or torch.compiler.is_compiling():
        return False
    return int(seg_sum(b.counted.to(torch.int32), b.seg, b.B).max()) <= per_tile


def choose_schedule(b, cfg, schedule, per_tile, host=False, V=1, D=1, collective=False, elem_bytes=2):
    """Whether the fused schedule runs: forced, or with 'auto' when each tile's coefficients can come
    from the tile alone and the time model (schedule.predict) finds it faster for these options and
    sizes; a forced 'fused' that cannot run is refused. The answer rests on the options, the sizes and the
    counted tokens only (never on an unverified max_seqlen nor on what requires grad)."""
    if schedule == "recompute" or (schedule == "auto" and sched.predict(
            cfg, V, D, b.counted.numel(), per_tile, elem_bytes).choice == "recompute"):
        return False  # (no host read needed to know it)
    span = coefficient_span(cfg)
    why = None
    if cfg.loss_agg == "none":
        why = "loss_agg='none' takes a per-token upstream gradient"
    elif span == "batch":
        why = "top_entropy_quantile < 1 (or clip_cov's, kl_cov's selection) spans the whole batch"
    elif span == "completion" and not _longest_fits(b, per_tile, host, collective):
        why = (f"a completion longer than a tile ({per_tile} rows within memory_budget) is split across tiles, "
               "and its statistics span them (raise memory_budget)") if not (collective and b.packed) else (
              "with a vocabulary split over ranks and packed completions, each completion is known to fit a tile "
              f"({per_tile} rows within memory_budget) only from a validated max_seqlen (validate=True)")
    if schedule == "fused" and why is not None:
        raise ValueError("schedule='fused' needs each tile's gradient coefficients to depend on that tile "
                         f"alone; here they do not ({why}): use 'recompute' or 'auto'")
    return why is None


def _key(b, cfg, head, backend, schedule, budget, vp, host=False):
    """The per-call options' key: tile rows from the budget (sized by the largest vocabulary slice, so
    that every rank makes the same tiles), and the schedule."""
    V = head.weight.shape[0] if vp is None else vp.V_max
    proj = hd.project_dtype(head.weight, head.proj)
    per_tile = hd.rows_per_tile(V, proj, head.weight.device, budget)
    fused = cfg is not None and choose_schedule(b, cfg, schedule, per_tile, host, V, head.weight.shape[1],
                                                collective=vp is not None, elem_bytes=proj.itemsize)
    cap = None if head.cap is None else float(head.cap)
    return hd.options_key(cfg, backend, float(head.scale), cap, per_tile, fused, b.B,
                          None if vp is None else (vp.group, vp.V, vp.sizes if head.invariant else None), head.proj,
                          head.invariant), fused


def _forward(b, head, hidden, key, temperature, vp, extras, need, host, epi=([], [])):
    """head_fwd on detached inputs; the flags reported on the host after the tile loop (validating)."""
    bias = None if head.bias is None else head.bias.detach()
    out = head_fwd(hidden.detach(), head.weight.detach(), bias, b.ids, b.ids if vp is None else vp.ids,
                   b.counted, b.seg, extras, temperature, key, need, *epi)
    if host:
        checks.raise_on_flags(out[3], b.tok_shape)
    return out


def uses_epilogue(b, cfg, backend, group):
    """Whether the epilogue kernel computes this call's loss: the Triton backend, a config it covers (rollout
    weights, per token or per completion, go to the kernel as it reads them: epilogue.tensors). On a split
    vocabulary (group: the process group, or the vocabulary-parallel layout) too: the tiles' statistics are
    merged before it, the same on every rank, so it decides the same on every rank."""
    return backend == "triton" and epilogue.covers(cfg)


def _epilogue_args(b, cfg, backend, vp, num_items):
    """The epilogue kernel's (floats, flags) when it computes this call's loss (the Triton backend on one
    process, a config it covers), else None. Not validating in the kernel: the head checked its inputs on
    the host, and reads the kernel's status word for flagged rows and the entropy filter."""
    if not uses_epilogue(b, cfg, backend, vp):
        return None
    floats, flags = epilogue.arguments(b, cfg, num_items, 1.0, False)
    flags[-1] = -1  # max_seqlen: read by the kernel's checks only
    return floats, flags


def head_loss(b, cfg, head, hidden, budget, schedule, backend, num_items, host, vp):
    """linear_gtpo_loss after its checks: the tiles (the fused schedule forms the gradient there), the
    loss math (the epilogue kernel once per call, or the eager surrogate) and the loss value with the
    backward attached (as the logits path), the output."""
    dt = float_dtype_for(hidden)
    key, fused = _key(b, cfg, head, backend, schedule, budget, vp, host)
    # once per call: the config's number, or the call's per-token tau (spec 13), read by row in each tile
    temperature = ops.temperature_param(cfg.temperature if b.tau is None else b.tau, hidden, backend)
    dev = hidden.device  # numbers become device tensors by a fill, never by a host-to-device copy
    params = (hidden, head.weight, head.bias)
    need = [x is not None and x.requires_grad and torch.is_grad_enabled() for x in params]
    epi = _epilogue_args(b, cfg, backend, vp, num_items)
    grad_in_forward = torch.full((), 1.0 if fused else 0.0, dtype=dt, device=dev)
    if epi is not None:
        mask, adv, old, ref, lam, n_conf, cu, roll, rw, hp, draws = epilogue.tensors(b, cfg)
        num = num_items if isinstance(num_items, Tensor) else None
        per_seq = b.rollout_w_seq is not None  # rw (B,) per completion: never spread
        extras = [b.adv, old, ref, lam, n_conf, None if per_seq else rw, rw if per_seq else None, roll, num, None,
                  mask, cu, adv, hp, draws]
        out = _forward(b, head, hidden, key, temperature, vp, extras, need, False, epi)
        logp, ent, stats, bad, dh, dw, db = out[:7]
        value, _, _, ltok, c, e, *rest = out[7:]
        e = e if epi[1][loss_ops.FLAGS.index("HAS_E")] else None
        value = head_attach(value, *params, b.ids if vp is None else vp.ids, stats, ent, c, e, dh, dw, db,
                            temperature, key)
        res = epilogue.output([value, logp, ent, ltok, c, e, *rest], bad, b, cfg, host)
        res.metrics["grad_in_forward"] = grad_in_forward
        return res
    max_len = b.max_len if isinstance(b.max_len, Tensor) else torch.full((), float(b.max_len), dtype=dt, device=dev)
    num = num_items if num_items is None or isinstance(num_items, Tensor) else \
        torch.full((), float(num_items), dtype=torch.float32, device=dev)
    extras = [b.adv, b.old, b.ref, b.lam, b.n_conf, b.rollout_w, b.rollout_w_seq, b.rollout_logps, num, max_len,
              None, None, None, None, None]
    logp, ent, stats, _, dh, dw, db = _forward(b, head, hidden, key, temperature, vp, extras, need, host)[:7]
    res, value, c, e = loss.value_and_coefficients(b, cfg, logp, ent, num_items, dt, stats.dtype)
    value = head_attach(value, *params, b.ids if vp is None else vp.ids, stats, ent, c, e, dh, dw, db,
                        temperature, key)
    res["metrics"]["grad_in_forward"] = grad_in_forward
    return loss.make_output(b, cfg, value, res, dt, host)


def head_logprobs(b, head, hidden, temperature, budget, backend, host, vp):
    """linear_token_logprobs after its checks: (logps, entropy) of the tokens' shape, 0 where masked out (the
    tiles hold the counted tokens alone: the others keep the forward's zeros)."""
    key, _ = _key(b, None, head, backend, "recompute", budget, vp)
    with torch.no_grad():
        logp, ent = _forward(b, head, hidden, key, ops.temperature_param(temperature, hidden, backend), vp,
                             [None] * len(EXTRAS), [False] * 3, host)[:2]
    return logp.reshape(b.tok_shape), ent.reshape(b.tok_shape)
