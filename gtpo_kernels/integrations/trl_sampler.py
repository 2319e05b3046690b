"""The TRL adapter's replay of the sampler's distribution (spec 13): the kept sets of every log-prob pass.

GRPOConfig's `top_k`, `top_p`, `min_p` and `temperature` (an entry of `generation_kwargs` overriding each,
as in TRL's generation) go to every log-prob pass, the loss's and the old-policy / reference passes alike,
as the kept-set keywords (`sampler_settings`; off: top_k None / 0 / -1, top_p 1.0, min_p None / 0.0: the
whole vocabulary, as TRL). The sets are rebuilt from each pass's own logits by vLLM's rules (transformers'
generate applies the same ones for these settings, except min_p with top_p < 1: refused without vLLM,
`_sampler_refusals`). A rollout_func may return the sets the engine recorded, `sampling_mask`: one
(token_ids, offsets) per completion, one set per completion token (vLLM's compressed layout per
completion); they replace the rules in every pass (`_replay_kwargs`, `_flat_sampling_mask`), and travel in
the batch under the same key (a list, which TRL's shuffle and split carry with its rows).

- `sampler_settings`, `_sampler_rules`, `_sampler_refusals`: the settings, the rules that are on, the
  settings whose sets cannot be rebuilt;
- `_recorded_sets`: a rollout_func's `sampling_mask`, taken out of TRL's generation output;
- `_pass_replays`: whether an old-policy / reference pass is over kept sets, refusing those that cannot be;
- `_replay_kwargs`, `_flat_sampling_mask`: the kept-set keywords of one pass.

No TRL import (`gtpo_kernels.integrations.trl` re-exports `sampler_settings`).
"""
from __future__ import annotations

import json

import torch

from ..core.sampling import sampler_rules

# the sampler settings TRL hands both generators (vLLM's SamplingParams, transformers' GenerationConfig);
# generation_kwargs overrides them there (TRL: "they will override them"), and so here
_SAMPLER_FIELDS = ("temperature", "top_k", "top_p", "min_p")


def _generation_kwargs(args) -> dict:
    gen = getattr(args, "generation_kwargs", None) or {}
    if isinstance(gen, str):  # GRPOConfig parses a JSON string itself; a config built otherwise may not
        gen = json.loads(gen)
    return dict(gen)


def sampler_settings(args) -> dict:
    """The distribution TRL's generation samples from, as the replay keywords (spec 13): {temperature,
    top_k, top_p, min_p} from GRPOConfig's fields of those names, generation_kwargs' entries overriding
    them (as TRL passes them to vLLM and to transformers' generate). A rule that is off is None: top_k
    None / 0 / -1 (TRL's and vLLM's "off"), top_p None / 1.0, min_p None / 0.0. Bad values are refused
    naming the field (core.sampling.sampler_rules)."""
    gen = _generation_kwargs(args)
    raw = {f: gen[f] if f in gen else getattr(args, f, None) for f in _SAMPLER_FIELDS}
    return sampler_rules(**raw, name=lambda f: f"generation_kwargs[{f!r}]" if f in gen else f"GRPOConfig.{f}")


def _sampler_refusals(args) -> list:
    """The sampler settings whose kept sets cannot be rebuilt as the generator built them."""
    s = sampler_settings(args)
    if not getattr(args, "use_vllm", False) and s["min_p"] is not None and s["top_p"] is not None:
        return ["min_p together with top_p < 1 under transformers' generate (use_vllm=False): it applies "
                "min-p after top-p, where vLLM (whose order the replay follows: min-p, top-k, top-p) applies "
                "it first, and the kept sets differ; set one of the two, or generate with vLLM"]
    return []


def _sampler_rules(args) -> dict:
    """The kept-set keywords of the sampler's rules that are on (top_k / top_p / min_p), rebuilt in every
    log-prob pass (the temperature is the GTPOConfig's)."""
    return {k: v for k, v in sampler_settings(args).items() if k != "temperature" and v is not None}


def _recorded_sets(out):
    """The `sampling_mask` a rollout_func returned (one (token_ids, offsets) per completion), taken out of the
    reward functions' extra fields of TRL's `_generate` output `out`, as a list; None when there is none."""
    extra = out[5] if isinstance(out, tuple) and len(out) == 8 else None
    if isinstance(extra, dict) and "sampling_mask" in extra:
        return list(extra.pop("sampling_mask"))
    return None


