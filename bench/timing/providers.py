"""The implementations compared, one function per provider.

Each `make_<name>(cfg, device)` returns a callable `run(inp) -> (loss, logps, entropy)` (logps / entropy
None when the implementation does not return them), or raises `Unavailable(reason)`. The runner
differentiates `loss` with respect to `inp.logits`. Every provider computes the same loss on the same
inputs: the config's preset, the precomputed conflict weights `inp.lam`, on-policy (no old log-probs);
except where a row says otherwise (`config_for`, `WORK`): Liger-Kernel computes GRPO, and ours is also
timed doing that same work ('triton-grpo').

Each row says what it computes (`work(name, preset)`: the loss, whether entropies are returned and
whether the inputs are checked), so that a time is never read against a peer that does less.
"""
from __future__ import annotations

import importlib
import time

import torch

from gtpo_kernels import GTPOConfig, gtpo_loss

PROVIDERS = ("triton", "triton-novalidate", "triton-grpo", "torch", "eager", "compile", "liger")
LABELS = {
    "triton": "gtpo-kernels triton",
    "triton-novalidate": "gtpo-kernels triton, validate=False",
    "triton-grpo": "gtpo-kernels triton, grpo, validate=False",
    "torch": "gtpo-kernels torch",
    "eager": "eager baseline",
    "compile": "torch.compile(eager)",
    "liger": "liger triton_grpo_loss",
}
NOTES = {
    "liger": "GRPO preset; returns no entropy",
    "triton-grpo": "Liger's work: GRPO, no conflict weights nor entropy control",
    "compile": "dynamic=True, compile time reported apart",
}
# what each row computes ({preset}: the run's): the loss, entropies, input checks
WORK = {
    "triton": "{preset} preset, entropies returned, validate=True (inputs checked: one host read per call)",
    "triton-novalidate": "{preset} preset, entropies returned, validate=False (no check, no host read)",
    "triton-grpo": "grpo preset (Liger's loss: no conflict weights, no entropy filter or shaping, no entropy "
                   "gradient), validate=False; entropies still returned (the forward kernel computes them in "
                   "its one pass: gtpo_loss has no switch to drop them)",
    "torch": "{preset} preset, entropies returned, validate=True (the chunked torch backend)",
    "eager": "{preset} preset in autograd from a float32 copy of the logits, entropies returned, no checks",
    "compile": "torch.compile of the eager loss, entropies returned, no checks",
    "liger": "GRPO (liger_kernel triton_grpo_loss, loss_type='grpo', on-policy, beta=0, inplace=False): no "
             "entropy, no input checks",
}
VALIDATES = {"triton": True, "triton-novalidate": False, "triton-grpo": False, "torch": True, "eager": False,
             "compile": False, "liger": False}


def work(name: str, preset: str) -> str:
    """What the row of `name` computes, in a run of `preset`."""
    return WORK[name].format(preset=preset)


class Unavailable(Exception):
    """The provider cannot run here; the message says why (shown in the table)."""


def require(module, attr, what, extra="bench"):
    """`module.attr`, or Unavailable saying what is missing and how to get it."""
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as e:
        raise Unavailable(f"{what} not installed ({type(e).__name__}; pip install -e \".[{extra}]\")")


def make_from(namespace: dict, providers, name: str, *args):
    """The provider `name` of a suite: namespace['make_<name>'](*args) ('-' in a name is '_' in its
    function's), after checking the name."""
    if name not in providers:
        raise ValueError(f"unknown implementation {name!r}; expected some of {providers}")
    return namespace[f"make_{name.replace('-', '_')}"](*args)


def interpreted(device) -> bool:
    """Triton on CPU runs in its interpreter: counted for bytes, never timed."""
    return torch.device(device).type == "cpu"


# ---- ours ---------------------------------------------------------------------------------------

def _ours(backend, validate=True, weights=True):
    """weights=False: the conflict weights are not passed (a config without them: 'triton-grpo')."""
    def make(cfg: GTPOConfig, device):
        if backend == "triton" and interpreted(device):
            from gtpo_kernels.kernels.dispatch import interpreter_active
            if not interpreter_active():
                raise Unavailable("needs CUDA, or TRITON_INTERPRET=1 for the interpreter")

        def run(inp):
            kw = dict(lam=inp.lam, n_conf=inp.n_conf) if weights else {}
            out = gtpo_loss(inp.logits, inp.ids, inp.adv, inp.mask, logits_start=0, config=cfg, backend=backend,
                            validate=validate, **kw)
            return out.loss, out.logps, out.entropy
        return run
    return make


make_triton = _ours("triton")
make_torch = _ours("torch")
make_triton_novalidate = _ours("triton", validate=False)
make_triton_grpo = _ours("triton", validate=False, weights=False)


# ---- what trainers do today ---------------------------------------------------------------------

