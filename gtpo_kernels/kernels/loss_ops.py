"""The loss on logits in one custom op (and token_logprobs' forward in another): the forward vocabulary
kernel, then the epilogue kernel (epilogue_triton), two launches; its autograd rule is the backward
vocabulary kernel, reading the upstream gradient by pointer (one launch; inplace=True: writing the gradient
over the logits). Opaque to torch.compile, with a fake implementation.

    fused_loss(logits3, ...) -> [value, logp, H, loss_tok, c, e, lam, n_conf, kept (uint8), Hbar,
                                 metrics (12,), status (1,), stats (n, 3), flags (n,), t_s, t_id]

metrics: clip_frac, filtered_frac, conflict_frac, mean_entropy, then with `roll` (rollout_logps) spec 14's
rollout_k3, rollout_abs_diff, rollout_max_abs_diff, rollout_outside_frac, rollout_nan_frac, then with kept sets
rebuilt by rules spec 13's mean_kept_size, replay_restored_frac, kept_mass (12 in all, the unused unset).

With rules (`rules`: top_k, top_p, min_p, each None, a 0-d or (n,) tensor, or a number in `rule_values`;
kernels/kept_rule_triton.py) one launch before the forward kernel writes each token's kept set as a
threshold (t_s, t_id), which the forward and backward vocabulary kernels read (KEEP): 14 outputs, then t_s
and t_id (n,) (empty without rules).

`floats` and `flags` carry the hyper-parameters and the kernel's switches, in the order FLOATS and
FLAGS name them (pipeline/epilogue.py builds them); nothing here reads the device on the host.
"""
from __future__ import annotations

import struct
import threading
from typing import List, Optional

import torch

from . import kept_rule_triton, ops, top_entropy, vocab_triton
from .epilogue_triton import _epilogue_kernel
from .eager import eager

FLOATS = ("tau", "lo", "hi", "delta", "dual_c", "beta", "ent_coef", "penalty", "thr", "max_len", "nitems",
          "sapo_pos", "sapo_neg", "dro_beta", "off_thr", "top_q", "k_pos", "lam_pos", "k_neg", "lam_neg", "cov_lb",
          "cov_ub", "kl_coef", "cov_ratio")
FLAGS = ("PACKED", "HAS_OLD", "HAS_KL", "BIAS_KL", "HAS_LAM", "HAS_NCONF", "NITEMS", "CLIP", "HAS_DELTA",
         "HAS_DUAL", "HAS_E", "FILTER", "PENALTY", "SEQ", "AGG", "TEMP_BY_VALUE", "VALIDATE", "MASK_VALUES", "HAS_REF",
         "POLICY", "RW", "OFF_POLICY", "TOP_ENT", "HP", "TOK_ADV",
         "MAX_SEQLEN")  # MAX_SEQLEN last (head_ops sets flags[-1])
EPILOGUE_BLOCK = 1024  # tokens per step of the epilogue's one program


def _outputs(like, n, B, none_agg, fwd=True):
    """fwd: the forward's stats and flags too (else empty: given to the op)."""
    f32 = dict(device=like.device, dtype=torch.float32)
    value = torch.empty(n if none_agg else (), **f32)
    per_tok = [torch.empty(n, **f32) for _ in range(6)]  # logp, H, loss_tok, c, e, lam
    m = n if fwd else 0
    return [value, *per_tok, torch.empty(B, **f32), torch.empty(B, device=like.device, dtype=torch.uint8),
            torch.empty(B, **f32), torch.empty(12, **f32), torch.empty(1, device=like.device, dtype=torch.int32),
            torch.empty((m, 3), **f32), torch.empty(m, device=like.device, dtype=torch.int8)]


def epilogue_outputs(like, n, B, flags):
    """The epilogue's outputs for n tokens of B completions (epilogue() writes them): [value, logp, H,
    loss_tok, c, e, lam, n_conf, kept (uint8), Hbar, metrics (12,), status (1,)]."""
    return _outputs(like, n, B, dict(zip(FLAGS, flags))["AGG"] == 5)[:12]


