"""One generator of whole configurations (issue 16, item 3): the entry point, the form, the preset with
every option of spec 9, the per-call extras, dtype and backend, drawn together (`joints()`), and the
builder that turns one draw into tensors: the padded float64 data the reference reads, and the public
call's view of the same values (packed, offset logits, hidden states)."""
from __future__ import annotations

import dataclasses
import math

import torch
from hypothesis import strategies as st

from batches import copy_template

ENTRIES = ("logits", "linear", "logps", "token_adv")
PRESETS = ("gtpo", "gtpo-official", "grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "gspo", "luspo", "vespo")
LOSS_AGGS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
             "gtpo-official", "none")
ROLLOUT = ("none", "token", "b1", "b", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclasses.dataclass
class Joint:
    """One configuration. `over` are the GTPOConfig.preset overrides (built inside the test, where a
    refusal is checked against the documented ones); everything else is a per-call choice."""
    entry: str
    form: str            # padded | packed | empty-T0 | empty-masked | empty-packed | one-padded | one-packed
    dtype: torch.dtype
    backend: str         # torch | triton
    seed: int
    P: int
    G: int
    T: int
    V: int
    preset: str
    over: dict
    logits_start: int | None
    with_old: bool
    with_ref: bool
    with_roll_lp: bool
    rollout: str
    clip_min: float | None
    clip_max: float
    conflict: str        # computed | precomputed
    num_items: tuple | None   # (kind, value factor): ("float" | "tensor", k) -> k * M + 1, or k = 0
    with_entropy: bool   # logps entry: pass the entropies
    head: dict           # linear entry: D, bias, scale, cap, schedule, budget_rows
    max_seqlen: bool     # packed: pass max_seqlen
    adv_shape: str       # B | B1 | BT (token_adv only)
    uid: str             # int | str | shuffled (token_adv only)
    filter_between: bool  # move the entropy threshold between the completions' entropies
    validate: bool = True  # False: the host checks skipped (valid input: the same results)
    lie: bool = False      # packed: max_seqlen shorter than the longest completion (refused, or right or NaN)
    autocast: bool = False  # float32 inputs, the call inside torch.autocast("cpu", torch.bfloat16)
    saturate: bool = False  # head, float32: logit_softcap small, every logit of a row far beyond it
    tau: str | None = None  # logits and head entries: the sampler's temperature per completion (B | B1) or per token (BT)
    replay: str | None = None  # logits and head entries: the sampler's kept sets, "mask" (recorded) or "rules"
    rules: dict = dataclasses.field(default_factory=dict)  # {top_k | top_p | min_p: (value, num | B | B1 | BT)}
    sets: str = "rules"     # replay="mask": the reference's sets under `rules`, or random ones holding the sampled id
    inplace: bool = False   # logits entry with a kept set: inplace=True (refused, spec 13)

    @property
    def packed(self):
        return self.form in ("packed", "empty-packed", "one-packed")

    @property
    def B(self):
        return self.P * self.G


@st.composite
def overrides(draw):
    """The preset and every option of spec 9 (and 2, 4) together; may name combinations the API refuses."""
    preset = draw(st.sampled_from(PRESETS))
    cispo = preset == "cispo"
    o = {"temperature": draw(st.sampled_from([1.0, 0.7, 1.3]))}
    maybe = lambda: draw(st.booleans())  # noqa: E731
    if maybe():
        o["loss_agg"] = draw(st.sampled_from(LOSS_AGGS))
    if maybe():
        o["eps_low"] = draw(st.sampled_from([0.0, 0.1, 0.2]))
    if maybe():
        o["eps_high"] = draw(st.sampled_from([1.0, 5.0] if cispo else [0.0, 0.1, 0.28]))
    if maybe():
        o["clip"] = draw(st.booleans())
    if maybe():
        o["delta"] = draw(st.sampled_from([1.05, 1.1, 1.5, 3.0]))
    if maybe():  # refused with cispo, sapo and vespo: drawn there one time in five
        ppo = preset not in ("cispo", "sapo", "vespo")
        o["importance_sampling_level"] = draw(st.sampled_from(["token", "sequence"] if ppo else ["token"] * 4 + ["sequence"]))
    if maybe():
        o["beta"] = 0.04
        o["use_bias_correction_kl"] = draw(st.booleans())
    if maybe():
        o["off_policy_mask_threshold"] = draw(st.sampled_from([-0.1, 0.0, 0.05, 0.5]))
    if maybe():
        o["top_entropy_quantile"] = draw(st.sampled_from([0.3, 0.5, 0.8, 1.0]))
    if maybe():
        o["use_conflict_mask"] = draw(st.booleans())
        o["conflict_pos_weight"] = draw(st.sampled_from([2.0, 1.5]))
        o["conflict_neg_weight"] = draw(st.sampled_from([0.0, 0.5]))
    if maybe():
        o["entropy_threshold"] = draw(st.sampled_from([None, math.log(2), 0.7, 10.0]))
    if maybe():
        o["initial_entropy"] = draw(st.sampled_from([0.1, 5.0]))
    if maybe():
        o["entropy_penalty"] = draw(st.sampled_from([0.0, 0.1]))
    if maybe():
        o["entropy_coef"] = 0.01
    if maybe():
        o["sapo_temperature_neg"] = draw(st.sampled_from([1.05, 1.25]))
    if maybe():
        o["max_completion_length"] = draw(st.sampled_from([3, 6]))
    return preset, o


@st.composite
def joints(draw, triton_share=0.25, entries=("logits", "logits", "linear", "linear", "logps", "logps", "token_adv"),
           lie=None):
    """A whole configuration. Triton (under the interpreter) runs on about `triton_share` of the examples
    whose entry takes a backend and whose dtype it supports; `entries` to draw from; lie=True: always the
    packed form with a max_seqlen shorter than the longest completion (False: never; None: drawn)."""
    entry = draw(st.sampled_from(entries))
    form = "packed" if lie else \
        draw(st.sampled_from(["padded"] * 5 + ["packed"] * 5 + ["empty-T0", "empty-masked", "empty-packed",
                                                                "one-padded", "one-packed"]))
    if entry == "token_adv" and form in ("packed", "empty-packed", "one-packed"):
        form = {"packed": "padded", "empty-packed": "empty-masked", "one-packed": "one-padded"}[form]
    if entry == "logps" or entry == "token_adv":
        dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    else:
        dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float64]))
    backend = "torch"
    if entry in ("logits", "linear") and dtype != torch.float64:
        backend = "triton" if draw(st.floats(0, 1)) < triton_share else "torch"
    one = form.startswith("one")
    P, G = (1, 1) if one else (draw(st.integers(1, 2)), draw(st.integers(1, 3)))
    T = 1 if one else (0 if form == "empty-T0" else draw(st.integers(1, 4)))
    V = draw(st.sampled_from([1, 3, 8, 17])) if entry != "linear" else draw(st.sampled_from([3, 8, 17]))
    preset, over = draw(overrides())
    start = draw(st.sampled_from([None, None, 0, 1, 2])) if entry == "logits" and T > 0 else None
    rollout = draw(st.sampled_from(ROLLOUT))
    clip_min = draw(st.sampled_from([None, 0.5]))
    clip_max = draw(st.sampled_from([1.5, 3.0]))
    num_items = None
    if draw(st.booleans()):  # the denominator of token-mean (refused with any other aggregation, or <= 0)
        num_items = (draw(st.sampled_from(["float", "tensor"])), draw(st.sampled_from([1, 2, 2, 0])))
        if draw(st.sampled_from([True, True, False])):
            over["loss_agg"] = "token-mean"
    head = dict(D=draw(st.sampled_from([4, 8])), bias=draw(st.booleans()), scale=draw(st.sampled_from([1.0, 0.7])),
                cap=draw(st.sampled_from([None, None, 4.0])),
                schedule=draw(st.sampled_from(["auto", "auto", "recompute", "fused"])),
                budget_rows=draw(st.sampled_from([1, 3, 1000])))
    return Joint(entry=entry, form=form, dtype=dtype, backend=backend, seed=draw(st.integers(0, 2**31 - 1)),
                 P=P, G=G, T=T, V=V, preset=preset, over=over, logits_start=start,
                 with_old=draw(st.booleans()), with_ref=draw(st.sampled_from([True] * 7 + [False])),
                 with_roll_lp=draw(st.booleans()), rollout=rollout, clip_min=clip_min, clip_max=clip_max,
                 conflict=draw(st.sampled_from(["computed", "computed", "precomputed"])), num_items=num_items,
                 with_entropy=draw(st.sampled_from([True, True, True, False])), head=head,
                 max_seqlen=draw(st.booleans()), adv_shape=draw(st.sampled_from(["B", "B1", "BT"])),
                 uid=draw(st.sampled_from(["int", "str", "shuffled"])),
                 filter_between=draw(st.sampled_from([True] * 4 + [False])),
                 **adversity(draw, entry, form, dtype, head, lie))


