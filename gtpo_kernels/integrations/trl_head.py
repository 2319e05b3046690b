"""The TRL adapter's LM head: the loss and the old-policy / reference log-probs without the logits.

The fused passes hand their head to the model's backbone-only forward, `model(..., gtpo_head=fn)` (trl_forward):
- `_fused_loss`: `linear_gtpo_loss` on the hidden states before the completion tokens (`_completion_rows`,
  a view) in the head's compute dtype (`_head_dtypes`), a tile of `_memory_budget` bytes at a time;
- `_logits_loss`: gtpo_head='logits', for debugging: the model's logits (logits_to_keep = T + 1), gtpo_loss;
- `_fused_logps_and_entropies`: TRL's old-policy / reference pass through `linear_token_logprobs`, in
  TRL's row chunks (`GTPOTrainer._get_per_token_logps_and_entropies` chooses it or TRL's own);
  `_logits_logps_and_entropies`: the same pass with gtpo_head='logits' and kept sets on (the model's
  logits and `token_logprobs`).
Every pass takes the same kept-set keywords (trl_sampler._replay_kwargs: the sampler's top_k / top_p /
min_p, or the rollout's recorded sampling_mask), so old, reference and current log-probs are over the
sampler's sets (spec 13).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from .. import gtpo_loss, linear_gtpo_loss, linear_token_logprobs, token_logprobs
from .trl_sampler import _replay_kwargs


def _completion_rows(hidden, T):
    """The rows predicting the last T tokens: positions L-T-1 .. L-2 of (B, L, D), a view."""
    L = hidden.size(1)
    if L < T + 1:
        raise RuntimeError(f"the backbone returned {L} positions for {T} completion tokens")
    return hidden[:, L - T - 1:L - 1]


def _head_dtypes(hidden, weight, bias, fp32):
    """The head's compute dtype, as TRL's fused head: float32 with cast_lm_head_to_fp32, else autocast's
    dtype when autocast is on, else the hidden states'. Returns hidden, weight, bias in it and a context
    that turns autocast off for the call (the kernels choose their own accumulation dtypes)."""
    dev = hidden.device.type
    on = torch.is_autocast_enabled(dev)
    dt = torch.float32 if fp32 else (torch.get_autocast_dtype(dev) if on else hidden.dtype)

    def cast(x):
        return x if x is None or x.dtype == dt else x.to(dt)
    return cast(hidden), cast(weight), cast(bias), (torch.autocast(dev, enabled=False) if on else nullcontext())


def _memory_budget(budget, hidden, weight):
    """gtpo_memory_budget, or by default TRL's fused-head tile (4096 tokens x min(V, 32768) vocabulary
    entries in the compute dtype) for the tile and its gradient: no tile holds more logits than TRL's."""
    if budget is not None:
        return int(budget)
    try:
        from trl.kernels.chunked_logprob import TOKEN_CHUNK_SIZE as tokens
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as vocab
    except ImportError:  # pragma: no cover - another TRL: its 1.16 values
        tokens, vocab = 4096, 32768
    return 2 * int(tokens) * min(int(vocab), weight.shape[0]) * hidden.element_size()


def _zero3():
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:  # pragma: no cover
        return False
    return bool(is_deepspeed_zero3_enabled())


def _fused_loss(trainer, model, model_kwargs, inputs, mask, T, loss_kw):
    """The model's backbone-only forward with linear_gtpo_loss as its head -> (the loss's output, the
    _HeadOutput, whose aux_loss is the MoE load-balancing loss). Inside the model's forward (as TRL's fused head: FSDP / ZeRO-3 / DDP hooks armed),
    the hidden states of the T positions before each completion token and the LM head's weight go to
    linear_gtpo_loss, a tile of logits at a time."""
    fp32 = bool(getattr(trainer.args, "cast_lm_head_to_fp32", False))
    completion_ids = inputs["completion_ids"]

    def head(hidden, weight, bias, logit_scale, logit_softcap):
        h = _completion_rows(hidden, T)
        h, w, b, no_autocast = _head_dtypes(h, weight, bias, fp32)
        dev = w.device
        budget = _memory_budget(trainer.gtpo_memory_budget, h, w)
        kw = {k: _to(v, dev) for k, v in loss_kw.items()}
        # ZeRO-3 re-partitions the weight after the forward: only the schedule that forms the
        # gradient in the forward can run there
        schedule = "fused" if _zero3() else "auto"
        try:
            with no_autocast, _head_replays(kw):
                return linear_gtpo_loss(h, w, completion_ids.to(dev), inputs["advantages"].to(dev),
                                        mask.to(dev), bias=b, logit_scale=logit_scale,
                                        logit_softcap=logit_softcap, memory_budget=budget,
                                        schedule=schedule, **kw)
        except ValueError as e:
            if schedule == "fused" and "schedule='fused'" in str(e):
                raise ValueError("under DeepSpeed ZeRO-3 the fused LM head needs a loss whose gradient "
                                 "is formed in the forward (" + str(e) + "); set gtpo_head='logits' "
                                 "or raise gtpo_memory_budget") from e
            raise

    with trainer.accelerator.autocast():
        outputs = model(**model_kwargs, gtpo_head=head)
    return outputs.value, outputs


def _to(v, dev):
    """A tensor, or a sampling_mask pair of them, on `dev`."""
    if isinstance(v, torch.Tensor):
        return v.to(dev)
    if isinstance(v, tuple):
        return tuple(_to(x, dev) for x in v)
    return v


