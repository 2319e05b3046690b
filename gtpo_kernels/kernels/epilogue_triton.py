"""The epilogue (Triton): every O(B) / O(N) step of the loss between the two vocabulary passes in one launch.

From the forward kernel's per-token (logp, H, flags) it computes what objective/surrogate.py computes with ~100 small
torch ops (spec 2, 4, 9 for the PPO-clip policy term at the token or the sequence level, and the token-level terms of
POLICIES: cispo, sapo, verl's gpg, verl_cispo, dro, dppo_tv, dppo_kl, geo_mean, clip_cov and kl_cov, TRL's vespo;
clip_cov and kl_cov in two launches around a sort: epilogue_cov.py): the entropy control (Hbar, the filter delta,
Ahat), the ratio, the clip, delta and the dual clip, the policy term's multipliers in spec 9's order (the conflict
weights' lam, the off-policy sequence mask, the rollout weights per token or per completion), the KL term (with its
bias correction), the entropy bonus, the aggregation weights, the per-token coefficients c = dL/dlogp and e = dL/dH the
backward kernel reads, the loss value (its sum, or per token with loss_agg='none'), the outputs (lam and n_conf
included) and the metrics, and a status word that validation reads once (bit 0: a counted row was flagged; bit 1: the
entropy filter dropped every completion; bit 2, validating: an input check failed, the caller then runs the checks
again on the host to raise the error that names the argument). The eager code stays the torch backend's path and this
kernel's twin in tests.

A tile of the LM head's fused schedule runs it with pass 2 over the tile's completions only (g_lo, g_hi): their c and e
are then final (pass 1's batch totals, the counted tokens and the longest completion, come from the mask and cu_seqlens
alone), the rest of what it writes is rewritten by the call's own launch.

One program walks the completions in order (padded: completion i owns tokens [i T, (i + 1) T); packed: [cu[i], cu[i +
1])), in blocks of BLOCK tokens, twice: pass 1 forms the per-completion sums (counted tokens, entropy, the
sequence-level log-ratio, the off-policy mask's mean (sampling logp - logp), summed in float64 as the eager seg_sum)
and the batch's, pass 2 the per-token terms, behind a barrier. At the sequence level pass 2 reads each completion twice
(d loss / d log r summed over it first). A per-completion sum is the block sums added in order: nothing depends on the
device or the grid. In the packed form cu_seqlens is read as the caller gave it: a malformed one (not from 0 to N, or
decreasing) is replaced by the stand-in the eager code uses and makes every counted token's outputs NaN. Unvalidated
invalid input gives NaN where it reaches, as the eager code: a flagged token's logp and H, non-finite advantages, old
/ ref log-probs and lam at counted tokens, a counted rollout weight that is not finite and >= 0, an n_conf that is not
finite and >= 1, a num_items_in_batch tensor that is not finite and > 0. The off-policy mask is a constant multiplier
(no gradient through its mean), as in the eager path.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .epilogue_cov import _cov_keys, _cov_kth, _cov_sel
from .epilogue_geo import _geo_log_R, _geo_sums, _kl_pivot, _vespo_phi, _vespo_sums
from .epilogue_hyper import _gate_on, _hyper
from .epilogue_terms import (_counted, _denom, _finite_or_nan, _fix_cu, _invalid_inputs, _kept_add, _metrics_store,
                             _off_policy_sum, _policy_weight, _roll_add, _roll_store, _rollout_ok, _rollout_w, _span,
                             _terms, _token_adv, _token_log_r)
from .top_entropy import _top_entropy_thr, _top_entropy_w
from .vp_merge_triton import _finish_at

# policy_loss as the kernel's POLICY (the token-level terms it computes; epilogue_terms._policy)
POLICIES = ("ppo", "cispo", "sapo", "gpg", "verl-cispo", "dro", "dppo-tv", "dppo-kl", "geo-mean", "vespo", "clip-cov",
            "kl-cov")
# loss_agg as the kernel's AGG
AGGS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "gtpo-official",
        "none")


@triton.jit(do_not_specialize=["B", "T", "N", "max_seqlen", "g_lo", "g_hi", "ratio_bits", "V_all"])
def _epilogue_kernel(
    logp_ptr, ent_ptr, bad_ptr, mask_ptr, cu_ptr,  # the forward kernel's outputs; the caller's mask; cu_seqlens
    adv_ptr, old_ptr, ref_ptr, lam_ptr, nconf_ptr, nitems_ptr, roll_ptr,  # inputs (unused ones: any tensor)
    rw_ptr,  # rollout_is_weights: per token (RW 1) or per completion (RW 2)
    srt_ptr,  # TOP_ENT: the sorted entropy keys (top_entropy.sorted_key); PHASE 1 writes the unsorted ones there
    hp_ptr,  # the hyper-parameters given as device tensors (HP: which float argument each replaces)
    draws_ptr, key_ptr, cval_ptr, cidx_ptr,  # clip_cov's uniform draws; clip_cov / kl_cov's keys, sorted, their order
    value_ptr, logp_out, ent_out, ltok_out, c_out, e_out, lam_out, nconf_out, kept_out, hbar_out,  # outputs
    scratch_ptr, cu_fix, met_ptr, status_ptr,  # (4B,) float32, (B + 1,) int64 scratch; (12,) metrics; (1,) int32
    B, T, N, max_seqlen,  # completions; tokens per completion (padded form); tokens; the packed max_seqlen or -1
    g_lo, g_hi,  # pass 2 over completions [g_lo, g_hi) only (0, B: the call; the LM head's fused tile: its own)
    lo, hi, delta, dual_c, beta, ent_coef, penalty, thr, max_len_cfg, nitems_val,  # hyper-parameters (floats)
    sapo_pos, sapo_neg, dro_beta,  # sapo's temperatures, dro's beta (floats; read by those terms only)
    off_thr, top_q,  # off_policy_mask_threshold (OFF_POLICY), 1 - top_entropy_quantile (TOP_ENT) (floats)
    k_pos, lam_pos, k_neg, lam_neg,  # vespo's gamma weights (A >= 0, else) (floats; read by vespo only)
    cov_lb, cov_ub, kl_coef, ratio_bits,  # clip_cov's bounds, kl_cov's coefficient, their ratio's float64 bits
    PACKED: tl.constexpr, HAS_MASK: tl.constexpr, HAS_OLD: tl.constexpr, HAS_KL: tl.constexpr,
    BIAS_KL: tl.constexpr, HAS_LAM: tl.constexpr, HAS_NCONF: tl.constexpr, NITEMS: tl.constexpr,
    CLIP: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_DUAL: tl.constexpr, HAS_E: tl.constexpr,
    FILTER: tl.constexpr, PENALTY: tl.constexpr, SEQ: tl.constexpr, AGG: tl.constexpr, BLOCK: tl.constexpr,
    VALIDATE: tl.constexpr = False,  # the input checks into the status word (bit 2)
    MASK_VALUES: tl.constexpr = False,  # the mask is not bool: its values must be 0 or 1
    HAS_REF: tl.constexpr = False,  # ref_logps given (checked when validating, used with HAS_KL)
    HAS_ROLL: tl.constexpr = False,  # rollout_logps given: spec 14's mismatch metrics (met[4:9])
    POLICY: tl.constexpr = 0,  # the policy term, POLICIES' index (0: ppo)
    RW: tl.constexpr = 0,  # rollout weights: 0 none, 1 per token, 2 per completion (they multiply the policy term)
    OFF_POLICY: tl.constexpr = False,  # spec 9's off-policy sequence mask (threshold off_thr)
    TOP_ENT: tl.constexpr = False,  # spec 9's top-entropy mask (the 1 - rho = top_q quantile; top_entropy.py)
    HP: tl.constexpr = 0,  # 4 bits a float argument lo .. thr (epilogue.HP_SLOTS; 0 by value, j: hp[j - 1]), the gate
    PHASE: tl.constexpr = 0,  # 0: the epilogue; 1 (clip_cov, kl_cov): pass 1 and the sort keys only (epilogue_cov)
    kst_ptr=None,  # KEPT: (N, 3) each token's kept set's (size, restored, mass) (kept_rule_triton)
    KEPT: tl.constexpr = False,  # True: spec 13's metrics of sets rebuilt by rules (met[9:12])
    TOK_ADV: tl.constexpr = False,  # adv_ptr holds an advantage per token (N,) in place of Ahat (token-level terms)
    ids_ptr=None, stats_out=None, V_all=0, VP: tl.constexpr = False,  # VP: the merge's finish in pass 1 (below)
):
    # TOK_ADV: in terms that read no completion's advantage, unvalidated (pipeline/token_terms.py checks them)
    tl.static_assert(not TOK_ADV or not (PENALTY or OFF_POLICY or SEQ or VALIDATE or POLICY == 9))
    lo, hi, delta, dual_c, beta, ent_coef, penalty, sapo_pos, sapo_neg, dro_beta, off_thr, top_q, thr = _hyper(
        hp_ptr, lo, hi, delta, dual_c, beta, ent_coef, penalty, sapo_pos, sapo_neg, dro_beta, off_thr, top_q, thr, HP)
    gate = _gate_on(hp_ptr, HP)  # the entropy filter off by the paper's gate, as a device tensor
    # the rollout weights as the policy term's multiplier: not geo_mean's and vespo's, which fold them in
    RW_MULT: tl.constexpr = RW * ((POLICY != 8) & (POLICY != 9))
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    M = tl.zeros((), tl.int32)
    n_kept = tl.zeros((), tl.int32)
    longest = tl.zeros((), tl.int64)
    h_tot = tl.zeros((), tl.float32)
    a_tot = tl.zeros((), tl.float64)  # clip_cov, kl_cov: the counted tokens' sums of A and of logp
    lp_tot = tl.zeros((), tl.float64)
    flagged = tl.zeros((), tl.int32)
    invalid = tl.zeros((), tl.int32)  # validating: any input check failed (bit 2 of the status)
    malformed = tl.zeros((), tl.int32)
    roll_sums = tl.zeros([BLOCK], tl.float32)  # spec 14: sum of k3, of |d|; max |d|; outside, NaN, kept counts
    roll_abs = tl.zeros([BLOCK], tl.float32)
    roll_max = tl.zeros([BLOCK], tl.float32)
    roll_out = tl.zeros([BLOCK], tl.int32)
    roll_nan = tl.zeros([BLOCK], tl.int32)
    roll_ok = tl.zeros([BLOCK], tl.int32)
    kept_sums = tl.zeros([4], tl.float64)  # KEPT: the counted tokens' sums of kst (its 3 columns)
    if PACKED:  # cu_seqlens as given: the stand-in (clamped into [0, N], non-decreasing, from 0 to N) and a flag
        malformed = _fix_cu(cu_ptr, cu_fix, B, N)
        tl.debug_barrier()
    # pass 1: per completion, its counted tokens, Hbar, delta, Ahat and (sequence level) mean log r
    for i in range(B):
        start, end = _span(cu_fix, i, T, PACKED)
        n_i = tl.zeros((), tl.int32)
        h_i = tl.zeros((), tl.float32)
        lr_i = tl.zeros((), tl.float32)
        off_i = tl.zeros((), tl.float64)  # sum of (sampling logp - logp) over the counted tokens
        # the completion's sums for geo_mean (of min and max of log r and its clip, of log w) and vespo (of
        # the clamped log r, of the clamped log w): epilogue_geo
        sum_lo = tl.zeros((), tl.float64)
        sum_hi = tl.zeros((), tl.float64)
        sum_w = tl.zeros((), tl.float64)
        for t0 in range(start, end, BLOCK):
            o = t0 + lanes
            inb = o < end
            m = _counted(mask_ptr, o, inb, HAS_MASK)
            if VP:  # logp_ptr, ent_ptr: a vocabulary split's merged sums and maxima; bad_ptr, stats_out: written
                lp, en, bad = _finish_at(logp_ptr, ent_ptr, ids_ptr, stats_out, bad_ptr, o, o, inb, m, V_all)
            else:
                lp, en = tl.load(logp_ptr + o, mask=inb, other=0.0), tl.load(ent_ptr + o, mask=inb, other=0.0)
                bad = tl.load(bad_ptr + o, mask=inb, other=0)
            bad = (bad != 0) | (malformed != 0)  # malformed: every token
            flagged = flagged | tl.max(bad.to(tl.int32), axis=0)
            lp = tl.where(m, tl.where(bad, float("nan"), lp), 0.0)
            en = tl.where(m, tl.where(bad, float("nan"), en), 0.0)
            tl.store(logp_out + o, lp, mask=inb)
            tl.store(ent_out + o, en, mask=inb)
            if TOP_ENT and PHASE == 1:  # the sort key of top_entropy._entropy_key_kernel, one launch fewer
                tl.store(srt_ptr + o, tl.where(m, en, float("inf")), mask=inb)
            if HAS_LAM:
                lam = tl.where(m, tl.load(lam_ptr + o, mask=inb, other=1.0).to(tl.float32), 1.0)
            else:
                lam = tl.full([BLOCK], 1.0, tl.float32)
            tl.store(lam_out + o, lam, mask=inb)
            if KEPT:
                kept_sums += _kept_add(kst_ptr, o, inb, m, bad)
            if HAS_ROLL:
                roll_sums, roll_abs, roll_max, roll_out, roll_nan, roll_ok = _roll_add(
                    lp, roll_ptr, o, inb, m, roll_sums, roll_abs, roll_max, roll_out, roll_nan, roll_ok)
            if VALIDATE:
                invalid = invalid | _invalid_inputs(o, inb, m, mask_ptr, old_ptr, ref_ptr, lam, rw_ptr, MASK_VALUES,
                                                    HAS_OLD, HAS_REF, HAS_LAM, RW)
            if TOK_ADV and POLICY >= 10:
                a_tot += tl.sum(_token_adv(adv_ptr, o, inb, m, malformed).to(tl.float64), axis=0)
            if OFF_POLICY:
                off_i += _off_policy_sum(o, inb, m, lp, old_ptr, roll_ptr, HAS_OLD, HAS_ROLL)
            if POLICY == 8:
                y_lo, y_hi, lw = _geo_sums(o, inb, m, lp, old_ptr, rw_ptr, lo, hi, adv_ptr, malformed, HAS_OLD, RW,
                                           TOK_ADV)
                sum_lo += y_lo
                sum_hi += y_hi
                sum_w += lw
            if POLICY == 9:
                l_sum, lw = _vespo_sums(o, inb, m, lp, old_ptr, rw_ptr, HAS_OLD, RW)
                sum_lo += l_sum
                sum_w += lw
            n_i += tl.sum(m.to(tl.int32), axis=0)
            h_i += tl.sum(en, axis=0)
            if POLICY >= 10:
                lp_tot += tl.sum(lp.to(tl.float64), axis=0)
            if SEQ:
                _, lr = _token_log_r(o, inb, m, lp, old_ptr, HAS_OLD)
                lr_i += tl.sum(tl.where(m, lr, 0.0), axis=0)
        n_safe = tl.maximum(n_i, 1).to(tl.float32)
        hbar = h_i / n_safe
        adv = tl.zeros((), tl.float32) if TOK_ADV else _finite_or_nan(tl.load(adv_ptr + i).to(tl.float32))
        if VALIDATE:
            invalid = invalid | (adv != adv).to(tl.int32)
            if HAS_NCONF:
                nc_i = tl.load(nconf_ptr + i).to(tl.float32)
                invalid = invalid | (((tl.abs(nc_i) < float("inf")) & (nc_i >= 1.0)) == 0).to(tl.int32)
            if RW == 2:  # a completion's weight is checked where it has a counted token
                invalid = invalid | ((n_i > 0) & (_rollout_ok(tl.load(rw_ptr + i).to(tl.float32)) == 0)).to(tl.int32)
        adv = tl.where(malformed != 0, float("nan"), adv)
        if OFF_POLICY:  # spec 9: the completion keeps its policy term if A >= 0 or its mean <= the threshold
            keep_w = ((adv >= 0.0) | (off_i.to(tl.float32) / n_safe <= off_thr)).to(tl.float32)
        else:
            keep_w = tl.full((), 1.0, tl.float32)
        if RW_MULT == 2:  # the completion's rollout weight, its tokens' multiplier
            keep_w = keep_w * _rollout_w(tl.load(rw_ptr + i).to(tl.float32))
        if FILTER:
            kept = (hbar <= thr) | (gate != 0)
        else:
            kept = n_i >= 0
        if PENALTY:
            shaped = tl.where(penalty == 0.0, adv, adv - penalty * hbar)  # (a 0 schedule: no 0 * NaN Hbar)
        else:
            shaped = adv
        tl.store(hbar_out + i, hbar)
        tl.store(kept_out + i, kept.to(tl.uint8))
        a_i = tl.where(kept, shaped, shaped * 0.0)  # Ahat
        tl.store(scratch_ptr + i, a_i)
        if POLICY == 8:  # geo_mean's log R (epilogue_geo)
            tl.store(scratch_ptr + B + i, _geo_log_R(sum_lo, sum_hi, sum_w, a_i, rw_ptr, i, n_safe, RW, TOK_ADV))
        elif POLICY == 9:  # vespo's phi (its weight on the completion's tokens)
            tl.store(scratch_ptr + B + i, _vespo_phi(sum_lo, sum_w, rw_ptr, i, adv, k_pos, lam_pos, k_neg, lam_neg, RW))
        else:
            tl.store(scratch_ptr + B + i, lr_i / n_safe)
        tl.store(scratch_ptr + 2 * B + i, n_safe)
        tl.store(scratch_ptr + 3 * B + i, keep_w)
        if HAS_NCONF:
            tl.store(nconf_out + i, tl.load(nconf_ptr + i).to(tl.float32))
        else:
            tl.store(nconf_out + i, 1.0)
        if POLICY >= 10:  # (TOK_ADV: a_i is 0, the tokens' own were summed per block)
            a_tot += tl.where(n_i > 0, n_i.to(tl.float64) * a_i.to(tl.float64), 0.0)
        M += n_i
        n_kept += kept.to(tl.int32)
        longest = tl.maximum(longest, end - start)
        h_tot += h_i
    tl.debug_barrier()
    M_safe = tl.maximum(M, 1).to(tl.float32)
    Bf = B * 1.0
    if NITEMS == 2:  # a tensor: NaN unless finite and > 0
        ni = tl.load(nitems_ptr).to(tl.float32)
        ni = tl.where((ni > 0.0) & (tl.abs(ni) < float("inf")), ni, float("nan"))
    else:
        ni = nitems_val
    if PACKED:
        max_len = tl.where(max_len_cfg > 0.0, max_len_cfg, tl.maximum(longest, 1).to(tl.float32))
    else:
        max_len = tl.where(max_len_cfg > 0.0, max_len_cfg, T * 1.0)
    kv = 0.0
    ki = -1
    if POLICY >= 10:  # the batch's covariances: the keys (PHASE 1), or the k-th of their order (epilogue_cov)
        if PHASE == 1:
            _cov_keys(key_ptr, draws_ptr, logp_out, old_ptr, mask_ptr, scratch_ptr, cu_fix, B, T, adv_ptr, malformed,
                      a_tot.to(tl.float32) / M_safe, lp_tot.to(tl.float32) / M_safe, cov_lb, cov_ub, lo, hi, delta,
                      dual_c, BLOCK, PACKED, HAS_MASK, HAS_OLD, CLIP, HAS_DELTA, HAS_DUAL, POLICY, TOK_ADV)
            return
        kv, ki = _cov_kth(cval_ptr, cidx_ptr, M, N, ratio_bits)
    ent_thr = 0.0
    if TOP_ENT:
        ent_thr = _top_entropy_thr(srt_ptr, M, N, top_q, POLICY == 11)  # (kl_cov's sort: descending)
    loss_acc = tl.zeros([BLOCK], tl.float32)
    clip_n = tl.zeros((), tl.int32)
    conf_n = tl.zeros((), tl.int32)
    lam_nan = tl.zeros((), tl.float32)
    # pass 2: per token, the terms, the weights, c and e, the loss
    for i in range(g_lo, g_hi):
        start, end = _span(cu_fix, i, T, PACKED)
        a_hat = tl.load(scratch_ptr + i)
        lr_seq = tl.load(scratch_ptr + B + i)
        n_safe = tl.load(scratch_ptr + 2 * B + i)
        keep_w = tl.load(scratch_ptr + 3 * B + i)
        denom = _denom(nconf_ptr, i, n_safe, Bf, M_safe, ni, max_len, AGG, NITEMS, HAS_NCONF)
        g_seq = 0.0
        kl_p, kl_e = _kl_pivot(logp_out, ref_ptr, mask_ptr, start, end, n_safe, lr_seq, BLOCK, HAS_MASK,
                               SEQ and BIAS_KL and HAS_KL)  # (the sequence level's bias-corrected KL)
        if SEQ or POLICY == 8:  # d loss / d log r (geo_mean: log R) over the completion, spread back on its tokens
            g_acc = tl.zeros([BLOCK], tl.float32)
            for t0 in range(start, end, BLOCK):
                o = t0 + lanes
                inb = o < end
                m = _counted(mask_ptr, o, inb, HAS_MASK)
                em = _top_entropy_w(ent_out, o, inb, m, ent_thr, M, BLOCK, TOP_ENT)
                pw = _policy_weight(rw_ptr, o, inb, m, keep_w * em, BLOCK, RW_MULT)
                a_t = _token_adv(adv_ptr, o, inb, m, malformed) if TOK_ADV else a_hat
                _, _, d_logr, _, _ = _terms(o, inb, m, a_t, lr_seq, logp_out, ent_out, old_ptr, ref_ptr, lam_ptr, pw,
                                            em, o < 0, lo, hi, delta, dual_c, beta, ent_coef, sapo_pos, sapo_neg,
                                            dro_beta, kl_coef, kl_p, kl_e, BLOCK, HAS_OLD, HAS_KL, BIAS_KL, HAS_LAM,
                                            HAS_E, SEQ, CLIP, HAS_DELTA, HAS_DUAL, POLICY)
                w = tl.where(m, 1.0, 0.0) / denom
                g_acc += tl.where(m, w * d_logr, 0.0)
            g_seq = tl.sum(g_acc, axis=0) / n_safe
        for t0 in range(start, end, BLOCK):
            o = t0 + lanes
            inb = o < end
            m = _counted(mask_ptr, o, inb, HAS_MASK)
            em = _top_entropy_w(ent_out, o, inb, m, ent_thr, M, BLOCK, TOP_ENT)
            pw = _policy_weight(rw_ptr, o, inb, m, keep_w * em, BLOCK, RW_MULT)
            sel = _cov_sel(key_ptr, o, inb, m, kv, ki, POLICY)
            a_t = _token_adv(adv_ptr, o, inb, m, malformed) if TOK_ADV else a_hat
            loss_tok, d_logp, d_logr, clipped, lam = _terms(
                o, inb, m, a_t, lr_seq, logp_out, ent_out, old_ptr, ref_ptr, lam_ptr, pw, em, sel, lo, hi, delta,
                dual_c, beta, ent_coef, sapo_pos, sapo_neg, dro_beta, kl_coef, kl_p, kl_e, BLOCK, HAS_OLD, HAS_KL,
                BIAS_KL, HAS_LAM, HAS_E, SEQ, CLIP, HAS_DELTA, HAS_DUAL, POLICY)
            if AGG == 5:
                w = tl.where(m, 1.0, 0.0)
            else:
                w = tl.where(m, 1.0, 0.0) / denom
            if SEQ:
                c = tl.where(m, w * d_logp + g_seq, 0.0)
            elif POLICY == 8:  # log R moves with the tokens its clip did not stop (Ahat, TOK_ADV: the token's, != 0)
                c = tl.where(m, w * d_logp + g_seq * (clipped == 0).to(tl.float32) * (a_t != 0.0).to(tl.float32), 0.0)
            else:
                c = tl.where(m, w * d_logp + w * d_logr, 0.0)
            tl.store(ltok_out + o, loss_tok, mask=inb)
            tl.store(c_out + o, c, mask=inb)
            if HAS_E:
                tl.store(e_out + o, tl.where(m, w * (-ent_coef * em) + a_t * 0.0, 0.0), mask=inb)
            if AGG == 5:
                tl.store(value_ptr + o, w * loss_tok, mask=inb)
            else:
                loss_acc += tl.where(inb, w * loss_tok, 0.0)
            clip_n += tl.sum(tl.where(m, clipped, 0), axis=0)
            if HAS_LAM:
                conf_n += tl.sum(((lam != 1.0) & m).to(tl.int32), axis=0)
                lam_nan += tl.sum(tl.where(m, lam * 0.0, 0.0), axis=0)
    if AGG != 5:
        tl.store(value_ptr, tl.sum(loss_acc, axis=0))
    _metrics_store(met_ptr, clip_n, n_kept, conf_n, lam_nan, h_tot, B, Bf, M_safe, HAS_LAM, malformed, kept_sums, KEPT)
    if HAS_ROLL:
        _roll_store(met_ptr, roll_sums, roll_abs, roll_max, roll_out, roll_nan, roll_ok, M_safe)
    if FILTER:
        flagged = flagged | (((n_kept == 0) & (M > 0)).to(tl.int32) * 2)
    if VALIDATE:
        invalid = invalid | malformed
        if PACKED:
            invalid = invalid | ((max_seqlen >= 0) & (longest > max_seqlen)).to(tl.int32)
        if NITEMS == 2:
            invalid = invalid | (ni != ni).to(tl.int32)
        flagged = flagged | (invalid * 4)
    tl.store(status_ptr, flagged)
