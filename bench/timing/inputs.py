"""The benchmark's inputs, and the check of an implementation against the float64 reference on them.

A problem of `tokens` positions and vocabulary `V` is `B = tokens // T` completions of `T` rows in groups
of G = 8, shaped as a trainer sees it:
- logits (B, T + 1, V) in the benchmark dtype: the model's output for the completion rows plus the last
  row, which predicts nothing (Liger-Kernel's layout; our kernels get `logits_start=0` and write zeros
  there). Each row has one confident token (its logit a few nats above the log of the row's noise mass)
  so token entropies are in the range of a trained policy and the entropy filter keeps most completions;
- completion ids: the confident token 90% of the time, else uniform; every group shares a 4-token
  prefix and a 2-token suffix (as chat templates do), which gives real conflict runs;
- completion lengths uniform in [0.8 T, T]: about 10% of positions masked out (id 0 there);
- advantages from uniform random rewards, normalized inside each group.
The conflict weights are computed once, as a trainer does at advantage time, and given to every
implementation.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

import gtpo_reference
from gtpo_kernels import GTPOConfig, conflict_weights

G = 8  # completions per prompt
T_MAX = 512  # rows per completion, at most
FULL_CHECK_ELEMENTS = 1 << 24  # above this many logits the check samples whole completions

# Error bounds of spec section 7, by logits dtype: (logp/entropy/loss, gradient). They are the bar for
# our kernels. The comparison implementations sum exp over the vocabulary in float32 the ordinary way
# (an error of a few 1e-5 at V = 32000); they pass with values within BASELINE_VALUE_BOUND, and the
# table marks with '*' those beyond the spec's bound.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-5, 1e-5),
             torch.bfloat16: (1e-5, 1e-2), torch.float16: (1e-5, 1e-2)}
BASELINE_VALUE_BOUND = 1e-4


@dataclasses.dataclass
class Inputs:
    logits: torch.Tensor  # (B, T + 1, V), requires grad
    ids: torch.Tensor  # (B, T) int64
    mask: torch.Tensor  # (B, T) bool
    adv: torch.Tensor  # (B,) float32
    lam: torch.Tensor  # (B, T) float32, from conflict_weights
    n_conf: torch.Tensor  # (B,)
    tokens: int
    V: int

    @property
    def B(self):
        return self.ids.shape[0]

    @property
    def T(self):
        return self.ids.shape[1]

    @property
    def counted(self) -> int:
        return int(self.mask.sum())


def shape_for(tokens: int):
    """(B, T) with B * T == tokens, T <= T_MAX, B a multiple of G."""
    T = min(T_MAX, tokens // G)
    if T < 8 or tokens % (G * T):
        raise ValueError(f"tokens must be a multiple of {G} * T with T = min({T_MAX}, tokens / {G}) >= 8; "
                         f"got {tokens}")
    return tokens // T, T


def make_inputs(tokens: int, V: int, dtype=torch.bfloat16, device="cpu", seed=0, config="gtpo") -> Inputs:
    B, T = shape_for(tokens)
    gen = torch.Generator(device=device).manual_seed(seed)
    dev = torch.device(device)
    top = torch.randint(0, V, (B, T + 1), generator=gen, device=dev)
    # confident margin over the noise: per completion a level in [1, 3.5], per row + U(0, 4) nats
    level = 1.0 + 2.5 * torch.rand(B, 1, generator=gen, device=dev)
    margin = level + 4.0 * torch.rand(B, T + 1, generator=gen, device=dev)
    bump = margin + math.log(V) + 0.5  # log(sum of exp(N(0,1) noise)) ~ log V + 1/2
    logits = torch.empty(B, T + 1, V, dtype=dtype, device=dev)
    for i in range(B):  # one completion at a time: no float32 copy of the whole problem
        row = torch.randn(T + 1, V, generator=gen, device=dev)
        row.scatter_(1, top[i, :, None], bump[i, :, None])
        logits[i] = row.to(dtype)
    ids = torch.where(torch.rand(B, T, generator=gen, device=dev) < 0.9, top[:, :T],
                      torch.randint(0, V, (B, T), generator=gen, device=dev))
    lengths = T - (0.2 * T * torch.rand(B, generator=gen, device=dev)).long()
    mask = torch.arange(T, device=dev)[None, :] < lengths[:, None]
    groups = B // G
    prefix = torch.randint(0, V, (groups, 4), generator=gen, device=dev).repeat_interleave(G, 0)
    suffix = torch.randint(0, V, (groups, 2), generator=gen, device=dev).repeat_interleave(G, 0)
    ids[:, :4] = prefix
    last = lengths - 1
    ar = torch.arange(B, device=dev)
    ids[ar, last - 1] = suffix[:, 0]
    ids[ar, last] = suffix[:, 1]
    ids = torch.where(mask, ids, torch.zeros_like(ids))
    rewards = torch.rand(B, generator=gen, device=dev).reshape(groups, G)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)).reshape(B)
    cfg = GTPOConfig.preset(config) if isinstance(config, str) else config
    lam, n_conf = conflict_weights(ids, mask, adv, G, config=cfg)
    if not cfg.use_conflict_mask:
        lam, n_conf = torch.ones_like(lam), torch.ones_like(n_conf)
    return Inputs(logits.requires_grad_(), ids, mask, adv.float(), lam, n_conf, tokens, V)


def config_kwargs(cfg: GTPOConfig) -> dict:
    return dataclasses.asdict(cfg)


@dataclasses.dataclass
class Check:
    ok: bool
    detail: str  # worst errors, for the report
    errors: dict


def _rel_err(x, ref, m):
    x, ref = x.detach().double()[m], ref.detach().double()[m]
    if ref.numel() == 0:
        return 0.0
    return float(((x - ref).abs() / ref.abs().clamp(min=1)).max())


def _grad_err(g, ref):
    g, ref = g.double(), ref.double()
    denom = ref.norm()
    err = float((g - ref).norm() / denom) if denom > 0 else float(g.norm())
    zeros_ok = bool((g[ref == 0] == 0).all())
    return err, zeros_ok


def check(result, grad, inp: Inputs, cfg: GTPOConfig, sample: Optional[bool] = None,
          strict: bool = True) -> Check:
    """Compares one implementation's (loss, logps, entropy) and gradient with the float64 reference.

    Small problems: the whole batch. Large ones (more than FULL_CHECK_ELEMENTS logits, or sample=True):
    the first, a middle and the last completion, each alone in the reference with the full batch's
    conflict weights; per-token values are per completion and the gradient of the default aggregation
    ('seq-mean-token-mean') of one completion is B times its share in the batch. The loss is then not
    compared. logps / entropy may be None (an implementation that does not return them).
    strict=False (comparison implementations): values within BASELINE_VALUE_BOUND pass."""
    loss, logps, entropy = result
    tol_val, tol_grad = TOLERANCE[inp.logits.dtype]
    kw = config_kwargs(cfg)
    if sample is None:
        sample = inp.logits.numel() > FULL_CHECK_ELEMENTS

    if not sample:
        rows = [slice(0, inp.B)]
    else:
        if cfg.loss_agg != "seq-mean-token-mean":
            raise ValueError("the sampled check handles loss_agg='seq-mean-token-mean' only")
        rows = [slice(i, i + 1) for i in sorted({0, inp.B // 2, inp.B - 1})]
    lam_ref, nconf_ref = gtpo_reference.conflict_weights(inp.ids, inp.mask, inp.adv, G, kw["conflict_pos_weight"],
                                                         kw["conflict_neg_weight"])
    worst = dict(logp=0.0, entropy=0.0, loss=0.0, grad=0.0)
    zeros_ok = True
    for sl in rows:
        z = inp.logits.detach()[sl].double().requires_grad_()  # float64 gradient, not rounded
        lam = lam_ref[sl] if cfg.use_conflict_mask else None
        r = gtpo_reference.gtpo_loss(z, inp.ids[sl], inp.adv[sl], inp.mask[sl], lam=lam, n_conf=nconf_ref[sl],
                                     **kw)
        g_ref, = torch.autograd.grad(r["loss"], z)
        scale = (sl.stop - sl.start) / inp.B
        m = inp.mask[sl]
        if logps is not None:
            worst["logp"] = max(worst["logp"], _rel_err(logps[sl], r["logps"], m))
        if entropy is not None:
            worst["entropy"] = max(worst["entropy"], _rel_err(entropy[sl], r["entropy"], m))
        if not sample:
            worst["loss"] = _rel_err(loss.detach().reshape(1), r["loss"].detach().reshape(1),
                                     torch.ones(1, dtype=torch.bool, device=m.device))
        e, zok = _grad_err(grad[sl], g_ref.to(torch.float64) * scale)
        worst["grad"] = max(worst["grad"], e)
        zeros_ok = zeros_ok and zok
        del z, r, g_ref
    errs = dict(worst, zeros_ok=zeros_ok, sampled=sample)
    vals = max(worst["logp"], worst["entropy"], worst["loss"])
    within_spec = vals <= tol_val and worst["grad"] <= tol_grad and zeros_ok
    ok = within_spec or (not strict and vals <= max(tol_val, BASELINE_VALUE_BOUND)
                         and worst["grad"] <= tol_grad and zeros_ok)
    errs["within_spec"] = within_spec
    detail = (f"logp {worst['logp']:.1e} entropy {worst['entropy']:.1e} loss {worst['loss']:.1e} "
              f"grad {worst['grad']:.1e} (bounds {tol_val:.0e}/{tol_grad:.0e})"
              + ("" if zeros_ok else ", nonzero gradient where the reference's is 0")
              + (" [sampled completions]" if sample else ""))
    return Check(ok, detail, errs)