def _bits(x):
    """A float's float64 bits as an int (the kernel reads clip_cov's, kl_cov's ratio so, exactly)."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def epilogue(logp, ent, bad, mask, cu, adv, old, ref, lam, n_conf, num_items, floats, flags, B, roll, outs,
             g_lo=0, g_hi=None, rw=None, hp=None, draws=None, kst=None, vp=None):
    """The epilogue kernel (one launch) on the forward pass's per-token logp, H and flags, writing `outs`
    (epilogue_outputs; its logp and H may be the inputs themselves); pass 2 over completions [g_lo, g_hi)
    (default: all of them). rw: the rollout weights, (n,) per token or (B,) per completion as flags' RW says
    (1, 2; 0: None). hp: the hyper-parameters read by pointer, as flags' HP code says (pipeline/epilogue.py
    hyper; None with HP 0). TOP_ENT (the top-entropy mask): two launches before it, the sort key and its sort
    (top_entropy.sorted_key), on the call's whole batch only (the quantile spans every counted token).
    clip_cov and kl_cov (POLICY 10, 11; kernels/epilogue_cov.py): a launch of the kernel that writes the sort
    keys (and the top-entropy mask's, instead of its key kernel: one sort of both), then the epilogue, on the whole
    batch only; draws: clip_cov's uniform draws (n,) float64. kst: (n, 3) the kept sets' (size, restored,
    mass) that the rules rebuilt (kept_rule_triton), summed into metrics[9:12]. vp: (ids, stats (n, 3), V) where
    logp and ent are a vocabulary split's merged sums (n, 7) and maxima (vp_merge_triton): the kernel finishes
    them, writing the flags into `bad` and the backward's stats (not with the top-entropy mask alone: its key
    reads H first)."""
    fl, fg = dict(zip(FLOATS, floats)), dict(zip(FLAGS, flags))
    if (rw is None) != (fg["RW"] == 0):
        raise ValueError(f"the epilogue's RW = {fg['RW']} and its rollout weights ({rw is not None}) disagree")
    if (hp is None) != (fg["HP"] == 0):
        raise ValueError(f"the epilogue's HP = {fg['HP']} and its hyper-parameter vector ({hp is not None}) disagree")
    cov = fg["POLICY"] >= 10
    if vp is not None and fg["TOP_ENT"] and not cov:
        raise ValueError("the epilogue finishes a vocabulary split's merge only where nothing reads H before it")
    if (fg["TOP_ENT"] or cov) and (g_lo != 0 or g_hi not in (None, B)):
        raise ValueError("the top-entropy mask's quantile (clip_cov's, kl_cov's choice) spans the whole batch: "
                         "no epilogue on a tile alone")
    if (draws is None) != (fg["POLICY"] != 10):
        raise ValueError(f"the epilogue's POLICY = {fg['POLICY']} and its draws ({draws is not None}) disagree")
    n = ent.numel()  # (tokens: with vp, logp holds 7 sums a token)
    # the top-entropy mask's sorted keys (with clip_cov, kl_cov: the key launch writes them, then their sort)
    srt = top_entropy.sorted_key(ent, bad, mask) if fg["TOP_ENT"] and not cov else bad
    value, logp_o, ent_o, ltok, c, e, lam_out, nconf_out, kept, hbar, met, status = outs
    scratch = torch.empty(4 * B, device=logp.device, dtype=torch.float32)
    cu_fix = torch.empty(B + 1, device=logp.device, dtype=torch.int64)
    any_ = bad  # a tensor for the pointers that are not read
    sw = {k: bool(v) if k not in ("NITEMS", "AGG", "POLICY", "RW", "HP") else int(v) for k, v in fg.items()
          if k not in ("TEMP_BY_VALUE", "MAX_SEQLEN")}

    def launch(phase, srt, key, vals, order):
        _epilogue_kernel[(1,)](
            logp, ent, bad, any_ if mask is None else mask, any_ if cu is None else cu,
            adv, *(any_ if x is None else x for x in (old, ref, lam, n_conf, num_items, roll, rw)), srt,
            any_ if hp is None else hp, any_ if draws is None else draws, key, vals, order,
            value, logp_o, ent_o, ltok, c, e, lam_out, nconf_out, kept, hbar, scratch, cu_fix, met, status,
            B, n // B if (B and not fg["PACKED"]) else 0, n, fg["MAX_SEQLEN"], g_lo, B if g_hi is None else g_hi,
            fl["lo"], fl["hi"], fl["delta"], fl["dual_c"], fl["beta"], fl["ent_coef"], fl["penalty"], fl["thr"],
            fl["max_len"], fl["nitems"], fl["sapo_pos"], fl["sapo_neg"], fl["dro_beta"], fl["off_thr"], fl["top_q"],
            fl["k_pos"], fl["lam_pos"], fl["k_neg"], fl["lam_neg"], fl["cov_lb"], fl["cov_ub"], fl["kl_coef"],
            _bits(fl["cov_ratio"]), HAS_MASK=mask is not None, HAS_ROLL=roll is not None, BLOCK=EPILOGUE_BLOCK,
            num_warps=4, enable_fp_fusion=not fg["TOP_ENT"], PHASE=phase, kst_ptr=any_ if kst is None else kst,
            KEPT=kst is not None, **sw, **({} if vp is None else dict(ids_ptr=vp[0], stats_out=vp[1], V_all=vp[2],
                                                                           VP=True)))  # (TOP_ENT: top_entropy.py)

    if not cov:
        launch(0, srt, any_, any_, any_)
        return outs
    # the keys, and the top-entropy mask's as float64 beside them (exact): one sort for both (kl_cov's order
    # descending, the entropies' too then: top_entropy._top_entropy_thr reads them from the end)
    keys = torch.empty((2 if fg["TOP_ENT"] else 1, n), device=logp.device, dtype=torch.float64)
    key, ent_key = keys[0], keys[-1] if fg["TOP_ENT"] else any_
    launch(1, ent_key, key, any_, any_)
    if n:
        vals, order = torch.sort(keys, dim=-1, stable=True, descending=fg["POLICY"] == 11)
        vals, order, srt = vals[0], order[0], vals[-1] if fg["TOP_ENT"] else srt
    else:  # (nothing is read)
        vals, order = key, torch.empty(0, device=logp.device, dtype=torch.int64)
    launch(0, srt, key, vals, order)
    return outs


@torch.library.custom_op("gtpo_kernels::fused_loss", mutates_args=())
def fused_loss(logits3: torch.Tensor, ids: torch.Tensor, mask: Optional[torch.Tensor], cu: Optional[torch.Tensor],
               adv: torch.Tensor, old: Optional[torch.Tensor], ref: Optional[torch.Tensor],
               lam: Optional[torch.Tensor], n_conf: Optional[torch.Tensor], num_items: Optional[torch.Tensor],
               temperature: Optional[torch.Tensor], floats: List[float], flags: List[int], logits_start: int,
               B: int, roll: Optional[torch.Tensor], rw: Optional[torch.Tensor],
               hp: Optional[torch.Tensor], draws: Optional[torch.Tensor], rules: List[Optional[torch.Tensor]],
               rule_values: List[float], given: List[torch.Tensor], inplace: bool = False, tau_seq: int = 0,
               id_start: int = 0, vocab: int = 0) -> List[torch.Tensor]:
    """tau_seq: temperature holds one tau per completion (1 padded, 2 packed: found in cu), read by the
    vocabulary kernels at each token's completion. given (the vocabulary split over ranks, spec 12: the op
    launches the epilogue alone; no rules then): [] none; the forward's [logp, H, stats (n, 3), flags] made
    outside the op (vocab_parallel.vp_forward), the stats and flags returned empty (the given ones are saved
    for the backward); or the merge's [sums (n, 7), maxima (n,)] (vocab_parallel.vp_sums), which the epilogue
    finishes (vocab: the whole vocabulary's size, for the flags). id_start: the backward's ids less it are the
    logits' (the slice's)."""
    fl, fg = dict(zip(FLOATS, floats)), dict(zip(FLAGS, flags))
    n, given = ids.numel(), given or None
    outs = _outputs(logits3, n, B, fg["AGG"] == 5, given is None or len(given) == 2) + _keep_outputs(
        logits3, n, rules, rule_values)
    value, logp, ent, ltok, c, e, lam_out, nconf_out, kept, hbar, met, status, stats, bad, t_s, t_id = outs
    tau = fl["tau"] if fg["TEMP_BY_VALUE"] else temperature
    kst = keep = None
    rule_args = _given_rules(rules, rule_values)
    if given is not None:  # the forward made outside: the epilogue alone
        if rule_args is not None:
            raise ValueError("fused_loss: the forward's statistics given, no rules (their kept sets shape it)")
        logp, ent, stats, bad = given if len(given) == 4 else (*given, stats, bad)
    elif rule_args is not None:  # the kept sets as thresholds: one launch (kernels/kept_rule_triton.py)
        t_s, t_id, kst = kept_rule_triton.kept_thresholds(logits3, ids, mask, tau, logits_start, *rule_args,
                                                          outs=(t_s, t_id), tau_seq=tau_seq,
                                                          cu=cu if tau_seq == 2 else None)
        keep = (t_s, t_id)
    if n and given is None:
        vocab_triton.vocab_fwd(logits3, ids, mask, tau, logits_start, outs=(logp, ent, stats, bad), keep=keep,
                               tau_seq=tau_seq, cu=cu if tau_seq == 2 else None)
    merged = given is not None and len(given) == 2  # (the epilogue finishes the merge)
    epilogue(logp, ent, bad, mask, cu, adv, old, ref, lam, n_conf, num_items, floats, flags, B, roll, outs[:12],
             rw=rw, hp=hp, draws=draws, kst=kst, vp=(ids, stats, vocab) if merged else None)
    return outs


def _given_rules(rules, rule_values):
    """top_k, top_p, min_p as kept_thresholds takes them, each its tensor, its number (rule_values: NaN where
    none is given by value) or None; None when no rule is given."""
    given = [x if x is not None else (None if v != v else v) for x, v in zip(rules, rule_values)]
    return None if all(x is None for x in given) else given


def _keep_outputs(like, n, rules, rule_values):
    """fused_loss's t_s (n,) float32 and t_id (n,) int64, empty without rules."""
    m = n if _given_rules(rules, rule_values) is not None else 0
    return [torch.empty(m, device=like.device, dtype=torch.float32), torch.empty(m, device=like.device,
                                                                             dtype=torch.int64)]