class _head_replays:
    """Around a fused-head call with kept-set keywords: a head that does not replay the sampler's kept
    sets yet (a "does not replay" ValueError, or no such keyword) is reported with the adapter's way out."""

    def __init__(self, kw):
        self.given = [k for k in ("sampling_mask", "top_k", "top_p", "min_p") if kw.get(k) is not None]

    def __enter__(self):
        return self

    def __exit__(self, typ, e, tb):
        if not self.given or e is None:
            return False
        msg = str(e)
        if (typ is ValueError and "does not replay" in msg) or (typ is TypeError and "unexpected keyword" in msg):
            raise NotImplementedError(
                f"the fused LM head does not take the sampler's kept sets ({', '.join(self.given)}) in this "
                f"version of gtpo_kernels ({msg}); set gtpo_head='logits' (the model's logits and gtpo_loss, "
                "which replay them), or turn the sampler's top_k / top_p / min_p off") from e
        return False


def _logits_loss(trainer, model, model_kwargs, inputs, mask, T, loss_kw):
    """gtpo_head='logits' (for debugging): the model's own forward and gtpo_loss on its logits ->
    (the loss's output, the model's outputs)."""
    # Logits of the last T + 1 positions: row t (the position before completion token t) predicts
    # completion token t; the last row predicts past the end and gets a zero gradient.
    with trainer.accelerator.autocast():
        outputs = model(**model_kwargs, logits_to_keep=T + 1, use_cache=False)
    logits = outputs.logits
    logits_start = logits.size(1) - T - 1  # 0 unless the model ignored logits_to_keep
    if logits_start < 0:
        raise RuntimeError(f"the model returned {logits.size(1)} logit rows for {T} completion tokens")
    out = gtpo_loss(logits, inputs["completion_ids"], inputs["advantages"], mask, logits_start=logits_start,
                    **loss_kw)
    return out, outputs


def _fused_logps_and_entropies(trainer, model, input_ids, attention_mask, logits_to_keep, batch_size,
                               compute_entropy, rows=None):
    """TRL's old-policy and reference log-probs (no gradient, text only) through the fused head:
    linear_token_logprobs on the backbone's hidden states, chunked over rows as TRL does, over the
    sampler's kept sets when they are on (rows: the rollout's recorded sets, one per completion) ->
    (logps, entropies or None, None) as TRL 1.16's _get_per_token_logps_and_entropies."""
    fp32 = bool(getattr(trainer.args, "cast_lm_head_to_fp32", False))
    K = logits_to_keep
    tau = trainer.gtpo_config.temperature  # the sampler's (generation_kwargs may override GRPOConfig's)
    all_logps, all_ent = [], []
    for ids, am, replay in _row_chunks(trainer, input_ids, attention_mask, K, batch_size, rows):

        def head(hidden, weight, bias, logit_scale, logit_softcap, ids=ids, am=am, replay=replay):
            h, w, b, no_autocast = _head_dtypes(_completion_rows(hidden, K), weight, bias, fp32)
            dev = w.device
            kw = {k: _to(v, dev) for k, v in replay.items()}
            with no_autocast, _head_replays(kw):
                return linear_token_logprobs(h, w, ids[:, -K:].to(dev), tau, am[:, -K:].to(dev),
                                             bias=b, logit_scale=logit_scale, logit_softcap=logit_softcap,
                                             memory_budget=_memory_budget(trainer.gtpo_memory_budget, h, w),
                                             validate=trainer.gtpo_validate, backend=trainer.gtpo_backend, **kw)

        with trainer.accelerator.autocast():
            lp, ent = model(input_ids=ids, attention_mask=am, gtpo_head=head).value
        trainer._gtpo_logprob_calls += 1
        all_logps.append(lp)
        all_ent.append(ent)
    return torch.cat(all_logps, 0), (torch.cat(all_ent, 0) if compute_entropy else None), None


def _logits_logps_and_entropies(trainer, model, input_ids, attention_mask, logits_to_keep, batch_size,
                                compute_entropy, rows=None):
    """The old-policy and reference pass of gtpo_head='logits' with the sampler's kept sets on, or at a
    temperature other than TRL's args.temperature (generation_kwargs'): the model's logits of the last K + 1
    positions (as _logits_loss) and token_logprobs over the kept sets (none: the vocabulary) at the loss's
    temperature, chunked over rows as TRL does -> (logps, entropies or None, None)."""
    K = logits_to_keep
    tau = trainer.gtpo_config.temperature
    all_logps, all_ent = [], []
    for ids, am, replay in _row_chunks(trainer, input_ids, attention_mask, K, batch_size, rows):
        with trainer.accelerator.autocast():
            logits = model(input_ids=ids, attention_mask=am, logits_to_keep=K + 1, use_cache=False).logits
        logits_start = logits.size(1) - K - 1
        if logits_start < 0:
            raise RuntimeError(f"the model returned {logits.size(1)} logit rows for {K} completion tokens")
        dev = logits.device
        lp, ent = token_logprobs(logits, ids[:, -K:].to(dev), tau, am[:, -K:].to(dev), logits_start=logits_start,
                                 validate=trainer.gtpo_validate, backend=trainer.gtpo_backend,
                                 **{k: _to(v, dev) for k, v in replay.items()})
        trainer._gtpo_logprob_calls += 1
        all_logps.append(lp)
        all_ent.append(ent)
    return torch.cat(all_logps, 0), (torch.cat(all_ent, 0) if compute_entropy else None), None


def _row_chunks(trainer, input_ids, attention_mask, K, batch_size, rows):
    """(ids, attention mask, the kept sets' keyword arguments) of each chunk of rows, as TRL chunks its
    log-prob passes (batch_size rows; None: all)."""
    batch_size = batch_size or input_ids.size(0)
    for start in range(0, input_ids.size(0), batch_size):
        am = attention_mask[start:start + batch_size]
        yield (input_ids[start:start + batch_size], am,
               _replay_kwargs(trainer, None if rows is None else rows[start:start + batch_size], am[:, -K:],
                              am[:, -K:]))