def adversity(draw, entry, form, dtype, head, lie=None):
    """What the first generator never drew: validate=False on valid input, a max_seqlen shorter than the
    longest completion (with validate either way), autocast around a float32 call, soft-caps saturated by
    every logit of a row (head, float32), the sampler's temperature per completion or per token and its
    kept sets (replay, rules, sets, inplace: `replays`) on the logits and head entries."""
    packed = form in ("packed", "empty-packed", "one-packed")
    out = dict(validate=draw(st.sampled_from([True, True, False])),
               lie=packed and entry != "token_adv" and (lie if lie is not None else
                                                        draw(st.sampled_from([False, False, True]))),
               autocast=dtype == torch.float32 and entry != "token_adv" and draw(st.sampled_from([False] * 3 + [True])),
               saturate=entry == "linear" and dtype == torch.float32 and draw(st.sampled_from([False] * 3 + [True])),
               tau=draw(st.sampled_from([None, None, "B", "B1", "BT"])) if entry in ("logits", "linear") else None)
    if out["saturate"]:
        # |z| / cap from sat to sat + 4 on every entry: from 4 (1 - tanh^2 ~ 1e-3) to 8 and beyond, where
        # tanh rounds to 1 in float32 and a derivative formed from it loses every digit
        head.update(cap=draw(st.sampled_from([0.5, 1.0, 2.0])), bias=True, sat=draw(st.sampled_from([4.0, 8.0])))
    if entry in ("logits", "linear"):
        out.update(replays(draw, entry, dtype, out["saturate"]))
    return out


