"""The peers' vocabulary kernels, compiled and counted as compiler.py counts ours (optional: only those
installed; shown beside ours in the roofline, never part of the check): Liger-Kernel's GRPO loss forward
and backward (pip install liger-kernel==0.8.5) and TRL's log-prob / entropy forward, each with its own
launcher's settings."""
from __future__ import annotations

import os

import torch

from .compiler import T_REAL, V_REAL, _Ptr, compile_kernel


def _load_peer_file(package, relpath):
    """A peer's kernel module, loaded from its file without importing the package (whose __init__ may pull
    in much more); None when the package is not installed."""
    import importlib.util
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], relpath)
    if not os.path.exists(path):
        return None
    mspec = importlib.util.spec_from_file_location(f"_aot_peer_{package}", path)
    mod = importlib.util.module_from_spec(mspec)
    mspec.loader.exec_module(mod)
    return mod


def peer_kernels(dtype=torch.bfloat16, V=V_REAL, L=T_REAL):
    """[(kernel, peer)] for the peers that are installed, each with its own launcher's settings (read from
    its source, the version named): Liger-Kernel's GRPO loss, token-level path (liger_kernel/ops/grpo_loss.py,
    0.8.5: forward BLOCK_N 2048, 1 warp, 2 stages; backward BLOCK_N 4096, 16 warps, 1 stage; V and L are
    constexpr there; GRPO loss type, beta 0.04 with a reference model, no old log-probs, a completion mask),
    and TRL's log-prob / entropy forward (trl/kernels/logprob_entropy.py: BLOCK_SIZE 1024, default 4 warps;
    its backward has no loop over the vocabulary, one block per program, so it is not listed)."""
    out = []
    P = _Ptr
    liger = _load_peer_file("liger_kernel", os.path.join("ops", "grpo_loss.py"))
    if liger is not None:
        common = dict(TEMPERATURE=1.0, BETA=0.04, EPS_LOW=0.2, EPS_HIGH=0.2, LOSS_TYPE=0, SAPO_TEMP_POS=1.0,
                      SAPO_TEMP_NEG=1.05, DELTA=0.0, USE_BIAS_CORRECTION_KL=False, L=L, N=V)
        fwd = dict(LOGITS=P(dtype), OLD_LOGP=None, REF_LOGP=P(torch.float32), INPUT_IDS=P(torch.int64),
                   COMPLETION_MASK=P(torch.int64), ADVANTAGES=P(torch.float32), VLLM_IS_RATIO=None,
                   VLLM_IS_RATIO_STRIDE=0, PHI_SEQ=None, LOSS=P(torch.float32), LSE=P(torch.float32),
                   KL=P(torch.float32), IS_CLIPPED=P(torch.bool), BLOCK_N=2048, **common)
        out.append((liger._grpo_loss_fwd_kernel, dict(provider="liger-kernel", variant="-", kwargs=fwd,
                                                     block=2048, num_warps=1, num_stages=2)))
        bwd = dict(DLOSS=P(torch.float32), DLOGITS=P(dtype), LOGITS=P(dtype), OLD_LOGP=None,
                   REF_LOGP=P(torch.float32), INPUT_IDS=P(torch.int64), ADVANTAGES=P(torch.float32),
                   COMPLETION_MASK=P(torch.int64), LSE=P(torch.float32), VLLM_IS_RATIO=None,
                   VLLM_IS_RATIO_STRIDE=0, PHI_SEQ=None, loss_stride0=L, loss_stride1=1, BLOCK_N=4096, **common)
        out.append((liger._grpo_loss_bwd_kernel, dict(provider="liger-kernel", variant="-", kwargs=bwd,
                                                     block=4096, num_warps=16, num_stages=1)))
    trl = _load_peer_file("trl", os.path.join("kernels", "logprob_entropy.py"))
    if trl is not None:
        kw = dict(logits_ptr=P(dtype), index_ptr=P(torch.int64), row_mask_ptr=P(torch.bool),
                  logprobs_ptr=P(torch.float32), entropy_ptr=P(torch.float32), log_z_ptr=P(torch.float32),
                  expected_logit_ptr=P(torch.float32), logits_batch_stride=L * V, logits_row_stride=V,
                  index_batch_stride=L, index_row_stride=1, mask_batch_stride=L, mask_row_stride=1, n_cols=V,
                  rows_per_batch=L, TEMPERATURE=1.0, HAS_MASK=True, BLOCK_SIZE=1024)
        out.append((trl._forward_kernel, dict(provider="trl", variant="-", kwargs=kw, block=1024, num_warps=4,
                                              num_stages=3)))
    return out


def report_peers(arch=90, dtype=torch.bfloat16):
    return [compile_kernel(k, dtype, arch, peer=p) for k, p in peer_kernels(dtype)]
