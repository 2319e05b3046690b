"""The loss on logits in three launches (spec 8, "One pass in the call, too"): the forward vocabulary
kernel, the epilogue kernel (every O(B) / O(N) step, the outputs and the metrics), and in backward the
gradient kernel reading the upstream gradient by pointer (kernels/loss_ops.py). Autograd's seed of a
scalar loss (`ones_like`) is the fourth launch of a forward + backward.

It takes the Triton backend on one process, for the PPO-clip policy term at the token or the sequence
level (GTPO and the TRL-family presets grpo, dapo, dr_grpo, bnpo, gspo, luspo, gtpo-official, and verl's
vanilla), the token-level terms cispo, sapo, gpg, verl_cispo, dro, dppo_tv and dppo_kl, verl's geo_mean
and TRL's vespo (a completion's log R, its phi, formed in pass 1: kernels/epilogue_geo.py), verl's clip_cov
and kl_cov (a choice over the batch's covariances: a key launch of the kernel and a sort before it, and
clip_cov's uniform draws: kernels/epilogue_cov.py), with any
aggregation, conflict weights given or computed, old / ref log-probs, the KL (and its bias correction),
the entropy filter, gate, penalty and bonus, the off-policy sequence mask (spec 9), the top-entropy mask
(spec 9: two launches more, the entropies' sort key and torch.sort; kernels/top_entropy.py), rollout weights
per token or per completion, num_items_in_batch (number or tensor), a temperature (number, schedule tensor,
per completion or per token), the hyper-parameters a schedule may give as 0-d tensors (HP_SLOTS: read by
pointer, see hyper; the entropy filter's threshold too, and its gate formed on the device: _gate), and the
sampler's kept sets rebuilt by top_k / top_p / min_p (one launch more before the forward kernel writes each
token's set as a threshold, which both vocabulary kernels read: kernels/kept_rule_triton.py), inplace=True
(the backward kernel writes over the logits). Recorded kept sets take logps_epilogue, vocabulary-parallel
logits epilogue_attached; vespo's, clip_cov's and kl_cov's numbers as tensors the eager loss.fused_loss.
Validating, the status word is read with the call's input checks: one host read.
"""
from __future__ import annotations

import numbers

import torch

from ..core import checks
from ..core.config import is_zero
from ..core.output import GTPOOutput
from ..kernels import loss_ops, ops
from ..kernels.epilogue_triton import AGGS, POLICIES
from ..objective import mismatch, verl_modes
from .loss import warn_all_dropped

_NUMBERS = ("max_completion_length",)  # a number (or None) only
# the hyper-parameters the kernel also takes as 0-d floating tensors (GTPOConfig: a schedule the trainer
# updates in place, or initial_entropy measured on the device): see hyper
_GENERAL = ("eps_low", "eps_high", "delta", "dual_clip_c", "beta", "entropy_coef", "entropy_penalty",
            "off_policy_mask_threshold", "top_entropy_quantile", "entropy_threshold", "initial_entropy")
# hyper-parameters of one policy term only (read, and checked, with that term: sapo's and dro's may be 0-d
# tensors too, vespo's are numbers)
_TERM_NUMBERS = {"sapo": ("sapo_temperature_pos", "sapo_temperature_neg"), "dro": ("dro_beta",),
                 "vespo": ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
                 "clip-cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
                 "kl-cov": ("kl_cov_ratio", "ppo_kl_coef")}
_TENSOR_OK = _GENERAL + _TERM_NUMBERS["sapo"] + _TERM_NUMBERS["dro"]
# the kernel's float slots the hyper-parameters fill (_slots), in the order of its HP code (4 bits a slot)
HP_SLOTS = ("lo", "hi", "delta", "dual_c", "beta", "ent_coef", "penalty", "sapo_pos", "sapo_neg", "dro_beta",
            "off_thr", "top_q", "thr")


def _number(x, tensor_ok=False):
    if tensor_ok and isinstance(x, torch.Tensor):  # (the kernel forms it as float32 or float64: _slots)
        return x.dim() == 0 and x.dtype in (torch.float32, torch.float64)
    return x is None or (isinstance(x, numbers.Real) and not isinstance(x, bool))