# the rules' values: off among them (top_k 0 or at least V, top_p 1, min_p 0)
RULE_VALUES = {"top_k": (0, 1, 2, 3, 5, 20), "top_p": (0.5, 0.8, 0.9, 0.95, 1.0), "min_p": (0.0, 0.05, 0.1, 0.3)}


def replays(draw, entry, dtype, saturate):
    """The sampler's kept sets (spec 13), on about two examples in five of the logits and head entries:
    replay="mask" (the recorded sets passed as sampling_mask) or "rules" (top_k / top_p / min_p, each a
    number or a tensor per completion (B, B1) or per token (BT), off values included), and for a mask its
    sets: the reference's rebuild under the drawn rules, or random sets holding the sampled id (some
    holding ids at -inf, ids in any order, int32 or int64). The logits entry takes inplace=True one time
    in eight with a kept set (refused).

    Not drawn, on purpose:
    - the rules on the head in bfloat16 or with a saturated soft-cap: they are drawn as a mask rebuilt by
      the same rules instead. The head rebuilds the sets on its own GEMM output (16 bits, rounded once
      after an accumulation whose order the reference does not reproduce: one bf16 ulp apart, 4e-3) and
      on a soft-cap whose values agree to a few float32 ulps (tanh near 1): the reference and the call
      would not rebuild the same sets, which is the rounding, not a defect. The logits entry in bfloat16
      takes the rules: its inputs are the values both sides read.
    - near the cuts: the test assumes each rule's decision is 1e-4 (relative) away from its cut on the
      reference's float64 values (joint_replay.clear_of_cuts: min-p's ratio to the largest probability,
      the k-th largest value, top-p's cumulative mass and the values either side of its cut), since the
      call rebuilds in float32.
    - process_group (refused with a kept set): the joint test runs one process (tests/test_replay_api.py
      and tests/test_head_replay.py check the refusal)."""
    replay = draw(st.sampled_from([None, None, None, "mask", "rules"]))
    if replay is None:
        return {}
    names = draw(st.sampled_from([("top_k",), ("top_p",), ("min_p",), ("top_k", "top_p"), ("top_k", "top_p", "min_p"),
                                  ("min_p", "top_p")]))
    rules = {n: (draw(st.sampled_from(RULE_VALUES[n])), draw(st.sampled_from(["num", "num", "B", "B1", "BT"])))
             for n in names}
    if replay == "rules" and entry == "linear" and (dtype == torch.bfloat16 or saturate):
        replay = "mask"
    sets = draw(st.sampled_from(["rules", "rules", "random", "random-shuffled"])) if replay == "mask" else "rules"
    inplace = entry == "logits" and draw(st.sampled_from([False] * 7 + [True]))
    return dict(replay=replay, rules=rules, sets=sets, inplace=inplace)