def _pass_replays(trainer, rows, n, trl_own) -> bool:
    """Whether an old-policy / reference pass over `n` completions is over kept sets (the sampler's rules, or
    `rows`, the rollout's recorded sets). trl_own: the pass is TRL's own (over the whole vocabulary), refused
    then with kept sets; recorded sets must hold one entry per completion."""
    replay = bool(trainer.gtpo_replay) or rows is not None
    if trl_own:
        if replay:
            raise NotImplementedError(
                "GTPOTrainer computes log-probs over the sampler's kept sets (top_k / top_p / min_p or a "
                "sampling_mask) in the no-gradient, text-only passes of TRL 1.16 only; this call (a gradient, "
                "the MoE aux loss, multimodal inputs or another TRL's arguments) would be over the whole "
                "vocabulary")
        return False
    if rows is not None and len(rows) != n:
        raise ValueError(f"the rollout's sampling_mask has {len(rows)} entries for {n} "
                         f"completions: one (token_ids, offsets) per completion")
    return replay


def _replay_kwargs(trainer, rows, completion_mask, counted) -> dict:
    """The kept-set keywords of one log-prob pass (spec 13): the recorded sets when the batch carries
    them (`rows`: one (token_ids, offsets) per completion, see _flat_sampling_mask; they replace the
    rules that made them), else the sampler's top_k / top_p / min_p that are on, else none."""
    if rows is not None:
        return dict(sampling_mask=_flat_sampling_mask(rows, completion_mask, counted))
    return dict(trainer.gtpo_replay)


def _flat_sampling_mask(rows, completion_mask, counted, name="sampling_mask"):
    """Per-completion kept sets -> gtpo_loss's sampling_mask for the tokens `counted` selects.

    rows: a list with one (token_ids, offsets) per completion (row): the kept sets of its generated tokens,
    set j that of completion position j (TRL pads completions on the right; tool / environment tokens
    included: any set holding the token, they are not in the loss), vLLM's compressed layout per
    completion: offsets (n_i + 1,) non-decreasing, set j = token_ids[offsets[j]:offsets[j + 1]]. A list
    travels with its rows through TRL's shuffle and split. completion_mask: nonzero up to the last of the
    n_i tokens, or zero throughout (a completion masked out, as TRL's mask_truncated_completions does: its
    sets are not used). counted: the pass's counted tokens (a subset of completion_mask).
    Returns (token_ids, offsets) over the counted tokens, row-major (gtpo_loss's packed order)."""
    B, T = completion_mask.shape
    if not isinstance(rows, (list, tuple)) or len(rows) != B:
        got = f"{len(rows)} entries" if isinstance(rows, (list, tuple)) else type(rows).__name__
        raise ValueError(f"{name} must be a list with one (token_ids, offsets) per completion ({B}), got {got}")
    cm = completion_mask != 0
    cnt = cm & (counted != 0)
    dev = completion_mask.device
    ends = torch.where(cm, torch.arange(1, T + 1, device=dev), 0).amax(1).tolist() if T else [0] * B
    sizes, ids, keep = [], [], []
    for i, r in enumerate(rows):
        if not (isinstance(r, (tuple, list)) and len(r) == 2 and all(
                isinstance(x, torch.Tensor) and x.dim() == 1 and not x.dtype.is_floating_point
                and x.dtype != torch.bool for x in r)):
            raise ValueError(f"{name}[{i}] must be a pair (token_ids, offsets) of 1-D integer tensors")
        tok, off = r[0].to(dev, torch.long), r[1].to(dev, torch.long)
        n = off.numel() - 1
        if ends[i] and n != ends[i]:
            raise ValueError(f"{name}[{i}]: offsets has {off.numel()} entries for the completion's {ends[i]} "
                             f"tokens (completion_mask): want {ends[i] + 1}, one set per token")
        if not 0 <= n <= T:
            raise ValueError(f"{name}[{i}]: offsets has {off.numel()} entries for a completion masked out "
                             f"(completion_mask 0) of at most {T} tokens: want 1 to {T + 1}, one set per token")
        lo, hi = int(off[0]), int(off[-1])
        if lo < 0 or hi > tok.numel():
            raise ValueError(f"{name}[{i}]: offsets span [{lo}, {hi}) outside token_ids' {tok.numel()} entries")
        sizes.append(off[1:] - off[:-1])
        ids.append(tok[lo:hi])
        keep.append(cnt[i, :n])  # the counted tokens among the completion's n
    sizes = torch.cat(sizes) if sizes else torch.zeros(0, dtype=torch.long, device=dev)
    ids = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long, device=dev)
    keep = torch.cat(keep) if keep else torch.zeros(0, dtype=torch.bool, device=dev)
    if bool((sizes < 0).any()):
        raise ValueError(f"{name}: offsets must be non-decreasing within each completion")
    token_ids = ids[keep.repeat_interleave(sizes)]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), sizes[keep].cumsum(0)])
    return token_ids, offsets