@fused_loss.register_fake
def _(logits3, ids, mask, cu, adv, old, ref, lam, n_conf, num_items, temperature, floats, flags, logits_start, B,
      roll, rw, hp, draws, rules, rule_values, given, inplace=False, tau_seq=0, id_start=0, vocab=0):
    return _outputs(logits3, ids.numel(), B, dict(zip(FLAGS, flags))["AGG"] == 5, len(given) != 4) + _keep_outputs(
        logits3, ids.numel(), rules, rule_values)


def _setup_context(ctx, inputs, output):
    logits3, ids, *_rest = inputs
    temperature, floats, flags, logits_start = inputs[10:14]
    fl, fg = dict(zip(FLOATS, floats)), dict(zip(FLAGS, flags))
    _value, _logp, ent, _ltok, c, e, *_more = output
    given, inplace, tau_seq, id_start = inputs[21:25]  # (the defaults filled in)
    stats = given[2] if len(given) == 4 else output[12]
    keep = output[14:16] if output[14].numel() else (None, None)
    ctx.save_for_backward(logits3, ids, stats, ent, c, e if fg["HAS_E"] else None, temperature, *keep,
                          inputs[3] if tau_seq == 2 else None)  # (a tau per completion, packed: cu_seqlens)
    ctx.meta = (logits_start, fl["tau"] if fg["TEMP_BY_VALUE"] else 1.0, inplace, tau_seq, id_start)
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # no zero gradients made for the outputs without one


