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
"""
from __future__ import annotations

import dataclasses
import math

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
}
NOTES = {
    "materialized": "hidden @ weight.T whole (B, T, V), then gtpo_loss",
    "fused": "3 GEMMs per tile, gradient formed in the forward",
    "recompute": "4 GEMMs per tile, backward projects again",
    "trl": "trl.kernels.ChunkedLogProbFunction on the counted rows, gtpo_loss_from_logps",
    "liger": "liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss, loss_type='grpo', its own tiles",
}
PRESET = "grpo"
TRL_TOKEN_CHUNK = 4096  # trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE
OLD_LOGP_NOISE = 0.1
LOGIT_STD = 2.0  # logits ~ N(0, 2^2) per entry


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

    @property
    def counted(self) -> int:
        return int(self.mask.sum())

    def grad_bytes(self) -> int:
        """Bytes of the parameter gradients the run returns (hidden's and weight's, their dtype)."""
        return self.hidden.numel() * self.hidden.element_size() + self.weight.numel() * self.weight.element_size()

    def input_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.hidden, self.weight, self.ids, self.mask, self.adv,
                                                          self.old))


def default_dtype(device) -> torch.dtype:
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def make_inputs(N, D, V, dtype=torch.float32, device="cpu", seed=0) -> LinearInputs:
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


def make(name, cfg, device, tile_bytes):
    return make_from(globals(), PROVIDERS, name, cfg, device, tile_bytes)


def tile_note(name, inp: LinearInputs, tile_bytes: int) -> str:
    if name in ("fused", "recompute"):
        rows = max(1, our_budget(tile_bytes) // (2 * inp.V * inp.hidden.element_size()))
        return f"tiles of {min(rows, inp.counted)} tokens x {inp.V}"
    if name == "trl":
        return f"tiles of {min(inp.counted, TRL_TOKEN_CHUNK)} tokens x {trl_chunk_size(inp, tile_bytes)}"
    if name == "liger":
        return f"tiles of {inp.hidden.shape[1]} tokens x {min(inp.V, 4096)}, float32"
    return f"logits of {inp.hidden.shape[0] * inp.hidden.shape[1]} tokens x {inp.V}"


def forward_backward(run, inp):
    loss = run(inp)
    gh, gw = torch.autograd.grad(loss, (inp.hidden, inp.weight))
    return loss.detach(), gh, gw
