"""The epilogue kernel's hyper-parameters read by pointer: a schedule's 0-d tensors (pipeline/epilogue.py hyper)
replace the float arguments its HP code names, in the form the eager path uses."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _hp(x, hp_ptr, HP: tl.constexpr, K: tl.constexpr, F: tl.constexpr):
    """Float argument K of the epilogue: x by value, or where HP's bits 4K..4K+3 hold j > 0 the hyper-parameter
    hp[j - 1] given as a device tensor (pipeline/epilogue.hyper), in the form F (0: itself, 1: 1 - it, 2: 1 +
    it) formed in float64 and rounded to float32, as the eager path's float32 or float64 tensor."""
    J: tl.constexpr = (HP >> (4 * K)) & 15
    if J != 0:
        v = tl.load(hp_ptr + (J - 1)).to(tl.float64)
        if F == 1:
            v = 1.0 - v
        elif F == 2:
            v = 1.0 + v
        x = v.to(tl.float32)
    return x


@triton.jit
def _hyper(hp_ptr, lo, hi, delta, dual_c, beta, ent_coef, penalty, sapo_pos, sapo_neg, dro_beta, off_thr, top_q,
           thr, HP: tl.constexpr):
    """The epilogue's float hyper-parameters (pipeline/epilogue.HP_SLOTS' order), each by value or read by
    pointer as HP says; lo and hi as 1 - eps_low and 1 + eps_high where HP's bit 52 is set (the PPO clip's)."""
    BOUNDS: tl.constexpr = (HP >> 52) & 1
    return (_hp(lo, hp_ptr, HP, 0, BOUNDS), _hp(hi, hp_ptr, HP, 1, 2 * BOUNDS), _hp(delta, hp_ptr, HP, 2, 0),
            _hp(dual_c, hp_ptr, HP, 3, 0), _hp(beta, hp_ptr, HP, 4, 0), _hp(ent_coef, hp_ptr, HP, 5, 0),
            _hp(penalty, hp_ptr, HP, 6, 0), _hp(sapo_pos, hp_ptr, HP, 7, 0), _hp(sapo_neg, hp_ptr, HP, 8, 0),
            _hp(dro_beta, hp_ptr, HP, 9, 0), _hp(off_thr, hp_ptr, HP, 10, 0), _hp(top_q, hp_ptr, HP, 11, 1),
            _hp(thr, hp_ptr, HP, 12, 0))


@triton.jit
def _gate_on(hp_ptr, HP: tl.constexpr):
    """The entropy filter's gate read by pointer (HP's bits 56..59: its index in hp + 1; pipeline/epilogue
    _gate): 1 where initial_entropy > entropy_threshold (the filter off), else 0; 0 without one."""
    J: tl.constexpr = (HP >> 56) & 15
    if J != 0:
        return (tl.load(hp_ptr + (J - 1)).to(tl.float32) != 0.0).to(tl.int32)
    return tl.zeros((), tl.int32)