def eligible(logits, cfg, backend, kept_sets, process_group):
    """Whether the call takes the three-launch path (see the module docstring), from its arguments (before
    the batch is prepared: the path prepares it without the device-side checks, which the kernel makes)."""
    if not isinstance(logits, torch.Tensor) or logits.dtype == torch.float64:
        return False
    try:
        from ..kernels import dispatch
        backend = dispatch.resolve_backend(backend, logits.device, logits.dtype)
    except (ValueError, TypeError, RuntimeError):  # raised where the call resolves it
        return False
    return backend == "triton" and process_group is None and not kept_sets and covers(cfg)


def covers(cfg):
    """Whether the epilogue kernel computes this config's loss: a policy term of POLICIES (the PPO clip at
    the token or the sequence level; cispo, sapo, gpg, verl_cispo, dro, dppo_tv, dppo_kl, geo_mean, vespo,
    clip_cov and kl_cov at the token level, the only one the config admits for them), vespo's, clip_cov's
    and kl_cov's numbers as numbers, the other hyper-parameters (the entropy filter's included) as numbers or
    0-d tensors (the fused LM head asks too). Rollout weights multiply each of these terms but geo_mean and
    vespo, which fold them into their ratio and weight."""
    pl = cfg.policy_loss
    return (pl in POLICIES and (pl == "ppo" or cfg.importance_sampling_level == "token")
            and all(_number(getattr(cfg, k), k in _TENSOR_OK) for k in _NUMBERS + _GENERAL + _TERM_NUMBERS.get(pl, ())))


# HP_SLOTS' forms: the eager path uses the hyper-parameter x itself, or 1 - x (the PPO clip's lower bound,
# the top-entropy mask's quantile), or 1 + x (the clip's upper bound): in x's own dtype, then cast to float32
SAME, ONE_MINUS, ONE_PLUS = 0, 1, 2
PPO_BOUNDS = 1 << 52  # HP's bit for lo and hi as 1 - eps_low, 1 + eps_high (ppo, verl_cispo)
GATE_SHIFT = 56  # HP's bits 56..59: the entropy filter's gate as a device tensor, its index in hp + 1 (_gate)


def _form(x, f):
    return x if f == SAME else (1.0 - x if f == ONE_MINUS else 1.0 + x)


def _slots(cfg):
    """HP_SLOTS' values as (x, f): the hyper-parameter x (a number or a 0-d tensor) and f, the form the eager
    path uses (policy.ppo's operand(1.0 - cfg.eps_low, r)). The kernel forms a tensor's in float64 and
    rounds it to float32, which for a float32 or float64 x is the eager value (1 +- x of a float32 x is
    exact in float64, or rounds to 1 both ways); a half-precision one stays eager (covers)."""
    pl = cfg.policy_loss
    lo, hi = (0.0, SAME), (0.0, SAME)  # (lo, hi) unused by sapo, gpg and dro
    if pl == "cispo":  # cispo's bound on the ratio is eps_high itself; dppo's trust region the eps
        hi = (cfg.eps_high, SAME)
    elif pl in ("dppo-tv", "dppo-kl", "geo-mean"):  # (geo_mean: log r clipped to [-eps_low, eps_high])
        lo, hi = (cfg.eps_low, SAME), (cfg.eps_high, SAME)
    elif pl in ("ppo", "verl-cispo", "clip-cov"):
        lo, hi = (cfg.eps_low, ONE_MINUS), (cfg.eps_high, ONE_PLUS)
    sapo = pl == "sapo"
    given = (cfg.delta, cfg.dual_clip_c, cfg.beta, cfg.entropy_coef, cfg.entropy_penalty,
             cfg.sapo_temperature_pos if sapo else 1.0, cfg.sapo_temperature_neg if sapo else 1.0,
             cfg.dro_beta if pl == "dro" else 0.0, cfg.off_policy_mask_threshold)
    thr = cfg.entropy_threshold
    return (lo, hi, *((0.0 if x is None else x, SAME) for x in given), (cfg.top_entropy_quantile, ONE_MINUS),
            (0.0 if thr is None else thr, SAME))


def _gate(cfg, like):
    """The paper's gate (the filter off when initial_entropy > entropy_threshold): None without one, else
    True / False, read on the host from numbers or host tensors (no device sync), or "device" where either
    is a tensor the kernel reads by pointer (_on_device): hyper then appends the eager path's comparison
    itself, a 0-d bool tensor (one launch), and the kernel reads it."""
    thr, init = cfg.entropy_threshold, cfg.initial_entropy
    if thr is None or init is None:
        return None
    return "device" if _on_device(thr, like) or _on_device(init, like) else bool(init > thr)