def _backward(ctx, grads):
    grad = grads[0]  # the loss value's; the other outputs are not differentiable
    # one None per other input as given (inplace at its default is none; a list of tensors, the rules, is a list)
    rest = tuple([None] * len(n) if isinstance(n, (list, tuple)) else None for n in ctx.needs_input_grad[1:])
    if grad is None or not ctx.needs_input_grad[0]:  # (frozen logits are never written over)
        return (None,) + rest
    logits3, ids, stats, ent, c, e, temperature, t_s, t_id, cu = ctx.saved_tensors
    logits_start, tau_value, inplace, tau_seq, id_start = ctx.meta
    g = grad.reshape(-1)
    kw = dict(backend="triton", g=g, tau_value=tau_value, keep_s=t_s, keep_id=t_id, tau_seq=tau_seq, cu=cu,
              id_start=id_start)
    if inplace:  # the gradient written over the logits (a fresh view: autograd takes it as .grad, no copy)
        ops.vocab_bwd_inplace(logits3, ids, stats, ent, c, e, temperature, logits_start, **kw)
        return (logits3.view(logits3.shape),) + rest
    return (ops.vocab_bwd(logits3, ids, stats, ent, c, e, temperature, logits_start, **kw),) + rest


fused_loss.register_autograd(_backward, setup_context=_setup_context)


_COUNTERS = threading.local()  # per thread: {(device, stream): the status word's launch counter}


