"""Hypothesis strategies for GTPO batches: groups with shared prefixes and suffixes, masks with holes and
empty completions, zero and same-sign advantages, -inf logits on banned vocabulary, peaked rows."""
from __future__ import annotations

import dataclasses
import math

import torch
from hypothesis import strategies as st

import gtpo_reference as ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@dataclasses.dataclass
class Case:
    logits: torch.Tensor  # (B, T_l, V) in its dtype
    ids: torch.Tensor  # (B, T), -100 at some masked positions
    mask: torch.Tensor  # (B, T) bool/int/float
    adv: torch.Tensor  # (B,)
    G: int
    logits_start: int
    temperature: float

    @property
    def counted(self):
        return self.mask != 0


def copy_template(ids, template, lengths, G, gen):
    """In place: completion i (of group i // G, length L) copies a random prefix of its group's template
    and a random suffix ending at L, so that completions of a group share tokens (conflict candidates)."""
    T = ids.shape[1]
    for i in range(ids.shape[0]):
        g, L = i // G, int(lengths[i])
        k1 = int(torch.randint(0, T + 1, (1,), generator=gen))
        ids[i, :k1] = template[g, :k1]
        k2 = min(int(torch.randint(0, T + 1, (1,), generator=gen)), L)
        if k2:
            ids[i, L - k2:L] = template[g, T - k2:]