def _on_device(x, like):
    """A 0-d tensor hyper-parameter the kernel reads by pointer: on `like`'s device, or on another GPU (moved
    there); a host tensor with device inputs goes by value (read without a device sync, as torch takes a
    CPU scalar)."""
    return isinstance(x, torch.Tensor) and not (x.device.type == "cpu" and like.device.type != "cpu")


def hyper(cfg, like):
    """hp: the hyper-parameters the kernel reads by pointer (_on_device) as given, one vector in HP_SLOTS'
    order, then the gate if a device tensor (_gate) (no launch for one tensor; else one cat, in the widest
    dtype), or None."""
    dev = [x.to(like.device).reshape(1) for x, _ in _slots(cfg) if _on_device(x, like)]
    if _gate(cfg, like) == "device":
        dev.append((cfg.initial_entropy > cfg.entropy_threshold).to(like.device).reshape(1))
    return None if not dev else (dev[0] if len(dev) == 1 else torch.cat(dev))


def _slot_values(cfg, like):
    """(values, code): HP_SLOTS' values for the kernel's float arguments (0.0 where read by pointer), and its
    HP code: slot k at bits 4k..4k+3 (0 by value, else its index in hyper's vector + 1), and PPO_BOUNDS (with
    a slot read by pointer: HP 0 is no hp), and the gate's index + 1 at GATE_SHIFT."""
    values, code, j = [], 0, 0
    slots = _slots(cfg)
    for k, (x, f) in enumerate(slots):
        if _on_device(x, like):
            j += 1
            code |= j << (4 * k)
            values.append(0.0)
        else:
            values.append(float(_form(x, f)))
    if _gate(cfg, like) == "device":
        code |= (j + 1) << GATE_SHIFT
    return values, code | (PPO_BOUNDS if code and slots[0][1] == ONE_MINUS else 0)


def _tau(t, like):
    """(tensor or None, the number by value): a Python number goes by value, a tensor as the Triton kernels
    read it (ops.temperature_param: float32 on like's device)."""
    if isinstance(t, torch.Tensor):
        return ops.temperature_param(t, like, "triton").reshape(-1), 1.0
    return None, float(t)


def arguments(b, cfg, num_items, tau_value, host, has_temperature=True):
    """The epilogue's (floats, flags) for this call, in the order loss_ops.FLOATS / FLAGS name them: the
    hyper-parameters by value and the kernel's switches. host: validating in the kernel (the input checks
    into the status word)."""
    thr, gate = cfg.entropy_threshold, _gate(cfg, b.given["adv"])  # the paper's gate: the filter off
    gate = gate is True  # ("device": the kernel reads it, FILTER stays on)
    n_items = num_items if isinstance(num_items, torch.Tensor) else None
    has_kl = b.ref is not None and not is_zero(cfg.beta)  # (a tensor is never assumed 0)
    pl = cfg.policy_loss
    ppo = pl in ("ppo", "clip-cov")  # the clip, delta: the PPO term's options (the dual clip: theirs, dppo's cap)
    v, code = _slot_values(cfg, b.given["adv"])  # HP_SLOTS: FLOATS' lo .. penalty, then sapo_pos .. top_q
    vespo = [cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg, cfg.vespo_lambda_neg] if pl == "vespo" else [0] * 4
    floats = [tau_value, *v[:7], v[12], float(cfg.max_completion_length or 0),
              float(num_items) if isinstance(num_items, float) else 1.0, *v[7:12], *(float(x) for x in vespo),
              float(cfg.clip_cov_lb), float(cfg.clip_cov_ub), float(cfg.ppo_kl_coef),
              float(cfg.kl_cov_ratio if pl == "kl-cov" else cfg.clip_cov_ratio)]
    flags = [b.packed, b.old is not None, has_kl, has_kl and cfg.use_bias_correction_kl, b.lam is not None,
             b.n_conf is not None, 0 if num_items is None else (2 if n_items is not None else 1), cfg.clip and ppo,
             cfg.delta is not None and ppo, cfg.dual_clip_c is not None, not is_zero(cfg.entropy_coef),
             thr is not None and not gate, not is_zero(cfg.entropy_penalty),
             cfg.importance_sampling_level == "sequence",
             AGGS.index(cfg.loss_agg), not has_temperature, host,
             host and b.mask is not None and b.mask.dtype != torch.bool, b.ref is not None, POLICIES.index(pl),
             2 if b.rollout_w_seq is not None else int(b.rollout_w is not None),
             cfg.off_policy_mask_threshold is not None, cfg.top_entropy_on, code, b.token_adv is not None,
             -1 if b.max_seqlen is None else b.max_seqlen]
    return floats, [int(f) for f in flags]