def _counter(device):
    """(counter, key): the int64 counter the forward kernel's status word needs (vocab_fwd_triton._fold_status),
    one per thread and stream of the device, zeroed once when made (one launch, on the first validating
    call) and left 0 by every launch after."""
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None)
    table = _COUNTERS.__dict__.setdefault("table", {})
    if key not in table:
        table[key] = torch.zeros(1, device=device, dtype=torch.int64)
    return table[key], key


@torch.library.custom_op("gtpo_kernels::token_logps", mutates_args=())
def token_logps(logits3: torch.Tensor, ids: torch.Tensor, mask: Optional[torch.Tensor],
                temperature: Optional[torch.Tensor], tau_value: float, logits_start: int, status: bool = False,
                mask_values: bool = False, cu: Optional[torch.Tensor] = None,
                max_seqlen: int = -1, top_k: Optional[torch.Tensor] = None, top_p: Optional[torch.Tensor] = None,
                min_p: Optional[torch.Tensor] = None, rule_values: Optional[List[float]] = None,
                tau_per_seq: bool = False) -> List[torch.Tensor]:
    """token_logprobs in one launch: [logp, H, flags, status word], 0 where not counted, NaN at a flagged
    token. status: the launch writes the word, (1,) int32, the number of tokens that failed a check (their
    flags, a counted token's tau not finite and > 0 among them; with mask_values a mask value other than 0
    and 1; given cu, the packed form's cu_seqlens malformed or longer than max_seqlen >= 0:
    kernels/vocab_status.py); else it is left unset, and a malformed cu flags every counted token. top_k,
    top_p, min_p, rule_values: the kept sets rebuilt by the rules as fused_loss takes them (one launch more:
    kernels/kept_rule_triton.py; an invalid rule flags its token). tau_per_seq: temperature holds one tau per
    completion, read by each token at its completion (packed: cu given, found in it), not one per token."""
    n = ids.numel()
    f32 = dict(device=logits3.device, dtype=torch.float32)
    outs = (torch.empty(n, **f32), torch.empty(n, **f32), torch.empty((n, 3), **f32),
            torch.empty(n, device=logits3.device, dtype=torch.int8))
    word = torch.empty(1, device=logits3.device, dtype=torch.int32)
    if n == 0:
        return [outs[0], outs[1], outs[3], word.zero_() if status else word]
    meta = {} if cu is None else dict(cu_ptr=cu, n_seq=cu.numel() - 1, max_seqlen=max_seqlen, CU_NAN=not status)
    if status:
        work, key = _counter(logits3.device)
        meta.update(status_ptr=word, work_ptr=work, HAS_STATUS=True, MASK_VALUES=mask_values and mask is not None,
                    CU_CHECK=cu is not None)
    tau_seq = (2 if cu is not None else 1) if tau_per_seq else 0
    meta.update(vocab_triton._per_seq(tau_seq, cu, temperature))
    B, _, V = logits3.shape
    tau = tau_value if temperature is None else temperature
    given = None if rule_values is None else _given_rules((top_k, top_p, min_p), rule_values)
    if given is not None:
        t_s, t_id, _kst = kept_rule_triton.kept_thresholds(logits3, ids, mask, tau, logits_start, *given,
                                                           stats=False, tau_seq=tau_seq,
                                                           cu=cu if tau_seq == 2 else None)
        meta.update(keep_s_ptr=t_s, keep_id_ptr=t_id, KEEP=True)
    try:
        vocab_triton._launch(logits3, ids, mask, outs, n // B, V, logits_start, tau, 1.0, None,
                             vocab_triton.fwd_block_v(V), NAN_FLAGGED=True, **meta)
    except BaseException:
        if status:  # a launch cut short may leave the counter nonzero: the next call makes a new one
            _COUNTERS.table.pop(key, None)
        raise
    return [outs[0], outs[1], outs[3], word]


@token_logps.register_fake
def _(logits3, ids, mask, temperature, tau_value, logits_start, status=False, mask_values=False, cu=None,
      max_seqlen=-1, top_k=None, top_p=None, min_p=None, rule_values=None, tau_per_seq=False):
    n = ids.numel()
    return [logits3.new_empty(n, dtype=torch.float32), logits3.new_empty(n, dtype=torch.float32),
            logits3.new_empty(n, dtype=torch.int8), logits3.new_empty(1, dtype=torch.int32)]


# called eagerly without torch.library's per-call Python (kernels/eager.py)
fused_loss = eager(fused_loss, _backward, _setup_context)
token_logps = eager(token_logps)