@dataclasses.dataclass
class Data:
    """The padded values (the reference's view): ids (B, T) with -100 at some masked-out positions,
    mask (B, T) bool, adv (B,) float32, lengths (B,), pos (N,) the padded flat index of each packed token."""
    ids: torch.Tensor
    mask: torch.Tensor
    adv: torch.Tensor
    lengths: torch.Tensor
    pos: torch.Tensor
    gen: torch.Generator

    def pack(self, x):
        """(B, T, ...) padded -> (N, ...) packed rows."""
        return x.reshape((-1,) + tuple(x.shape[2:]))[self.pos]

    def unpack(self, x, fill=0.0):
        """(N, ...) packed -> (B, T, ...) padded, `fill` elsewhere."""
        B, T = self.mask.shape
        out = torch.full((B * T,) + tuple(x.shape[1:]), fill, dtype=x.dtype)
        out[self.pos] = x
        return out.reshape((B, T) + tuple(x.shape[1:]))

    @property
    def cu_seqlens(self):
        return torch.cat([torch.zeros(1, dtype=torch.long), self.lengths.cumsum(0)])


def build_data(j: Joint) -> Data:
    """Ids with shared prefixes and suffixes inside groups (conflict tokens), masks with holes and empty
    completions, advantages of every sign pattern (some zero, some all-zero batches)."""
    gen = torch.Generator().manual_seed(j.seed)
    B, T, V, G = j.B, j.T, j.V, j.G
    template = torch.randint(0, V, (j.P, T), generator=gen)
    ids = torch.randint(0, V, (B, T), generator=gen)
    lengths = torch.randint(0, T + 1, (B,), generator=gen)
    if j.form.startswith("one"):
        lengths = torch.ones(B, dtype=torch.long)
    elif j.form.startswith("empty"):
        lengths = torch.zeros(B, dtype=torch.long)
    elif torch.rand(1, generator=gen) < 0.4:
        lengths = torch.full((B,), T)
    copy_template(ids, template, lengths, G, gen)
    inside = torch.arange(T)[None, :] < lengths[:, None]
    mask = inside.clone()
    if T > 1 and torch.rand(1, generator=gen) < 0.5:  # holes
        mask &= torch.rand(B, T, generator=gen) > 0.2
    ids = torch.where(mask | (torch.rand(B, T, generator=gen) < 0.5), ids, torch.full_like(ids, -100))
    # -1/0/+1, normal, all zero (one time in ten), all positive, all negative
    kind = (0, 0, 1, 1, 1, 3, 3, 4, 4, 2)[int(torch.randint(0, 10, (1,), generator=gen))]
    if kind == 0:
        adv = torch.randint(-1, 2, (B,), generator=gen).float()
    elif kind == 1:
        adv = torch.randn(B, generator=gen)
    elif kind == 2:
        adv = torch.zeros(B)
    else:
        adv = (torch.rand(B, generator=gen) + 0.1) * (1 if kind == 3 else -1)
    pos = inside.reshape(-1).nonzero().squeeze(1) if j.packed else torch.arange(B * T)
    return Data(ids, mask, adv, lengths, pos, gen)


