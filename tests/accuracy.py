"""Largest errors against the float64 reference, per dtype and backend, over a sweep of random batches,
and the bytes saved for backward per token. Run: `python tests/accuracy.py` (about a minute on a 2-core CPU;
the Triton kernels run under the interpreter)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import warnings  # noqa: E402

# Triton's interpreter runs the kernels in numpy, which warns "overflow encountered in multiply" where a
# kernel scales its -FLT_MAX sentinel by log2(e) on purpose (-inf, then exp2 gives 0, as on a GPU, which
# overflows silently); the results are unaffected (compared with the reference below)
warnings.filterwarnings("ignore", message="overflow encountered in multiply", category=RuntimeWarning,
                        module="triton.runtime.interpreter")

import argparse  # noqa: E402
import dataclasses  # noqa: E402

import torch  # noqa: E402

import gtpo_reference as ref  # noqa: E402
from gtpo_kernels import GTPOConfig, gtpo_loss  # noqa: E402

PRESETS = ["gtpo", "gtpo-official", "grpo", "dapo", "dr_grpo"]


def one(seed, dtype, backend, B=8, T=24, V=1000):
    g = torch.Generator().manual_seed(seed)
    G = 4
    x = (torch.randn(B, T + 1, V, generator=g) * (1 + 3 * torch.rand(B, T + 1, 1, generator=g)))
    hot = torch.randint(0, V, (B, T + 1), generator=g)
    x.scatter_add_(-1, hot[..., None], torch.full((B, T + 1, 1), 8.0))  # some confident rows
    ids = torch.where(torch.rand(B, T, generator=g) < 0.5, hot[:, 1:], torch.randint(0, V, (B, T), generator=g))
    ids[1::G, :5] = ids[0::G, :5]  # shared prefixes inside groups
    mask = torch.arange(T)[None] < torch.randint(T // 2, T + 1, (B, 1), generator=g)
    mask &= torch.rand(B, T, generator=g) > 0.1
    adv = torch.randn(B, generator=g)
    x = x.to(dtype)
    cfg = GTPOConfig.preset(PRESETS[seed % len(PRESETS)], temperature=[1.0, 0.7][seed % 2],
                            entropy_coef=0.01 * (seed % 3 == 0))
    if cfg.entropy_threshold is not None:
        cfg = cfg.replace(entropy_threshold=6.0)  # keep some completions
    lp0, _ = ref.token_logprobs(x[:, 1:].double(), ids, cfg.temperature, mask)
    old = (lp0 + 0.3 * torch.randn(B, T, generator=g)).float() if seed % 4 else None
    xx = x.clone().requires_grad_()
    out = gtpo_loss(xx, ids, adv, mask, group_size=G, old_logps=old, logits_start=1, config=cfg, backend=backend)
    out.loss.backward()
    xr = x.double().requires_grad_()
    r = ref.gtpo_loss(xr, ids, adv, mask, group_size=G, old_logps=old, logits_start=1, **dataclasses.asdict(cfg))
    r["loss"].backward()

    def val(a, b):
        return float(((a.double() - b.double()).abs() / b.double().abs().clamp(min=1)).max())
    return {
        "logp": val(out.logps, r["logps"]),
        "entropy": val(out.entropy, r["entropy"]),
        "loss": val(out.loss.detach(), r["loss"].detach()),
        "grad": float((xx.grad.double() - xr.grad).norm() / xr.grad.norm()),
    }


def saved_bytes_per_token(backend, B=8, T=64, V=512, entropy_coef=0.01):
    logits = torch.randn(B, T, V, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        gtpo_loss(logits, torch.randint(0, V, (B, T)), torch.randn(B), group_size=4, backend=backend,
                  old_logps=torch.randn(B, T), config=GTPOConfig(entropy_coef=entropy_coef, entropy_threshold=None))
    ptr = logits.untyped_storage().data_ptr()
    return sum(t.numel() * t.element_size() for t in saved if t.untyped_storage().data_ptr() != ptr) / (B * T)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, default=10)
    a = ap.parse_args()
    print(f"{'backend':8} {'dtype':9} {'logp':>9} {'entropy':>9} {'loss':>9} {'grad':>9}   (max over {a.seeds} batches)")
    for backend in ("triton", "torch"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            worst = {}
            for s in range(a.seeds):
                for k, v in one(s, dtype, backend).items():
                    worst[k] = max(worst.get(k, 0.0), v)
            print(f"{backend:8} {str(dtype)[6:]:9} " + " ".join(f"{worst[k]:9.1e}" for k in ("logp", "entropy", "loss", "grad")))
    for backend in ("triton", "torch"):
        for coef in (0.0, 0.01):
            print(f"saved for backward, {backend}, entropy_coef={coef}: "
                  f"{saved_bytes_per_token(backend, entropy_coef=coef):.1f} bytes/token beyond the logits")


if __name__ == "__main__":
    main()
