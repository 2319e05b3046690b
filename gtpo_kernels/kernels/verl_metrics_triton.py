"""The metrics verl 0.9.1's loss modes log, in one launch (integrations/verl_modes.mode_metrics holds their
definitions in torch, this kernel's twin): per block of tokens the mask-weighted sums of

    0  -log r (r clamped to [-20, 20] where the mode clamps it; kl_cov: |log r|)   -> actor/ppo_kl
    1  the mode's clipped tokens                                                   -> actor/pg_clipfrac
    2  the mode's lower clip                                                       -> actor/pg_clipfrac_lower
    3  the mask

written to out[4 pid:4 pid + 4]; program 0 also copies `extra` (a 0-d value: clip_cov's chosen fraction)
to out[4 n_blocks]. The host reads them at once and sums the blocks (no reduction launch). MODE: 0 vanilla,
1 dppo_tv, 2 dppo_kl, 3 cispo, 4 geo_mean, 5 clip_cov, 6 kl_cov, 7 dro. Offsets are int64; no size is a
compile-time constant.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
MODES = {"vanilla": 0, "dppo_tv": 1, "dppo_kl": 2, "cispo": 3, "geo_mean": 4, "clip_cov": 5, "kl_cov": 6, "dro": 7}


@triton.jit(do_not_specialize=["N", "lo", "hi", "c"])
def _verl_metrics_kernel(logp_ptr, old_ptr, adv_ptr, mask_ptr, extra_ptr, out_ptr, N, lo, hi, c,
                         MODE: tl.constexpr, HAS_EXTRA: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    o = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inb = o < N
    w = tl.load(mask_ptr + o, mask=inb, other=0).to(tl.float32)
    on = w != 0.0
    lp = tl.load(logp_ptr + o, mask=inb, other=0.0).to(tl.float32)
    old = tl.load(old_ptr + o, mask=inb, other=0.0).to(tl.float32)
    a = tl.load(adv_ptr + o, mask=inb, other=0.0).to(tl.float32)
    lr = lp - old
    if MODE <= 3:  # vanilla, dppo, cispo clamp log r
        lr = tl.minimum(tl.maximum(lr, -20.0), 20.0)
    r = tl.exp(lr)
    kl = tl.abs(lr) if MODE == 6 else -lr
    clip = tl.zeros([BLOCK], tl.float32)
    lower = tl.zeros([BLOCK], tl.float32)
    if MODE == 0:
        l1 = -a * r
        l2 = -a * tl.minimum(tl.maximum(r, 1.0 - lo), 1.0 + hi)
        clip = (l2 > l1).to(tl.float32)
        lower = ((tl.maximum(l1, l2) > -a * c) & (a < 0.0)).to(tl.float32)
    if (MODE == 1) | (MODE == 2):
        p = tl.exp(lp)
        q = tl.exp(old)
        if MODE == 1:
            valid = tl.where(a > 0.0, p - q <= hi, p - q >= -lo)
        else:
            bkl = q * (old - lp) + (1.0 - q) * tl.log((1.0 - q + 1e-8) / (1.0 - p + 1e-8))
            valid = tl.where(a > 0.0, (bkl <= hi) | (p <= q), (bkl <= lo) | (p >= q))
        v = valid.to(tl.float32)
        clip = 1.0 - v
        lower = (r > c).to(tl.float32) * v
    if MODE == 3:
        clip = (r != tl.minimum(tl.maximum(r, 1.0 - lo), 1.0 + hi)).to(tl.float32)
    if MODE == 4:
        cl = (lr != tl.minimum(tl.maximum(lr, -lo), hi)).to(tl.float32)
        clip = cl * (a > 0.0).to(tl.float32)
        lower = cl * (a < 0.0).to(tl.float32)
    sums = tl.where(on, kl * w, 0.0)
    tl.store(out_ptr + pid * 4, tl.sum(sums, axis=0))
    tl.store(out_ptr + pid * 4 + 1, tl.sum(tl.where(on, clip * w, 0.0), axis=0))
    tl.store(out_ptr + pid * 4 + 2, tl.sum(tl.where(on, lower * w, 0.0), axis=0))
    tl.store(out_ptr + pid * 4 + 3, tl.sum(w, axis=0))
    if HAS_EXTRA:
        if pid == 0:
            tl.store(out_ptr + tl.cdiv(N, BLOCK) * 4, tl.load(extra_ptr).to(tl.float32))


def verl_metrics(mode, logp, old, adv, mask, eps_low, eps_high, c, extra=None):
    """-> out (4 n_blocks + (extra given),) float32 on the device: the blocks' sums (see the docstring), then
    `extra`. logp, old, adv, mask: (B, T) of any strides (made contiguous); mask of any dtype."""
    N = logp.numel()
    n_blocks = triton.cdiv(N, BLOCK)
    size = 4 * max(n_blocks, 1) + (extra is not None)
    out = (torch.empty if N else torch.zeros)(size, dtype=torch.float32, device=logp.device)  # (every entry written)
    if N:
        flat = [x.detach().reshape(-1).contiguous() for x in (logp, old, adv, mask)]
        _verl_metrics_kernel[(n_blocks,)](*flat, out if extra is None else extra.reshape(1), out, N,
                                          float(eps_low), float(eps_high), float(c), MODE=MODES[mode],
                                          HAS_EXTRA=extra is not None, BLOCK=BLOCK)
    elif extra is not None:
        out[-1:] = extra.reshape(1)
    return out