def logits_values(j: Joint, d: Data):
    """(B, T, V) float64 logits in the entry's dtype's values: random rows of three scales, some peaked
    (one confident entry), some with banned vocabulary at -inf (never a counted target)."""
    B, T, V, gen = j.B, j.T, j.V, d.gen
    scale = float(torch.tensor([0.5, 2.0, 6.0])[torch.randint(0, 3, (1,), generator=gen)])
    z = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * scale
    if torch.rand(1, generator=gen) < 0.4:
        hot = torch.randint(0, V, (B, T), generator=gen)
        z.scatter_add_(-1, hot[..., None], torch.full((B, T, 1), 12.0, dtype=torch.float64))
    if V > 2 and torch.rand(1, generator=gen) < 0.3:
        ban = torch.rand(B, T, V, generator=gen) < 0.3
        ban &= ~torch.nn.functional.one_hot(d.ids.clamp(min=0), V).bool()
        ban[..., 0] = False
        z = z.masked_fill(ban, float("-inf"))
    return z.to(j.dtype).double()


def head_values(j: Joint, d: Data):
    """hidden (B, T, D), weight (V, D), bias (V,) or None, in the entry's dtype."""
    D, gen = j.head["D"], d.gen
    hidden = torch.randn(j.B, j.T, D, generator=gen).to(j.dtype)
    weight = (torch.randn(j.V, D, generator=gen) * 0.7).to(j.dtype)
    bias = (torch.randn(j.V, generator=gen) * 0.3).to(j.dtype) if j.head["bias"] else None
    if j.saturate:  # |z| / cap from sat to sat + 4 on every entry (|hidden @ weight.T| < 8)
        sign = torch.where(torch.rand(j.V, generator=gen) < 0.5, -1.0, 1.0)
        u = j.head["sat"] + 4 * torch.rand(j.V, generator=gen)
        bias = (sign * (u * j.head["cap"] / j.head["scale"] + 8)).to(j.dtype)
    return hidden, weight, bias


def materialize(hidden, weight, bias, scale, cap):
    """Spec 11's logits from the head (any dtype, differentiable). The soft-cap's derivative is formed as
    1 / cosh(z / cap)^2, exact where tanh saturates (autograd's 1 - tanh^2 from the rounded tanh is not)."""
    z = hidden @ weight.t()
    z = (z if bias is None else z + bias) * scale
    if cap is None:
        return z
    u = (z / cap).detach()
    return cap * torch.tanh(u) + (z - z.detach()) / torch.cosh(u) ** 2


def side_inputs(j: Joint, d: Data, logp64):
    """old_logps, ref_logps, rollout_logps (B, T) float32 near the policy's (NaN where masked out: ignored),
    and the log-probs the rollout weights are computed from."""
    B, T, gen, m = j.B, j.T, d.gen, d.mask
    nan = torch.full((B, T), float("nan"), dtype=torch.float64)
    near = lambda base, s: torch.where(m, base + s * torch.randn(B, T, generator=gen, dtype=torch.float64), nan)  # noqa: E731
    old = near(logp64, 0.3).float()
    refl = near(logp64, 0.3).float()
    roll = near(old.double(), 0.2).float()
    return old, refl, roll


def held_logits(hidden, weight, bias, scale, cap):
    """16-bit inputs: the logits as the head holds them, the GEMM's 16-bit output (the bias added inside
    the GEMM, one rounding), then scale and softcap in float (inside the vocabulary kernels); float64."""
    z = hidden.reshape(-1, hidden.shape[-1]) @ weight.t() if bias is None else \
        torch.addmm(bias, hidden.reshape(-1, hidden.shape[-1]), weight.t())
    z = z.reshape(tuple(hidden.shape[:-1]) + (weight.shape[0],)).double() * scale
    return z if cap is None else cap * torch.tanh(z / cap)
