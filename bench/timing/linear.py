"""The `linear` suite's inputs and implementations: the loss from hidden states and the LM head.

One problem is N tokens x D x V: `B = N // T` completions of `T` rows (bench.inputs.shape_for, groups of
G = 8, ~10% of positions masked out), hidden states (B, T, D) and an LM head weight (V, D), both
requiring grad, float32 on the CPU and bf16 on CUDA. Every implementation computes the same loss, the
`grpo` preset (a preset where our fused schedule is allowed), off-policy: `old_logps` are the current
log-probs plus N(0, 0.1) noise, so the loss value depends on the log-probs (on-policy, the GRPO loss
is -mean(A) whatever the logits) and the clip range is active on some tokens.

Each `make_<name>(cfg, device, tile_bytes)` returns `run(inp) -> loss` (a scalar differentiated with
respect to `inp.hidden` and `inp.weight`) or raises `Unavailable(reason)`.

Tile budget: `tile_bytes` is the size of the logits tile projected at once. Ours gets
`memory_budget = 2 * tile_bytes` (its budget covers the tile and its gradient); TRL gets the vocabulary
chunk that makes its `[min(N, 4096), chunk_size]` tile the same size (its gradient is formed in place in
that tile). The materialized path has no tile; Liger-Kernel's chunked loss has fixed tiles of its own
(one completion per chunk, 2048 tokens x 4096 vocabulary entries, float32).

The sampler's kept sets (spec 13; `REPLAY_PROVIDERS`, opt-in: `--linear-impls ...,replay,rebuild`):
`make_inputs(..., kept=True)` builds a head whose own logits are peaked the way a trained policy's are
(`peaked_head`) and draws each counted token's kept set as vLLM's sampler keeps it from those logits
(top_k = 512, then top_p = 0.95: gtpo_kernels.kernels.kept_set.kept_sets, a block of rows at a time),
then the sampled id from the set's renormalized softmax. 'replay' passes the sets as recorded
(`sampling_mask`), 'rebuild' passes the rules (`top_k`, `top_p`) and lets the head rebuild them. Both
compute the loss over the kept sets (old log-probs: the replayed ones plus the same noise), so they are
checked against a float64 evaluation over the sets, the full heads against the full vocabulary.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from gtpo_kernels import GTPOConfig, gtpo_loss, gtpo_loss_from_logps, linear_gtpo_loss, linear_token_logprobs

from .inputs import shape_for
from .providers import Unavailable, make_from, require

PROVIDERS = ("materialized", "fused", "recompute", "trl", "liger")
LABELS = {
    "materialized": "logits + gtpo_loss",
    "fused": "linear_gtpo_loss fused",
    "recompute": "linear_gtpo_loss recompute",
    "trl": "TRL ChunkedLogProb + loss",
    "liger": "Liger FusedLinearGRPO",
    "liger-flce": "Liger FusedLinearCrossEntropy",
}
NOTES = {
    "materialized": "hidden @ weight.T whole (B, T, V), then gtpo_loss",
    "fused": "3 GEMMs per tile, gradient formed in the forward",
    "recompute": "4 GEMMs per tile, backward projects again",
    "trl": "trl.kernels.ChunkedLogProbFunction on the counted rows, gtpo_loss_from_logps",
    "liger": "liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss, loss_type='grpo', its own tiles",
    "liger-flce": "liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss: cross-entropy, not GRPO",
}
# what each row computes (spec 8's rule for a comparison: say what the peer does and does not do)
WORK = {
    "materialized": "grpo preset, old_logps given, entropies returned, validate=True, from the whole logits",
    "fused": "grpo preset, old_logps given, entropies returned, validate=True, 3 GEMMs per tile",
    "recompute": "grpo preset, old_logps given, entropies returned, validate=True, 4 GEMMs per tile",
    "trl": "log-probs and entropies from TRL's chunked head (counted rows only), then our grpo loss from them in "
           "torch",
    "liger": "GRPO (LigerFusedLinearGRPOLoss, loss_type='grpo', beta=0, old_logps given): no entropy, no input "
             "checks, every row projected (masked ones included)",
    "liger-flce": "cross-entropy -mean(logp) over the counted tokens (LigerFusedLinearCrossEntropyLoss, "
                  "ignore_index for masked rows): no GRPO terms, no entropy, no input checks, every row projected; "
                  "the least a fused head can do (checked against float64 cross-entropy, not the GRPO loss)",
    "replay": "grpo preset over the recorded kept sets, entropies returned, validate=True",
    "rebuild": "grpo preset over the kept sets rebuilt by top_k/top_p, entropies returned, validate=True",
}
CE_PROVIDERS = ("liger-flce",)  # opt-in (--linear-impls ...,liger-flce), held to a float64 cross-entropy
PRESET = "grpo"
TRL_TOKEN_CHUNK = 4096  # trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE
OLD_LOGP_NOISE = 0.1
LOGIT_STD = 2.0  # logits ~ N(0, 2^2) per entry
REPLAY_PROVIDERS = ("replay", "rebuild")
LABELS.update({"replay": "linear_gtpo_loss replay (recorded sets)",
               "rebuild": "linear_gtpo_loss rebuild (top_k/top_p)"})
NOTES.update({"replay": "sampling_mask: each tile projects the union U of its kept sets, 4 GEMMs over |U|",
              "rebuild": "top_k/top_p: forward projects full-V tiles to rebuild the sets, backward 3 GEMMs over |U|"})


@dataclasses.dataclass
class LinearInputs:
    hidden: torch.Tensor  # (B, T, D), requires grad
    weight: torch.Tensor  # (V, D), requires grad
    ids: torch.Tensor  # (B, T) int64, 0 where masked out
    mask: torch.Tensor  # (B, T) bool
    adv: torch.Tensor  # (B,) float32
    old: torch.Tensor  # (B, T) float32: current log-probs + noise, 0 where masked out
    N: int
    D: int
    V: int
    sampling_mask: Optional[tuple] = None  # (token_ids, offsets) of the counted tokens' kept sets (kept=True)
    old_kept: Optional[torch.Tensor] = None  # (B, T): log-probs over the kept sets + the same noise as `old`
    sets: Optional[dict] = None  # set_stats of the kept sets

    @property
    def counted(self) -> int:
        return int(self.mask.sum())

    def grad_bytes(self) -> int:
        """Bytes of the parameter gradients the run returns (hidden's and weight's, their dtype)."""
        return self.hidden.numel() * self.hidden.element_size() + self.weight.numel() * self.weight.element_size()

    def input_bytes(self) -> int:
        extra = () if self.sampling_mask is None else (*self.sampling_mask, self.old_kept)
        return sum(t.numel() * t.element_size() for t in (self.hidden, self.weight, self.ids, self.mask, self.adv,
                                                          self.old, *extra))


def default_dtype(device) -> torch.dtype:
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def make_inputs(N, D, V, dtype=torch.float32, device="cpu", seed=0, kept=False) -> LinearInputs:
    """The problem of the module's docstring; kept=True: the peaked head, its kept sets and ids drawn
    from them (`kept_inputs`)."""
    if kept:
        return kept_inputs(N, D, V, dtype, device, seed)
    B, T = shape_for(N)
    gen = torch.Generator(device=device).manual_seed(seed)
    dev = torch.device(device)
    hidden = torch.randn(B, T, D, generator=gen, device=dev).to(dtype)
    weight = torch.empty(V, D, dtype=dtype, device=dev)
    for s in range(0, V, 8192):  # no float32 copy of the whole head in bf16 runs
        e = min(V, s + 8192)
        weight[s:e] = (torch.randn(e - s, D, generator=gen, device=dev) * (LOGIT_STD / math.sqrt(D))).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=gen, device=dev)
    lengths = T - (0.2 * T * torch.rand(B, generator=gen, device=dev)).long()
    mask = torch.arange(T, device=dev)[None, :] < lengths[:, None]
    ids = torch.where(mask, ids, torch.zeros_like(ids))
    adv = torch.randn(B, generator=gen, device=dev)
    with torch.no_grad():
        logp, _ = linear_token_logprobs(hidden, weight, ids, completion_mask=mask)
    old = torch.where(mask, logp.float() + OLD_LOGP_NOISE * torch.randn(B, T, generator=gen, device=dev), 0.0)
    return LinearInputs(hidden.requires_grad_(), weight.requires_grad_(), ids, mask, adv.float(), old, N, D, V)


# ---- kept sets drawn as a sampler draws them -----------------------------------------------------

TOP_K, TOP_P = 512, 0.95  # the sampler's rules (vLLM's order: top-k, then top-p)
CLUSTER_MAX = 1024  # ids sharing a direction of the head: sizes log-uniform in [1, CLUSTER_MAX]
POOL = 6  # clusters a completion draws its tokens from (its topic)
ZIPF = 1.2  # popularity of the clusters across completions: weight 1 / rank^ZIPF
FORKING = 0.2  # share of high-entropy tokens (the '80/20' of RL rollouts); the rest are confident
SPREAD = {"forking": (0.0, 2.0), "confident": (5.0, 9.0)}  # sigma_t ranges (the logits' spread in the cluster)
MARGIN = (1.0, 5.0)  # a_t - ln V: how far the token's cluster stands above the rest of the vocabulary


def peaked_head(B, T, D, V, gen, device="cpu"):
    """(hidden (B, T, D), weight (V, D), cluster of each token (B, T)) float32 whose logits z = h W^T are
    peaked as a trained policy's: the vocabulary is cut into clusters (a random permutation cut into runs
    of log-uniform length in [1, CLUSTER_MAX]); weight row v = [c_g(v) | r_v], the cluster's direction
    c_g ~ N(0, I/D1) in the first D1 = D // 2 dimensions and the id's own r_v ~ N(0, I/D2) in the rest.
    Token t of completion b picks a cluster g_t from its completion's POOL clusters (drawn once per
    completion with Zipf weights over the clusters: popular clusters recur across completions, a
    completion's tokens share theirs) and h_t = [a_t c_g / |c_g|^2 | sigma_t x_t], x_t ~ N(0, I): the
    cluster's ids get logit a_t + sigma_t N(0, 1), every other id a_t N(0, 1/D1) + sigma_t N(0, 1), with
    a_t = ln V + U(MARGIN) and sigma_t from SPREAD (FORKING of the tokens spread little: the sampler keeps
    tens to hundreds of ids; the others spread much: one to a few ids)."""
    dev = torch.device(device)
    D1, D2 = D // 2, D - D // 2
    size = torch.exp(math.log(CLUSTER_MAX) * torch.rand(V, generator=gen, device=dev)).long().clamp(1, CLUSTER_MAX)
    ends = torch.cumsum(size, 0)
    C = int((ends < V).sum()) + 1
    cluster = torch.empty(V, dtype=torch.long, device=dev)
    cluster[torch.randperm(V, generator=gen, device=dev)] = torch.searchsorted(ends[:C], torch.arange(V, device=dev),
                                                                               right=True)
    cent = torch.randn(C, D1, generator=gen, device=dev) / math.sqrt(D1)
    weight = torch.cat([cent[cluster], torch.randn(V, D2, generator=gen, device=dev) / math.sqrt(D2)], 1)
    pop = (1.0 / torch.arange(1, C + 1, device=dev, dtype=torch.float64) ** ZIPF)[torch.randperm(C, generator=gen,
                                                                                                  device=dev)]
    pools = torch.multinomial(pop.expand(B, C), min(POOL, C), replacement=False, generator=gen)
    g = pools.gather(1, torch.randint(0, pools.shape[1], (B, T), generator=gen, device=dev))
    a = math.log(V) + MARGIN[0] + (MARGIN[1] - MARGIN[0]) * torch.rand(B, T, generator=gen, device=dev)
    fork = torch.rand(B, T, generator=gen, device=dev) < FORKING
    u = torch.rand(B, T, generator=gen, device=dev)
    (f0, f1), (c0, c1) = SPREAD["forking"], SPREAD["confident"]
    sigma = torch.where(fork, f0 + (f1 - f0) * u, c0 + (c1 - c0) * u)
    c = cent[g]
    hidden = torch.cat([a[..., None] * c / (c * c).sum(-1, keepdim=True),
                        sigma[..., None] * torch.randn(B, T, D2, generator=gen, device=dev)], -1)
    return hidden, weight, g


def draw_kept_sets(hidden, weight, mask, gen, top_k=TOP_K, top_p=TOP_P, rows=256):
    """The sampler on the head's own logits, `rows` counted tokens at a time (never (N, V)): each counted
    token's kept set (kept_sets: top_k, then top_p, vLLM's order) and its sampled id drawn from the set's
    renormalized softmax. Returns (ids (B, T), token_ids, offsets, logp over the full vocabulary (B, T),
    logp over the kept set (B, T)); 0 where not counted."""
    from gtpo_kernels.kernels.kept_set import kept_sets
    B, T, D = hidden.shape
    pos = mask.reshape(-1).nonzero().squeeze(1)
    h2 = hidden.detach().reshape(-1, D)
    ids = torch.zeros(B * T, dtype=torch.long, device=hidden.device)
    lp_full, lp_kept = (torch.zeros(B * T, device=hidden.device) for _ in range(2))
    tids, sizes = [], []
    for m0 in range(0, pos.numel(), rows):
        p = pos[m0:m0 + rows]
        z = (h2[p] @ weight.detach().t()).float()
        r = torch.arange(p.numel(), device=z.device)
        tid, off, *_ = kept_sets(z.unsqueeze(0), torch.zeros_like(r), r, z.argmax(-1), 1.0, top_k, top_p)
        keep = torch.zeros_like(z, dtype=torch.bool)
        keep[torch.repeat_interleave(r, off.diff()), tid] = True
        zk = torch.where(keep, z, torch.full_like(z, float("-inf")))
        y = torch.multinomial(torch.softmax(zk, -1), 1, generator=gen).squeeze(1)
        ids[p] = y
        lp_full[p] = torch.log_softmax(z, -1).gather(1, y[:, None]).squeeze(1)
        lp_kept[p] = torch.log_softmax(zk, -1).gather(1, y[:, None]).squeeze(1)
        tids.append(tid)
        sizes.append(off.diff())
    sizes = torch.cat(sizes) if sizes else torch.zeros(0, dtype=torch.long)
    offsets = torch.cat([sizes.new_zeros(1), torch.cumsum(sizes, 0)])
    token_ids = torch.cat(tids) if tids else torch.zeros(0, dtype=torch.long)
    return ids.reshape(B, T), token_ids, offsets, lp_full.reshape(B, T), lp_kept.reshape(B, T)


def set_stats(token_ids, offsets, V, tiles=()):
    """Sizes of the kept sets and of the unions of consecutive tokens' sets: {mean_kept, median_kept,
    p90_kept, max_kept, and per tile plan ((m0, m1), ...) given: tiles, mean_rows, mean_union, max_union,
    union_over_V, sum_kept_over_union (how much the tile's sets share)}."""
    k = offsets.diff().double()
    out = dict(tokens=int(k.numel()), mean_kept=float(k.mean()) if k.numel() else 0.0,
               median_kept=float(k.median()) if k.numel() else 0.0,
               p90_kept=float(k.quantile(0.9)) if k.numel() else 0.0, max_kept=int(k.max()) if k.numel() else 0)
    if tiles:
        off = offsets.tolist()
        u = [torch.unique(token_ids[off[m0]:off[m1]]).numel() for m0, m1 in tiles]
        out.update(tiles=len(tiles), mean_rows=sum(m1 - m0 for m0, m1 in tiles) / len(tiles),
                   unions=u, mean_union=sum(u) / len(u), max_union=max(u), union_over_V=sum(u) / len(u) / V,
                   sum_kept_over_union=float(k.sum()) / max(1, sum(u)))
    return out


def kept_inputs(N, D, V, dtype=torch.float32, device="cpu", seed=0) -> LinearInputs:
    """make_inputs' shapes, mask and advantages on the peaked head (`peaked_head`), ids drawn by the sampler
    (`draw_kept_sets`); `old` over the full vocabulary and `old_kept` over the sets, both with the same
    N(0, OLD_LOGP_NOISE^2) noise; `sets`: set_stats (no tiles)."""
    B, T = shape_for(N)
    gen = torch.Generator(device=device).manual_seed(seed)
    dev = torch.device(device)
    hidden, weight, _ = peaked_head(B, T, D, V, gen, dev)
    lengths = T - (0.2 * T * torch.rand(B, generator=gen, device=dev)).long()
    mask = torch.arange(T, device=dev)[None, :] < lengths[:, None]
    adv = torch.randn(B, generator=gen, device=dev)
    ids, token_ids, offsets, lp_full, lp_kept = draw_kept_sets(hidden, weight, mask, gen)
    noise = OLD_LOGP_NOISE * torch.randn(B, T, generator=gen, device=dev)
    old, old_kept = (torch.where(mask, lp + noise, 0.0) for lp in (lp_full, lp_kept))
    return LinearInputs(hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_(), ids, mask, adv.float(),
                        old, N, D, V, (token_ids, offsets), old_kept, set_stats(token_ids, offsets, V))


def config() -> GTPOConfig:
    return GTPOConfig.preset(PRESET)


def _backend(device):
    # our torch backend on the CPU (Triton would run in its interpreter), Triton on CUDA
    return "torch" if torch.device(device).type == "cpu" else "triton"


def trl_chunk_size(inp: LinearInputs, tile_bytes: int) -> int:
    """TRL's vocabulary chunk that makes its [min(N, 4096), chunk] tile `tile_bytes` large."""
    rows = max(1, min(inp.counted, TRL_TOKEN_CHUNK))
    return max(1, min(inp.V, tile_bytes // (rows * inp.hidden.element_size())))


def our_budget(tile_bytes: int) -> int:
    return 2 * tile_bytes  # memory_budget counts the tile and its gradient


# ---- ours ---------------------------------------------------------------------------------------

def make_materialized(cfg, device, tile_bytes):
    backend = _backend(device)

    def run(inp):
        logits = inp.hidden @ inp.weight.t()
        return gtpo_loss(logits, inp.ids, inp.adv, inp.mask, old_logps=inp.old, config=cfg,
                         backend=backend).loss
    return run


def _linear(schedule):
    def make(cfg, device, tile_bytes):
        backend = _backend(device)

        def run(inp):
            out = linear_gtpo_loss(inp.hidden, inp.weight, inp.ids, inp.adv, inp.mask, old_logps=inp.old,
                                   config=cfg, memory_budget=our_budget(tile_bytes), schedule=schedule,
                                   backend=backend)
            ran = bool(out.metrics["grad_in_forward"])
            if ran != (schedule == "fused"):
                raise RuntimeError(f"schedule={schedule!r} asked, grad_in_forward={ran}")
            return out.loss
        return run
    return make


make_fused = _linear("fused")
make_recompute = _linear("recompute")


def _kept(how):
    """The head over the sampler's kept sets: 'replay' (the recorded sets) or 'rebuild' (the rules)."""
    def make(cfg, device, tile_bytes):
        backend = _backend(device)

        def run(inp):
            if inp.sampling_mask is None:
                raise Unavailable("needs the kept sets: make_inputs(..., kept=True)")
            kw = dict(sampling_mask=inp.sampling_mask) if how == "replay" else dict(top_k=TOP_K, top_p=TOP_P)
            return linear_gtpo_loss(inp.hidden, inp.weight, inp.ids, inp.adv, inp.mask, old_logps=inp.old_kept,
                                    config=cfg, memory_budget=our_budget(tile_bytes), backend=backend, **kw).loss
        return run
    return make


make_replay = _kept("replay")
make_rebuild = _kept("rebuild")


# ---- TRL ----------------------------------------------------------------------------------------

def make_trl(cfg, device, tile_bytes):
    """TRL's fused LM head as its GRPOTrainer calls it on a Triton device (trl/trainer/utils.py): the
    counted rows only (hidden[mask]), entropy requested, per-token values scattered back with
    masked_scatter; then the same loss in torch from its log-probs and entropies."""
    ChunkedLogProbFunction = require("trl.kernels", "ChunkedLogProbFunction", "TRL")

    def run(inp):
        m = inp.mask
        chunk = trl_chunk_size(inp, tile_bytes)
        lp, ent, *_ = ChunkedLogProbFunction.apply(inp.hidden[m], inp.weight, None, inp.ids[m], cfg.temperature,
                                                   chunk, None, 1.0, ("entropy",))
        logps = lp.new_zeros(m.shape).masked_scatter(m, lp)
        entropy = ent.new_zeros(m.shape).masked_scatter(m, ent)
        return gtpo_loss_from_logps(logps, inp.ids, inp.adv, m, entropy=entropy, old_logps=inp.old,
                                    config=cfg).loss
    return run


# ---- Liger-Kernel -------------------------------------------------------------------------------

def make_liger(cfg, device, tile_bytes):
    """Liger-Kernel's LigerFusedLinearGRPOLoss: loss_type='grpo' (per-completion token mean, batch mean),
    beta=0, no reference model, our clip range and temperature, one completion per chunk (its default).
    compiled=False on the CPU (its torch.compile of the loss math is for GPUs), its default True on CUDA.
    Its chunked torch code projects every position, masked ones included."""
    LigerFusedLinearGRPOLoss = require("liger_kernel.chunked_loss", "LigerFusedLinearGRPOLoss", "Liger-Kernel")
    if cfg.loss_agg != "seq-mean-token-mean" or cfg.beta:
        raise Unavailable("compared with the grpo preset only")
    fn = LigerFusedLinearGRPOLoss(beta=0.0, compiled=torch.device(device).type == "cuda", use_ref_model=False,
                                  epsilon_low=cfg.eps_low, epsilon_high=cfg.eps_high, loss_type="grpo",
                                  temperature=cfg.temperature)

    def run(inp):
        loss, _metrics = fn(inp.hidden, inp.weight, inp.ids, inp.mask.to(inp.hidden.dtype), inp.adv,
                            old_per_token_logps=inp.old)
        return loss
    return run


ALL_PROVIDERS = PROVIDERS + REPLAY_PROVIDERS + CE_PROVIDERS


def make_liger_flce(cfg, device, tile_bytes):
    """Liger-Kernel's fused linear cross-entropy (liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss,
    its defaults: reduction='mean', the weight gradient accumulated in the input dtype), as a trainer's SFT
    step calls it: hidden (B * T, D), targets with ignore_index at masked-out positions. Its Triton kernels
    need CUDA (or Triton's interpreter)."""
    LigerFLCE = require("liger_kernel.transformers", "LigerFusedLinearCrossEntropyLoss", "Liger-Kernel")
    if torch.device(device).type != "cuda":
        from gtpo_kernels.kernels.dispatch import interpreter_active
        if not interpreter_active():
            raise Unavailable("not run: its Triton kernels need CUDA (or TRITON_INTERPRET=1)")
    fn = LigerFLCE(ignore_index=-100, reduction="mean")

    def run(inp):
        D = inp.hidden.shape[-1]
        target = torch.where(inp.mask, inp.ids, torch.full_like(inp.ids, -100)).reshape(-1)
        return fn(inp.weight, inp.hidden.reshape(-1, D), target)
    return run


def make(name, cfg, device, tile_bytes):
    return make_from(globals(), ALL_PROVIDERS, name, cfg, device, tile_bytes)


def union_tiles(inp: LinearInputs, tile_bytes: int):
    """The replay head's tiles on `inp`'s kept sets ((m0, m1) over the counted tokens, as
    pipeline.head_replay.plan_union plans them under our_budget(tile_bytes))."""
    from gtpo_kernels.pipeline.head import row_bytes
    from gtpo_kernels.pipeline.head_replay import plan_union
    w = inp.weight
    return plan_union(inp.sampling_mask[1].diff().tolist(), inp.V, row_bytes(1, w.dtype, w.device),
                      our_budget(tile_bytes))


def tile_note(name, inp: LinearInputs, tile_bytes: int) -> str:
    if name in ("fused", "recompute"):
        rows = max(1, our_budget(tile_bytes) // (2 * inp.V * inp.hidden.element_size()))
        return f"tiles of {min(rows, inp.counted)} tokens x {inp.V}"
    if name in REPLAY_PROVIDERS and inp.sampling_mask is not None:
        st = set_stats(*inp.sampling_mask, inp.V, union_tiles(inp, tile_bytes))
        rows = max(1, our_budget(tile_bytes) // (2 * inp.V * inp.hidden.element_size()))
        fwd = f"forward {math.ceil(inp.counted / rows)} tiles of {min(rows, inp.counted)} x {inp.V}; backward " \
            if name == "rebuild" else ""
        return f"{fwd}{st['tiles']} tiles of ~{st['mean_rows']:.0f} tokens x |U| ~{st['mean_union']:.0f} " \
               f"({st['union_over_V']:.2f} V)"
    if name == "trl":
        return f"tiles of {min(inp.counted, TRL_TOKEN_CHUNK)} tokens x {trl_chunk_size(inp, tile_bytes)}"
    if name == "liger":
        return f"tiles of {inp.hidden.shape[1]} tokens x {min(inp.V, 4096)}, float32"
    if name == "liger-flce":
        return "its own row chunks x the whole vocabulary"
    return f"logits of {inp.hidden.shape[0] * inp.hidden.shape[1]} tokens x {inp.V}"


def forward_backward(run, inp):
    loss = run(inp)
    gh, gw = torch.autograd.grad(loss, (inp.hidden, inp.weight))
    return loss.detach(), gh, gw