def tensors(b, cfg, host=False):
    """The tensors the epilogue reads, with stride 1 (a copy only if they are not): the caller's mask, the
    advantages (b.token_adv: one per token) and cu_seqlens as given (a malformed one is the kernel's to
    flag), old / ref log-probs, lam, n_conf, the rollout log-probs, the rollout weights as flags' RW says:
    per completion (B,) (never spread on the tokens), per token (N,), or None, the hyper-parameters read by
    pointer (hyper; flags' HP code), and clip_cov's uniform draws (N,) (verl_modes.uniform_draws: one
    launch) or None. host: the kernel validates, so the generator's state before the draws is kept on b."""
    given, adv = b.given, b.given["adv"] if b.token_adv is None else b.token_adv
    rw = b.rollout_w_seq if b.rollout_w_seq is not None else b.rollout_w
    return [None if x is None else x.contiguous() for x in (b.mask, adv, b.old, b.ref, b.lam, b.n_conf,
                                                            given["cu_seqlens"], b.rollout_logps, rw)] + [
        hyper(cfg, given["adv"]), draws(b, cfg, given["ids"].numel(), given["adv"].device, host)]


def draws(b, cfg, n, device, host=False):
    """clip_cov's uniform draws for n tokens, drawn as its eager path draws them, or None. host (the kernel
    validates): the generator's state before them is kept as b.undraw, which _report calls when the
    inputs fail their checks, since the eager path checks its inputs before it draws."""
    if cfg.policy_loss != "clip-cov":
        return None
    if host:
        gen = verl_modes.draw_generator(cfg, device)
        state = gen.get_state()
        b.undraw = lambda: gen.set_state(state)
    return verl_modes.uniform_draws(cfg, n, device)


def loss(b, cfg, num_items, tau, host, revalidate=None, rules=None, inplace=False, per_seq=False):
    """GTPOOutput of the call; validating, the status word joins the call's pending checks (one host read):
    the kernel makes the input checks too (the batch was prepared without them), and when one fails
    `revalidate()` runs them on the host to raise the error that names the argument. rules: (top_k, top_p,
    min_p) as replay.check_rules gives them (numbers or (n,) tensors, None off): the sampler's kept sets
    rebuilt in one launch more (kernels/kept_rule_triton.py), spec 13's metrics with the loss's (inplace: above)."""
    temperature, tau_value = _tau(cfg.temperature if tau is None else tau, b.logits3)
    floats, flags = arguments(b, cfg, num_items, tau_value, host, temperature is not None)
    mask, adv, old, ref, lam, n_conf, cu, roll, rw, hp, u = tensors(b, cfg, host)
    n_items = num_items if isinstance(num_items, torch.Tensor) else None
    outs = loss_ops.fused_loss(b.logits3, b.given["ids"], mask, cu, adv, old, ref, lam, n_conf, n_items,
                               temperature, floats, flags, b.logits_start, b.B, roll, rw, hp, u, *rule_args(rules), [],
                               inplace, 0 if not per_seq else 2 if b.packed else 1)  # (per_seq: tau is (B,))
    out = output(outs[:12], outs[13], b, cfg, host, revalidate)
    if rules is None:
        return out
    met = outs[10]
    return with_metrics(out, dict(mean_kept_size=met[9], replay_restored_frac=met[10], kept_mass=met[11]))


def rule_args(rules):
    """(tensors, numbers): top_k, top_p, min_p as the custom ops take them, a tensor or None, and a number
    by value or NaN (not given by value)."""
    rules = rules or (None,) * 3
    return ([x if isinstance(x, torch.Tensor) else None for x in rules],
            [float("nan") if x is None or isinstance(x, torch.Tensor) else float(x) for x in rules])