def eager_loss(logits, ids, mask, adv, lam, cfg: GTPOConfig):
    """The eager baseline: the whole logits upcast to float32, log_softmax, gather of the targets,
    entropy as -(p * logp).sum(-1) from the same tensor, and the same loss on top, all in autograd.
    Logits are (B, T + 1, V); the last row predicts nothing."""
    logp_all = torch.log_softmax(logits[:, :-1].float() / cfg.temperature, dim=-1)
    logp = logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    m = mask.float()
    n = m.sum(1).clamp(min=1)
    seq_ent = (entropy.detach() * m).sum(1) / n  # the entropy filter and penalty (spec 2)
    if cfg.entropy_threshold is None or (cfg.initial_entropy is not None
                                         and cfg.initial_entropy > cfg.entropy_threshold):
        kept = torch.ones_like(adv, dtype=torch.bool)
    else:
        kept = seq_ent <= cfg.entropy_threshold
    a_hat = torch.where(kept, adv - cfg.entropy_penalty * seq_ent, 0.0)[:, None]
    ratio = torch.exp(logp - logp.detach())
    surrogate = torch.minimum(ratio * a_hat, ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * a_hat)
    tok = -lam * surrogate
    loss = ((tok * m).sum(1) / n).mean()
    return loss, logp * m, entropy * m


def _check_eager_config(cfg):
    if (cfg.loss_agg != "seq-mean-token-mean" or not cfg.clip or cfg.beta or cfg.entropy_coef
            or cfg.temperature <= 0):
        raise Unavailable("the eager baseline implements the gtpo and grpo presets only")


def make_eager(cfg: GTPOConfig, device):
    _check_eager_config(cfg)
    return lambda inp: eager_loss(inp.logits, inp.ids, inp.mask, inp.adv, inp.lam, cfg)


def make_compile(cfg: GTPOConfig, device):
    """torch.compile of the eager baseline, compiled once with dynamic shapes. The first call's extra
    time is kept in `run.compile_s` (reported apart)."""
    _check_eager_config(cfg)
    try:
        import torch._inductor  # noqa: F401
    except Exception as e:  # pragma: no cover
        raise Unavailable(f"torch.compile unavailable: {e}")
    fn = torch.compile(lambda z, ids, m, a, lam: eager_loss(z, ids, m, a, lam, cfg), dynamic=True)

    def run(inp):
        if run.compile_s is None:  # first call: compile forward and backward, time it
            t0 = time.perf_counter()
            out = fn(inp.logits, inp.ids, inp.mask, inp.adv, inp.lam)
            torch.autograd.grad(out[0], inp.logits)
            if inp.logits.is_cuda:
                torch.cuda.synchronize()
            run.compile_s = time.perf_counter() - t0
        return fn(inp.logits, inp.ids, inp.mask, inp.adv, inp.lam)
    run.compile_s = None
    return run


# ---- Liger-Kernel -------------------------------------------------------------------------------

def make_liger(cfg: GTPOConfig, device):
    """Liger-Kernel's `triton_grpo_loss` (liger_kernel.transformers.grpo_loss), called as TRL's GRPO:
    loss_type='grpo' (per-completion token mean, then the batch mean), on-policy (old_logp=None),
    beta=0, our clip range and temperature, reduce=True. inplace=False, as ours (its default True
    overwrites the logits with the gradient). It takes logits (B, T + 1, V) and returns no entropy."""
    if torch.device(device).type != "cuda":
        raise Unavailable("not run: needs CUDA")
    triton_grpo_loss = require("liger_kernel.transformers.grpo_loss", "triton_grpo_loss", "Liger-Kernel")

    def run(inp):
        loss, _metrics = triton_grpo_loss(
            inp.logits, None, None, inp.ids, inp.adv, inp.mask.to(torch.int32).contiguous(),
            temperature=cfg.temperature, beta=0.0, eps_low=cfg.eps_low, eps_high=cfg.eps_high,
            inplace=False, loss_type="grpo", reduce=True)
        return loss, None, None
    return run


LIGER_CONFIG = GTPOConfig.preset("grpo")  # what Liger computes, whatever preset the run uses
GRPO_ROWS = ("liger", "triton-grpo")  # the rows that compute Liger's loss


def config_for(name: str, cfg: GTPOConfig) -> GTPOConfig:
    return LIGER_CONFIG.replace(temperature=cfg.temperature, eps_low=cfg.eps_low,
                                eps_high=cfg.eps_high) if name in GRPO_ROWS else cfg


def make(name: str, cfg: GTPOConfig, device):
    return make_from(globals(), PROVIDERS, name, config_for(name, cfg), device)


def missing_peers() -> list:
    """'<peer> (pip install ...)' for each comparison library that is not installed here."""
    import importlib.util
    peers = (("trl", "TRL (its fused LM head, in the linear suite)"),
             ("liger_kernel", "Liger-Kernel (its fused linear GRPO loss, in the linear suite; on CUDA also its loss "
                              "on logits)"))
    return [f"{what}: pip install -e \".[bench]\"" for mod, what in peers if importlib.util.find_spec(mod) is None]