@st.composite
def cases(draw, dtypes=(torch.float32,), max_V=70, max_T=6, max_rows=40, min_V=1, nonempty=False):
    """A batch; `nonempty=True`: at least one token counts (never an all-masked batch)."""
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    G = draw(st.integers(1, 4))
    P = draw(st.integers(1, 2))
    B = P * G
    T = draw(st.integers(1, max(1, min(max_T, max_rows // B))))
    V = draw(st.sampled_from([v for v in (1, 2, 7, 16, 33, max_V) if v >= min_V]))
    start = draw(st.integers(0, 2))
    extra = draw(st.integers(0, 1))
    dtype = draw(st.sampled_from(list(dtypes)))
    temperature = draw(st.sampled_from([1.0, 0.7, 1.3]))
    scale = draw(st.sampled_from([0.5, 2.0, 6.0]))

    # ids: each group shares a template; completions copy a prefix and a suffix of it
    template = torch.randint(0, V, (P, T), generator=gen)
    ids = torch.randint(0, V, (B, T), generator=gen)
    lengths = torch.randint(0, T + 1, (B,), generator=gen)
    if draw(st.booleans()):
        lengths = torch.full((B,), T)
    copy_template(ids, template, lengths, G, gen)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    if draw(st.booleans()):  # holes
        mask &= torch.rand(B, T, generator=gen) > 0.15
    if nonempty and not mask.any():
        mask[int(torch.randint(0, B, (1,), generator=gen)), int(torch.randint(0, T, (1,), generator=gen))] = True
    ids = torch.where(mask | (torch.rand(B, T, generator=gen) < 0.5), ids, torch.full_like(ids, -100))
    mask_kind = draw(st.sampled_from(["bool", "int", "float"]))
    mask = {"bool": mask, "int": mask.to(torch.int64), "float": mask.to(torch.float32)}[mask_kind]
    if draw(st.booleans()):
        ids = ids.to(torch.int32)

    # all-zero advantages: one draw in eleven ("mixed" gives some zeros too)
    adv_kind = draw(st.sampled_from(["mixed"] * 3 + ["normal"] * 3 + ["positive"] * 2 + ["negative"] * 2 + ["zero"]))
    if adv_kind == "mixed":  # -1, 0, +1 (not all 0: that is the "zero" kind)
        adv = torch.randint(-1, 2, (B,), generator=gen).float()
        if not adv.any():
            adv[int(torch.randint(0, B, (1,), generator=gen))] = 1.0 if B % 2 else -1.0
    elif adv_kind == "normal":
        adv = torch.randn(B, generator=gen)
    elif adv_kind == "zero":
        adv = torch.zeros(B)
    else:
        adv = torch.rand(B, generator=gen) + 0.1
        adv = adv if adv_kind == "positive" else -adv

    logits = torch.randn(B, start + T + extra, V, generator=gen) * scale
    if draw(st.booleans()):  # peaked rows: one confident entry
        hot = torch.randint(0, V, (B, start + T + extra), generator=gen)
        logits.scatter_add_(-1, hot[..., None], torch.full(hot.shape + (1,), 12.0))
    if V > 2 and draw(st.booleans()):  # banned vocabulary at -inf, never the counted target
        ban = torch.rand(B, start + T + extra, V, generator=gen) < 0.3
        tgt = torch.zeros_like(ban)
        rows = torch.arange(T) + start
        tgt[:, rows] = torch.nn.functional.one_hot(ids.long().clamp(min=0), V).bool()
        ban &= ~tgt
        ban[..., 0] = False  # every row keeps a finite entry
        logits = logits.masked_fill(ban, float("-inf"))
    logits = logits.to(dtype)
    return Case(logits, ids, mask, adv, G, start, temperature)


def reference_logps(case):
    lp, _ = ref.token_logprobs(case.logits[:, case.logits_start:case.logits_start + case.ids.shape[1]]
                               .double(), case.ids, case.temperature, case.counted)
    return lp


@st.composite
def configs(draw):
    """A preset with random overrides (every aggregation, clip on/off, KL, entropy bonus, filter)."""
    from gtpo_kernels import LOSS_AGGS, GTPOConfig
    preset = draw(st.sampled_from(["gtpo", "gtpo-official", "grpo", "dapo", "dr_grpo"]))
    over = {}
    if draw(st.booleans()):
        over["loss_agg"] = draw(st.sampled_from(LOSS_AGGS))
    if draw(st.booleans()):
        over["entropy_threshold"] = draw(st.sampled_from([None, 0.3, math.log(2), 2.0, 10.0]))
    if draw(st.booleans()):
        over["initial_entropy"] = draw(st.sampled_from([0.1, 5.0]))
    if draw(st.booleans()):
        over["clip"] = draw(st.booleans())
    if draw(st.booleans()):
        over["beta"] = draw(st.sampled_from([0.0, 0.04]))
    if draw(st.booleans()):
        over["entropy_coef"] = draw(st.sampled_from([0.0, 0.01]))
    if draw(st.booleans()):
        over["conflict_pos_weight"] = draw(st.sampled_from([2.0, 1.5]))
        over["conflict_neg_weight"] = draw(st.sampled_from([0.0, 0.5]))
    return GTPOConfig.preset(preset, **over)


def completion_entropies(case):
    """(Hbar (B,) float64 of spec 2, (B,) bool: the completion has a counted token)."""
    _, ent = ref.token_logprobs(case.logits[:, case.logits_start:case.logits_start + case.ids.shape[1]]
                                .double(), case.ids, case.temperature, case.counted)
    n = case.counted.sum(1)
    return ent.sum(1) / n.clamp(min=1), n > 0


@st.composite
def cases_and_configs(draw, **case_kw):
    """(case, config) for the loss test. When the config's entropy filter would drop every completion
    that has a counted token (random logits have entropy near ln V, above the presets' ln 2 and 0.7),
    its threshold is moved between two of the case's completion entropies, or above all of them: the
    filter keeps a nonempty subset, and the gradient is not zero merely because nothing was kept."""
    case = draw(cases(**case_kw))
    cfg = draw(configs()).replace(temperature=case.temperature)
    thr, h0 = cfg.entropy_threshold, cfg.initial_entropy
    if thr is None or (h0 is not None and h0 > thr):  # filter off, or the paper's gate turns it off
        return case, cfg
    hbar, has = completion_entropies(case)
    h = torch.sort(hbar[has]).values
    if h.numel() and not (h <= thr).any():
        j = draw(st.integers(1, h.numel()))  # keep the j lowest
        thr = float((h[j - 1] + h[j]) / 2) if j < h.numel() else float(h[-1]) + 0.5
        cfg = cfg.replace(entropy_threshold=thr)
    return case, cfg