def with_metrics(out, replay_metrics):
    """spec 13's replay metrics after the loss's own, before spec 14's rollout ones (the eager order)."""
    if replay_metrics:
        m = out.metrics
        own = ("clip_frac", "filtered_frac", "conflict_frac", "mean_entropy")
        out.metrics = {**{k: m[k] for k in own}, **replay_metrics, **{k: v for k, v in m.items() if k not in own}}
    return out


def output(outs, bad, b, cfg, host, revalidate=None):
    """GTPOOutput from the epilogue's outputs (loss_ops.epilogue_outputs) and the forward's flags `bad`;
    host: the status word read once (see loss)."""
    value, logp, ent, ltok, _c, _e, lam, n_conf, kept, hbar, met, status = outs
    if host:  # (the word as read: a warning or an error costs no read more)
        checks.check_on_device(status[0], lambda word: _report(word, bad, b, cfg.entropy_threshold, revalidate),
                               with_value=True)
    shape = b.tok_shape
    metrics = dict(clip_frac=met[0], filtered_frac=met[1], conflict_frac=met[2], mean_entropy=met[3])
    if b.rollout_logps is not None:  # spec 14
        metrics.update(zip(mismatch.NAMES, met[4:9].unbind()))
    return GTPOOutput(loss=value.reshape(shape) if cfg.loss_agg == "none" else value, logps=logp.reshape(shape),
                      entropy=ent.reshape(shape), per_token_loss=ltok.reshape(shape), lam=lam.reshape(shape),
                      n_conf=n_conf, kept=kept.view(torch.bool), seq_entropy=hbar, metrics=metrics)


def _report(word, bad, b, thr, revalidate):
    """A nonzero status word: the input checks run again on the host and raise the first that fails (an
    id out of range included), then a flagged counted row raises (checks.raise_on_flags names it; bad None:
    the flags were input checks); the entropy filter having dropped every completion warns. Where the host
    checks pass (a float64 value the kernels saw overflow float32, which the eager path takes too), the
    outputs are the NaN the eager path gives."""
    word = int(word)
    if word & 5 and revalidate is not None:
        try:
            revalidate()
        except BaseException:
            getattr(b, "undraw", lambda: None)()  # clip_cov's draws undone: the eager path checks first
            raise
    if word & 1 and bad is not None:
        checks.raise_on_flags(bad, b.tok_shape)
    if word & 2:
        warn_all_dropped(thr)


def token_logps(b, temperature, host, revalidate=None, rules=None, per_seq=False):
    """token_logprobs on the Triton backend in one launch: (logps, entropy) of the tokens' shape. Validating, the
    kernel also writes a status word (the tokens' flags; with `revalidate`, the batch prepared without its
    device-side checks, the mask values, ids and cu_seqlens too), read with the call's pending checks (one host
    read); nonzero, _report_tokens raises the host checks' error. Not validating, the kernel reads the given ids
    and cu_seqlens (malformed: NaN at every counted token, as on the eager path). rules: the kept sets rebuilt
    by top_k, top_p, min_p: one launch more. per_seq: temperature is (B,), read at each token's completion."""
    tau, tau_value = _tau(temperature, b.logits3)
    mask = None if b.mask is None else b.mask.contiguous()
    given = revalidate is not None or not host  # the given tensors, checked in the kernel (or NaN there)
    values = revalidate is not None and mask is not None and mask.dtype != torch.bool
    cu = b.given["cu_seqlens"].contiguous() if b.packed and (given or per_seq) else None
    ids = b.given["ids"] if given else b.ids
    rule_t, rule_v = rule_args(rules)
    # (forward only: the logits detached, so that torch.compile traces the op without an autograd formula)
    logp, ent, bad, status = loss_ops.token_logps(b.logits3.detach(), ids, mask, tau, tau_value, b.logits_start, host, values,
                                                  cu, -1 if b.max_seqlen is None else b.max_seqlen, *rule_t, rule_v, per_seq)
    if host:
        checks.check_on_device(status, lambda: _report_tokens(bad, b, revalidate))
    return logp.reshape(b.tok_shape), ent.reshape(b.tok_shape)


def _report_tokens(bad, b, revalidate):
    """token_logprobs' nonzero status word: the input checks run on the host (revalidate) and raise the first
    that fails (a mask value, an id out of range), else the first flagged counted row raises
    (checks.raise_on_flags names it)."""
    if revalidate is not None:
        revalidate()
    checks.raise_on_flags(bad, b.tok_shape)
