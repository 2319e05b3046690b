"""Mutation sweep over the sampler replay (spec 13), the verl modes and the per-token temperature code
Not collected by pytest (no test_ prefix).

Each mutant is one semantic change: (file under gtpo_kernels/, an exact snippet that must occur exactly
once, its replacement, a description). The sweep copies the repository (without .git) to a temporary
directory once, applies each mutant there in turn (restored in a finally), runs the test files mapped
to the mutant's file (pytest -x -q, single process, OMP_NUM_THREADS=1, no bytecode written) with a
timeout, and records killed / survived / timeout (a timeout counts as killed in the score) / stale (the
snippet no longer occurs exactly once: the file changed since the list was written).

Mutants marked `equivalent` cannot change any observable output of the package; each carries its
reason. The score is killed / (mutants that applied), reported with and without the equivalents.

    python tests/mutation_sweep.py                      # the whole sweep (about an hour on two CPU cores)
    python tests/mutation_sweep.py --before             # the same without tests/test_mutants_round3.py (before score)
    python tests/mutation_sweep.py --resume before.log  # rerun only what that sweep left alive (after score)
    python tests/mutation_sweep.py --report before.log  # that sweep's table and score, with the current notes
    python tests/mutation_sweep.py --report tests/mutation_before.log,tests/mutation_after.log   # the committed sweep's
    python tests/mutation_sweep.py --file kept_set.py   # the mutants of files whose path contains this
    python tests/mutation_sweep.py --only K3,S7         # these mutants
    python tests/mutation_sweep.py --list               # the mutants, not run
    python tests/mutation_sweep.py --check              # every snippet occurs exactly once (no tests run)
    python tests/mutation_sweep.py --only K4 --tests tests/test_mutants_round3.py::test_x   # one test
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEW_TESTS = "tests/test_mutants_round3.py"  # the tests written against this list: run (first) for every file

# the test files that cover each file (run with -x, after NEW_TESTS)
TESTS = {
    "pipeline/replay.py": ["test_sampling_rules", "test_replay_api", "test_trust_round3"],
    "pipeline/head_replay.py": ["test_head_replay", "test_trust_round3"],
    "pipeline/head_replay_ops.py": ["test_head_replay", "test_trust_round3"],
    "distributed/vocab_replay.py": ["test_parallel_replay", "test_parallel_ties"],
    "kernels/kept_set.py": ["test_sampling_rules", "test_sampling_reference", "test_replay_api", "test_trust_round3"],
    "kernels/replay.py": ["test_sampling_replay", "test_sampling_checks", "test_replay_api", "test_head_replay"],
    "kernels/replay_ops.py": ["test_sampling_ops", "test_replay_api"],
    "kernels/tile_union.py": ["test_tile_union", "test_sampling_replay", "test_head_replay"],
    "kernels/replay_torch.py": ["test_sampling_replay", "test_sampling_checks", "test_replay_api"],
    "kernels/replay_triton.py": ["test_sampling_replay", "test_sampling_checks", "test_replay_api"],
    "core/sampling.py": ["test_sampling_checks", "test_sampling_replay", "test_replay_api"],
    "objective/verl_modes.py": ["test_verl_modes", "test_trust_round3"],
    "kernels/ops.py": ["test_temperature"],
    "kernels/eager.py": ["test_eager_ops", "test_api"],
    "pipeline/loss.py": ["test_temperature"],
    "pipeline/head_ops.py": ["test_temperature"],
    "pipeline/epilogue.py": ["test_temperature"],
    "api/logits.py": ["test_temperature"],
}
# slow tests that check tracing, not values (torch.compile): left out of every run
DESELECT = ["tests/test_trust_round3.py::test_compiled_step_takes_a_preset_name",
            "tests/test_sampling_ops.py::test_attach_replay_grad_matches_autograd[True-triton]"]


@dataclass
class Mutant:
    id: str
    file: str  # under gtpo_kernels/
    old: str
    new: str
    what: str
    equivalent: Optional[str] = None  # why no observable output can change
    tests: Optional[list] = None  # test files in place of TESTS[file]


M = Mutant
MUTANTS = [
    # ---- pipeline/replay.py ----------------------------------------------------------------------------
    M("P1", "pipeline/replay.py", "any(x is not None for x in (top_k, top_p, min_p))",
      "any(x is not None for x in (top_k, top_p))", "min_p alone does not request a replay"),
    M("P2", "pipeline/replay.py", "out = f if out is None else out | f", "out = f if out is None else out & f",
      "_any: the rules' invalid flags and-ed, not or-ed"),
    M("P3", "pipeline/replay.py", "invalid = _any(nonfinite, *rule_bad)", "invalid = nonfinite",
      "the rules' invalid (unvalidated) values no longer make the token NaN"),
    M("P4", "pipeline/replay.py", "flags = torch.where(b.counted, flags, torch.zeros_like(flags))",
      "flags = flags", "flags at uncounted tokens not zeroed",
      equivalent="replay.finish (given counted=) already zeroes the flags of uncounted tokens"),
    M("P5", "pipeline/replay.py", "rp.replay_metrics(offsets, M=b.counted.sum(), bad=_flagged(flags, invalid, b))",
      "rp.replay_metrics(offsets, bad=_flagged(flags, invalid, b))", "mean_kept_size over every flat token, not the counted ones"),
    M("P6", "pipeline/replay.py", "rp.replay_metrics(offsets, restored, mass, M=b.counted.sum(), bad=bad)",
      "rp.replay_metrics(offsets, None, mass, M=b.counted.sum(), bad=bad)",
      "replay_restored_frac always 0 for rebuilt sets"),
    M("P7", "pipeline/replay.py", "dtype = torch.float32 if b.logits3 is None else float_dtype_for(b.logits3)",
      "dtype = torch.float32", "float64 calls' rule thresholds rounded to float32"),
    M("P8", "pipeline/replay.py", "return logp, ent, flags, rp.replay_metrics(offsets, restored",
      "return logp, ent, torch.zeros_like(flags), rp.replay_metrics(offsets, restored",
      "rebuilt sets: the kernel's flags dropped"),

    # ---- kernels/kept_set.py ---------------------------------------------------------------------------
    M("K1", "kernels/kept_set.py", "keep &= torch.exp(s - mx) >= min_p[:, None]",
      "keep &= torch.exp(s) >= min_p[:, None]", "min-p against p unnormalized by the row maximum"),
    M("K2", "kernels/kept_set.py", "mx = torch.where(mx == ninf, torch.zeros_like(mx), mx)", "mx = mx",
      "an all -inf row's maximum left at -inf",
      equivalent="such a row keeps nothing already (keep = s > -inf is all False), whatever min-p computes"),
    M("K3", "kernels/kept_set.py", "drop = (cum <= (1.0 - top_p)[:, None])", "drop = (cum < (1.0 - top_p)[:, None])",
      "top-p keeps the entry whose cumulative mass equals 1 - top_p"),
    M("K4", "kernels/kept_set.py", " & (top_p < 1)[:, None]", "",
      "top_p = 1 no longer off: entries whose probability underflows to 0 are removed"),
    M("K5", "kernels/kept_set.py", "drop[:, -1:].fill_(False)", "pass", "top-p may remove the last (largest) entry"),
    M("K6", "kernels/kept_set.py", "kept_sorted = (srt > ninf) & ~drop", "kept_sorted = ~drop",
      "entries removed by top-k / min-p (at -inf) kept"),
    M("K7", "kernels/kept_set.py", "on_k = (k > 0) & (k < V)", "on_k = (k >= 0) & (k < V)",
      "top_k = 0 (off) keeps only the largest entry (full-sort path)"),
    M("K8", "kernels/kept_set.py", "cand = torch.where(sm >= kth, sm,", "cand = torch.where(sm > kth, sm,",
      "top-k path: the k-th value and its ties dropped"),
    M("K9", "kernels/kept_set.py", "return torch.where(srt >= kth, srt,", "return torch.where(srt > kth, srt,",
      "full-sort path: the k-th value and its ties dropped"),
    M("K10", "kernels/kept_set.py", "if bool(((k > 0) & (k <= min(TOPK_PATH, V - 1))).all()):", "if False:",
      "the top-k path never taken",
      equivalent="the full sort computes the same kept set (values ascending, ties by ascending id): memory and "
                 "speed only (test_recompute_is_blockwise kills it by checking that only the candidates are sorted)"),
    M("K11", "core/sampling.py", '"top_p": (lambda x: (x > 0) & (x <= 1), "in (0, 1] (1: off)", False),',
      '"top_p": (lambda x: (x > 0) & (x < 1), "in (0, 1] (1: off)", False),', "top_p = 1 refused as out of range"),
    M("K12", "kernels/kept_set.py", "keep.scatter_(1, yc, held | inr)", "pass",
      "the sampled token not restored into its rebuilt set"),
    M("K13", "kernels/kept_set.py", "rest = (~held & inr).squeeze(1)", "rest = (held & inr).squeeze(1)",
      "restored inverted"),
    M("K14", "kernels/kept_set.py", "torch.where(keep, torch.softmax(s, -1), torch.zeros_like(s))",
      "torch.where(keep, torch.softmax(z, -1), torch.zeros_like(s))", "kept_mass from the softmax without tau"),
    M("K15", "kernels/kept_set.py", "nf = (torch.isnan(s) | (s == float(\"inf\"))).any(-1)",
      "nf = torch.isnan(s).any(-1)", "a +inf logit not flagged in the rebuild"),
    M("K16", "kernels/kept_set.py", "s = z * (1.0 / _param(tau, sl, 1.0, acc, dev))[:, None]", "s = z",
      "the rebuild ignores the temperature"),

    # ---- kernels/replay.py -----------------------------------------------------------------------------
    M("R1", "kernels/replay.py", "return k // T, k % T + logits_start", "return k // T, k % T",
      "counted_rows ignores logits_start"),
    M("R2", "kernels/replay.py", "return torch.zeros_like(j), j + logits_start", "return torch.zeros_like(j), j",
      "flat_rows (packed) ignores logits_start"),
    M("R3", "kernels/replay.py", "        bad = bad | invalid\n", "        pass\n",
      "finish ignores `invalid` (unvalidated bad sets give finite numbers)"),
    M("R4", "kernels/replay.py", "logp = torch.where(counted, logp, 0.0)", "pass",
      "uncounted tokens' logp not set to 0"),
    M("R5", "kernels/replay.py", "e = None if g_ent is None else g_ent.to(ent.dtype)", "e = None",
      "the entropy's gradient dropped"),
    M("R6", "kernels/replay.py", "out[\"kept_mass\"] = kept_mass.to(f64).sum() / n",
      "out[\"kept_mass\"] = kept_mass.to(f64).sum() / (n + 1)", "kept_mass averaged over one token too many"),
    M("R7", "kernels/tile_union.py", "loc.index_copy_(0, tok + tile_tok, offsets[:-1] - base[tile_tok])",
      "loc.index_copy_(0, tok + tile_tok, offsets[:-1])", "the tiles' local offsets not rebased"),
    M("R8", "kernels/tile_union.py",
      "local_y = torch.where((skey[p] == ky) & (ky % W != V_r), col[p] - starts[tile_tok], -1)",
      "local_y = col[p] - starts[tile_tok]", "tile_unions: a sampled id outside its union not made -1"),

    # ---- kernels/replay_ops.py -------------------------------------------------------------------------
    M("O1", "kernels/replay_ops.py", "_scale(c, g), _scale(e, g)", "c, e",
      "attach_replay_grad ignores the upstream gradient"),

    # ---- kernels/replay_torch.py -----------------------------------------------------------------------
    M("T1", "kernels/replay_torch.py", "d = ((zf - m_safe[seg]) * inv).clamp_(min=_LOG_ZERO)",
      "d = (zf - m_safe[seg]).clamp_(min=_LOG_ZERO)", "forward ignores the temperature in d"),
    M("T2", "kernels/replay_torch.py", "_segsum(top.to(acc), seg, M) - 1.0", "_segsum(top.to(acc), seg, M) - 0.0",
      "S off by one"),
    M("T3", "kernels/replay_torch.py", "ent = log_s - _segsum(ex * d, seg, M) / s_tot",
      "ent = log_s + _segsum(ex * d, seg, M) / s_tot", "entropy sign"),
    M("T4", "kernels/replay_torch.py", "bad_e = torch.isnan(z) | (z == float(\"inf\"))", "bad_e = torch.isnan(z)",
      "a kept +inf logit not flagged"),
    M("T6", "kernels/replay_torch.py", "-p * (cc + t_e))\n", "-p * (cc - t_e))\n",
      "backward: the entropy term's sign off the sampled id"),
    M("T7", "kernels/replay_torch.py", "logq = ((zt - st[:, 0]) * inv - st[:, 1])", "logq = ((zt - st[:, 0]) - st[:, 1])",
      "backward: p without the temperature"),
    M("T8", "kernels/replay_torch.py", "g = g * inv * dz", "g = g * dz", "backward: chain rule through 1/tau dropped"),
    M("T9", "kernels/replay_torch.py", "active = (c != 0) | (e != 0)", "active = c != 0",
      "backward: tokens with only an entropy gradient write zeros"),

    # ---- kernels/replay_triton.py ----------------------------------------------------------------------
    M("X1", "kernels/replay_triton.py", "d = tl.maximum((z - m) * inv_t, LOG_ZERO)", "d = tl.maximum((z - m), LOG_ZERO)",
      "forward ignores the temperature in d"),
    M("X2", "kernels/replay_triton.py", "top = use & (z == mx)", "top = use & (z == m)",
      "the maximum's instances compared with m, not mx",
      equivalent="m == mx unless mx = -inf, and then no lane is `use` (finite), so `top` is False either way"),
    M("X3", "kernels/replay_triton.py", "tl.sum(found, axis=0) != 1", "tl.sum(found, axis=0) == 0",
      "a set holding the sampled id twice not flagged"),
    M("X4", "kernels/replay_triton.py", " | tl.where(live & ~ok, BAD_ID, 0)", "",
      "an id outside [0, V) not flagged"),
    M("X5", "kernels/replay_triton.py", "-p * (c + t_e)) * inv_t * dz", "-p * (c + t_e)) * dz",
      "backward: chain rule through 1/tau dropped"),
    M("X6", "kernels/replay_triton.py", "if (c != 0.0) | (e != 0.0):", "if c != 0.0:",
      "backward: tokens with only an entropy gradient write zeros"),

    # ---- core/sampling.py ------------------------------------------------------------------------------
    M("S1", "core/sampling.py", "if not (math.isfinite(temperature) and temperature > 0):",
      "if not (math.isfinite(temperature) and temperature >= 0):", "temperature = 0 (number) accepted", tests=["test_temperature", "test_sampling_checks"]),
    M("S2", "core/sampling.py", "return ~(torch.isfinite(tau) & (tau > 0) & torch.isfinite(tau.reciprocal()))",
      "return ~((tau > 0) & torch.isfinite(tau.reciprocal()))",
      "an infinite per-token temperature accepted", tests=["test_temperature", "test_sampling_checks"]),
    M("S3", "core/sampling.py", "        bad = bad & counted\n", "        pass\n",
      "bad values at uncounted tokens refused", tests=["test_temperature", "test_sampling_checks"]),
    M("S4", "core/layout.py", "    return x.reshape(-1, 1).expand(-1, rows).reshape(-1)", "    return x.repeat(rows)",
      "per-completion values spread in the wrong order (padded)", tests=["test_temperature", "test_sampling_checks"]),
    M("S5", "core/layout.py", "torch.arange(n, device=x.device), right=True).clamp_(max=max(B - 1, 0))",
      "torch.arange(n, device=x.device), right=False).clamp_(max=max(B - 1, 0))",
      "per-completion values (packed): the first token of a sequence gets the previous one's",
      tests=["test_temperature", "test_sampling_checks", "test_defects", "test_logps_epilogue"]),
    M("S6", "core/sampling.py", "if packed and B == n and shape == (n,):", "if False:",
      "an ambiguous packed shape accepted", tests=["test_temperature", "test_sampling_checks"]),
    M("S7", "core/sampling.py", "\"top_k\": (lambda x: x >= -1,", "\"top_k\": (lambda x: x >= 0,",
      "top_k = -1 (vLLM's off) refused"),
    M("S8", "core/sampling.py", "\"top_p\": (lambda x: (x > 0) & (x <= 1),", "\"top_p\": (lambda x: (x > 0) & (x < 1),",
      "top_p = 1 (off) refused"),
    M("S9", "core/sampling.py", "\"min_p\": (lambda x: (x >= 0) & (x <= 1),", "\"min_p\": (lambda x: (x >= 0) & (x < 1),",
      "min_p = 1 (vLLM's upper end: the entries tied at the maximum) refused"),
    M("S10", "core/sampling.py", "if integer and not isinstance(x, numbers.Integral):", "if False:",
      "a fractional top_k number accepted"),
    M("S11", "core/sampling.py", "bad = ~ok(v) if integer else ~(torch.isfinite(v) & ok(v))", "bad = ~ok(v)",
      "no finiteness test for top_p / min_p tensors",
      equivalent="ok() is False at NaN and +-inf for both (0 < x <= 1, 0 <= x <= 1): the same tokens flagged"),
    M("S12", "core/sampling.py", "v = v.long() if integer else v.to(dtype)", "v = v.long() if integer else v.float()",
      "rule thresholds rounded to float32 for float64 logits"),
    M("S13", "core/sampling.py", "if sampling_mask is not None and given:", "if False:",
      "a mask and rules together accepted"),
    M("S14", "core/sampling.py", "return torch.searchsorted(offsets[1:].contiguous(), e, right=True)",
      "return torch.searchsorted(offsets[1:].contiguous(), e, right=False)", "segment_of off by one at set ends"),
    M("S15", "core/sampling.py", "malformed = (offsets[0] != 0) | (offsets[-1] != K)", "malformed = (offsets[-1] != K)",
      "offsets not starting at 0 accepted"),
    M("S16", "core/sampling.py", "dup[1:] = srt[1:] == srt[:-1]", "pass", "a repeated id in a set accepted"),
    M("S17", "core/sampling.py", "code |= (hits == 0).to(torch.int8) * 4", "pass",
      "a set without its sampled token accepted"),
    M("S18", "core/sampling.py", "out = (token_ids < 0) | (token_ids >= V)", "out = (token_ids < 0) | (token_ids > V)",
      "the id V accepted"),
    M("S19", "core/sampling.py", "return offsets.long()[excl.clamp(max=last)], excl[-1] != last",
      "return offsets.long()[excl.clamp(max=last)], excl[-1] != excl[-1]",
      "unvalidated: a wrong number of sets not made invalid"),
    M("S20", "core/sampling.py", "torch.where(broken, 0, flat), ((code != 0) & counted) | broken",
      "torch.where(broken, 0, flat), (code != 0) | broken", "uncounted tokens (empty sets) flagged invalid",
      equivalent="uncounted tokens' outputs are set to 0 (finish, counted=) and they carry no gradient: the public "
                 "outputs are unchanged (test_sampling_checks kills it through check_sampling_mask_flat's own output)"),

    # ---- objective/verl_modes.py -----------------------------------------------------------------------
    M("V1", "objective/verl_modes.py", "return -A * logp, None, -A, _none(logp)",
      "return -A * logp, None, A, _none(logp)", "gpg: the gradient's sign"),
    M("V2", "objective/verl_modes.py", "return -(logp * A - 0.5 * beta * log_r * log_r),",
      "return -(logp * A - beta * log_r * log_r),", "dro: the penalty doubled (value only)"),
    M("V3", "objective/verl_modes.py", "beta * log_r, -A, _none(logp)", "0.5 * beta * log_r, -A, _none(logp)",
      "dro: the penalty's gradient halved"),
    M("V4", "objective/verl_modes.py", "operand(1.0 + cfg.eps_high, r))", "operand(1.0 + cfg.eps_low, r))",
      "cispo: the upper clip at eps_low"),
    M("V5", "objective/verl_modes.py", "coef = r if cfg.dual_clip_c is None else clip(r, hi=operand(cfg.dual_clip_c, r))",
      "coef = r", "dppo: dual_clip_c ignored"),
    M("V6", "objective/verl_modes.py", "down_ok = (p - p_old) <= hi, (p - p_old) >= -lo",
      "down_ok = (p - p_old) <= hi, (p - p_old) >= lo", "dppo tv: the step down compared with +eps_low"),
    M("V7", "objective/verl_modes.py", "up_ok, down_ok = (kl <= hi) | (p <= p_old), (kl <= lo) | (p >= p_old)",
      "up_ok, down_ok = (kl <= hi), (kl <= lo) | (p >= p_old)", "dppo kl: a step down never valid for A > 0"),
    M("V8", "objective/verl_modes.py", "valid = torch.where(A > 0, up_ok, down_ok)",
      "valid = torch.where(A >= 0, up_ok, down_ok)", "dppo: A = 0 judged as A > 0",
      equivalent="A = 0: pg = -A coef logp = 0 and d_logp = 0 either way, and `clipped` requires A != 0"),
    M("V9", "objective/verl_modes.py", "return -A * coef * logp, None, -A * coef, ~valid & (A != 0)",
      "return -A * coef * logp, None, -A * coef, ~valid", "dppo: A = 0 tokens counted clipped"),
    M("V10", "objective/verl_modes.py", "y = s * torch.minimum(s * log_r, s * xc)", "y = s * torch.maximum(s * log_r, s * xc)",
      "geo_mean: the clip's min becomes max"),
    M("V11", "objective/verl_modes.py", "        log_R = log_R + log_w\n", "        pass\n",
      "geo_mean: the rollout weight dropped"),
    M("V12", "objective/verl_modes.py", "spread = (s * log_r <= s * xc) & (s != 0)", "spread = (s * log_r < s * xc) & (s != 0)",
      "geo_mean: tokens inside the clip range stop the gradient"),
    M("V13", "objective/verl_modes.py", "mean_a = torch.where(m, A, zero).sum(dtype=torch.float64).to(dt) / M_safe",
      "mean_a = A.mean()",
      "covariance: the advantage's mean over uncounted tokens too"),
    M("V14", "objective/verl_modes.py", "return chosen & (rank < k)", "return chosen & (rank <= k)",
      "first_k: one token too many"),
    M("V15", "objective/verl_modes.py", "torch.clamp(torch.floor(r * M.to(torch.float64)), min=1.0)",
      "torch.clamp(torch.ceil(r * M.to(torch.float64)), min=1.0)", "select_count rounds up"),
    M("V16", "objective/verl_modes.py", "cand = m & ~on_clip & ", "cand = m & ",
      "clip_cov: tokens the PPO clip already stopped are candidates"),
    M("V17", "objective/verl_modes.py", "sel if dual is None else sel | dual",
      "sel & (A != 0) if dual is None else (sel & (A != 0)) | dual",
      "clip_cov: chosen zero-advantage tokens not counted clipped (verl counts every corr == 0)"),
    M("V18", "objective/verl_modes.py", "select_count(cfg.kl_cov_ratio, M), descending=True)",
      "select_count(cfg.kl_cov_ratio, M), descending=False)", "kl_cov: the smallest covariances chosen"),
    M("V19", "objective/verl_modes.py", "coef * torch.sign(log_r), None, _none(r)", "coef * log_r, None, _none(r)",
      "kl_cov: the |log r| gradient without the sign"),

    # ---- distributed/vocab_replay.py -------------------------------------------------------------------
    M("D1", "distributed/vocab_replay.py", "mine = (token_ids >= vp.start) & (token_ids < vp.start + V_r)",
      "mine = (token_ids >= vp.start) & (token_ids <= vp.start + V_r)", "the next slice's first id counted twice"),
    M("D2", "distributed/vocab_replay.py", "    dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=vp.group)\n",
      "    pass\n", "merge: each rank's own maximum (not all-reduced)"),
    M("D3", "distributed/vocab_replay.py", "keep = torch.cat([keep, ~hit[:, None]], 1)",
      "keep = torch.cat([keep, torch.zeros_like(hit)[:, None]], 1)", "rebuilt sets: the sampled token not restored"),
    M("D4", "distributed/vocab_replay.py", "restored.append(~hit)", "restored.append(hit)", "restored inverted"),
    M("D5", "distributed/vocab_replay.py", "lse_full = gsafe + torch.log(stats[:, 0])", "lse_full = gsafe",
      "kept_mass without the full normalizer's sum"),
    M("D6", "distributed/vocab_replay.py", "no_k = _param(top_k, slice(0, y.numel()), 0, torch.long, y.device) <= 0",
      "no_k = _param(top_k, slice(0, y.numel()), 0, torch.long, y.device) < 0", "top_k = 0 with a group accepted"),
    M("D7", "distributed/vocab_replay.py", "    bad = (flags != 0) | invalid\n", "    bad = flags != 0\n",
      "invalid (unvalidated) tokens get finite outputs"),
    M("D8", "distributed/vocab_replay.py", "invalid.append((stats[:, 1] > 0) | ((extra > 0) & survives) |",
      "invalid.append((stats[:, 1] > 0) |", "ties hidden across ranks not flagged"),

    M("R40", "kernels/replay_triton.py", "    ent = tl.where(inv_t == inv_t, ent, float(\"nan\"))",
      "    ent = ent", "an unvalidated bad tau gives entropy 0 over recorded sets"),

    # ---- kernels/eager.py ------------------------------------------------------------------------------
    M("E1", "kernels/eager.py", "if not args or torch.compiler.is_compiling() or type(args[0]) is not torch.Tensor or",
      "if not args or torch.compiler.is_compiling() or", "a fake tensor runs the op's body eagerly"),
    M("E2", "kernels/eager.py", "zip(names[len(args):], defaults[len(args):])",
      "zip(names[len(args):], defaults[len(args) + 1:] + defaults[-1:])", "defaults filled one place off"),
    M("E3", "kernels/eager.py", "            with torch.no_grad():\n                return body(*args)",
      "            return body(*args)", "an op without gradient records autograd history eagerly"),
    M("E4", "kernels/eager.py", "            out = backward(ctx, list(grads) if many else grads[0])",
      "            out = backward(ctx, list(grads[:1]) + [None] * (len(grads) - 1) if many else grads[0])",
      "only the first output's gradient passed to the op's backward",
      equivalent="every op with a gradient marks its outputs but the first non-differentiable: their gradients "
                 "are None either way"),
    M("E6", "kernels/eager.py", "type(args[0]) is not torch.Tensor or args[0].is_meta \\",
      "type(args[0]) is not torch.Tensor \\", "a meta tensor runs the op's body (its kernels) eagerly"),
    M("E7", "kernels/eager.py", "_STATE.registered = before or torch.is_grad_enabled()  # (create_graph=True)",
      "_STATE.registered = before", "a second-order gradient silently 0 under create_graph=True"),
    M("E5", "kernels/eager.py", "            setup_context(ctx, args, out)", "            setup_context(ctx, args[:-1] + (None,), out)",
      "the last argument hidden from setup_context"),

    # ---- pipeline/head_replay.py -----------------------------------------------------------------------
    M("H1", "pipeline/head_replay.py", "lo, hi = m0 + 1, min(n, m0 + max_rows)", "lo, hi = m0 + 1, min(n, m0 + max_rows + 1)",
      "tiles of max_rows + 1 rows",
      equivalent="tiling changes which columns are projected together, not any value beyond summation order "
                 "(test_union_tiles_keep_the_budget kills it by checking plan_union's tiles themselves)"),
    M("H2", "pipeline/head_replay.py", "    if sizes and per_entry * min(max(sizes), V) > budget:\n",
      "    if False:\n", "a kept set larger than the budget not refused"),
    M("H13", "pipeline/head_replay.py", "if per_entry * (mid - m0) * min(S[mid] - S[m0], V) <= budget:",
      "if per_entry * (mid - m0) * min(S[mid] - S[m0], V) < budget:", "a tile that fills the budget exactly cut",
      equivalent="tiling only (test_union_tiles_are_the_greedy_ones kills it on plan_union's tiles)"),
    M("H14", "pipeline/head_replay.py", "off = list(itertools.compress(host[n:], host[:n]))",
      "off = list(itertools.compress(host[n + 1:], host[:n]))", "the counted tokens' set offsets shifted by one"),
    M("H3", "pipeline/head_replay.py", "return h @ w.t() if bias is None else torch.addmm(bias, h, w.t())",
      "return h @ w.t()",
      "the bias dropped from the projection"),
    M("H4", "pipeline/head_replay.py", "db.index_add_(0, u, gz.sum(0, dtype=acc))", "db.index_add_(0, u, gz.sum(0, dtype=acc) * 0)",
      "the bias gradient dropped"),
    M("H5", "pipeline/head_replay.py", "p.invalid = nf if p.invalid is None else nf | p.invalid",
      "p.invalid = nf", "rebuilt sets: the rules' invalid tokens get finite outputs"),
    M("H6", "pipeline/head_replay_ops.py", "torch.where((token_ids >= 0) & (token_ids < V), token_ids, torch.zeros_like(token_ids))",
      "token_ids", "an out-of-range kept id (unvalidated) indexes the weight"),
    M("H7", "pipeline/head_replay.py", "p.metrics = rp.replay_metrics(p.offsets, _cat(restored, p, torch.bool), _cat(mass, p))",
      "p.metrics = rp.replay_metrics(p.offsets, None, _cat(mass, p))", "rebuilt sets: replay_restored_frac 0"),
    M("H8", "pipeline/head_replay.py", "kept_sets(z.unsqueeze(0), *_rows(p, z.shape[0]), p.y[sl], tau, *rules,",
      "kept_sets(z.unsqueeze(0), *_rows(p, z.shape[0]), p.y[sl], 1.0, *rules,", "the rebuild ignores the temperature"),
    M("H10", "pipeline/head_replay_ops.py", "if host:\n        checks.raise_on_flags(flags", "if False:\n        checks.raise_on_flags(flags",
      "validating, flagged tokens (NaN / +inf logits) not refused"),
    M("H12", "pipeline/head_replay.py", "un.tile(j, m0, m1, p.kb[j], p.kb[j + 1])", "un.tile(j, m0, m1, p.kb[0], p.kb[j + 1])",
      "a union tile's kept ids taken from the first tile's start"),
    M("R9", "kernels/tile_union.py", "bounds, kb, starts = host[:n + 1], host[n + 1:2 * n + 2], host[2 * n + 2:]",
      "kb, bounds, starts = host[:n + 1], host[n + 1:2 * n + 2], host[2 * n + 2:]",
      "the backward's saved plan read with the tiles' bounds and their kept ids' swapped"),
    M("H11", "pipeline/head_replay.py", "dh.view(-1, dh.shape[-1]).index_copy_(0, p.pos,", "dh.view(-1, dh.shape[-1]).index_add_(0, p.pos,",
      "dL/dh added instead of copied",
      equivalent="dh starts at zero and each counted row belongs to one tile: add and copy write the same"),

    # ---- per-token temperature -------------------------------------------------------------------------
    M("U1", "pipeline/loss.py", "return tau if bad is None else torch.where(bad, torch.full_like(tau, float(\"nan\")), tau)",
      "return tau", "unvalidated invalid per-token temperatures not made NaN"),
    M("U2", "api/logits.py", "return isinstance(temperature, torch.Tensor) and temperature.dim() > 0",
      "return isinstance(temperature, torch.Tensor) and temperature.dim() >= 0", "a 0-d temperature taken per token"),
    M("U3", "pipeline/head_ops.py", "temperature = ops.temperature_param(cfg.temperature if b.tau is None else b.tau, hidden, backend)",
      "temperature = ops.temperature_param(cfg.temperature, hidden, backend)", "linear loss ignores the per-token tau"),
    M("U4", "kernels/ops.py", "return torch.full((1,), float(temperature), dtype=torch.float32, device=like.device)",
      "return torch.full((1,), 1.0, dtype=torch.float32, device=like.device)", "Triton: a number temperature read as 1"),
    M("U5", "kernels/ops.py", "        return temperature.detach().to(device=like.device, dtype=torch.float32)\n",
      "        return temperature.detach().to(device=like.device, dtype=torch.float32).flip(0)\n",
      "Triton: a per-token temperature copied in reverse order",
      equivalent="every tensor of several temperatures reaches temperature_param from loss.call_temperature, "
                 "float32 on the logits' device (the pass-through branch); the copy branch only sees 0-d / "
                 "one-element schedules, which flip leaves as they are"),
    M("U6", "pipeline/epilogue.py", "return ops.temperature_param(t, like, \"triton\").reshape(-1), 1.0",
      "return ops.temperature_param(t, like, \"triton\").reshape(-1)[:1], 1.0",
      "the 4-launch path reads only the first per-token temperature"),
    M("U7", "core/sampling.py", "cu_seqlens, spread or flag and not validate).to(dtype)",
      "cu_seqlens, spread or flag and not validate).to(torch.float32)",
      "a float64 call's per-token temperature rounded to float32", tests=["test_temperature", "test_sampling_checks"]),

    # ---- token_logprobs in one launch; one sort of clip_cov's / kl_cov's and the entropies' keys ----------
    M("L1", "kernels/vocab_status.py", "seq += tl.sum((inb & (c <= tok)).to(tl.int64), axis=0)",
      "seq += tl.sum((inb & (c < tok)).to(tl.int64), axis=0)",
      "packed: a completion's first token reads the previous completion's temperature",
      tests=["test_token_logprobs_unvalidated", "test_validation_edges"]),
    M("L2", "kernels/vocab_status.py", "        return pid // T\n", "        return pid % T\n",
      "padded: a temperature per completion read at the token's position", tests=["test_token_logprobs_unvalidated"]),
    M("L3", "kernels/vocab_fwd_triton.py", "            if CU_NAN:", "            if CU_NAN and False:",
      "unvalidated token_logprobs: a malformed cu_seqlens gives finite outputs", tests=["test_token_logprobs_unvalidated"]),
    M("L4", "pipeline/epilogue.py", "given = revalidate is not None or not host", "given = revalidate is not None",
      "unvalidated token_logprobs: the stand-in ids (-1) with the kernel's cu check",
      tests=["test_token_logprobs_unvalidated"]),
    M("L5", "kernels/epilogue_triton.py", "_top_entropy_thr(srt_ptr, M, N, top_q, POLICY == 11)",
      "_top_entropy_thr(srt_ptr, M, N, top_q, False)", "kl_cov: the entropies' descending keys read from the front",
      tests=["test_epilogue_cov"]),
    M("L6", "kernels/loss_ops.py", "vals, order, srt = vals[0], order[0], vals[-1] if fg[\"TOP_ENT\"] else srt",
      "vals, order, srt = vals[0], order[0], vals[0] if fg[\"TOP_ENT\"] else srt",
      "the top-entropy quantile taken from clip_cov's / kl_cov's sorted keys", tests=["test_epilogue_cov"]),
    M("L7", "core/layout.py", "bad = m & ((ids < 0) | (ids >= lg.shape[-1]))", "bad = m & (ids < 0)",
      "backend='reference': a counted id >= V (unvalidated) clamped to V - 1", tests=["test_reference"]),
    M("L8", "kernels/vp_merge_triton.py", "        inv_t = _inv_tau(tau_ptr)\n", "        inv_t = 1.0 + 0.0 * tau_ptr\n",
      "vocabulary-parallel: the merge's sums ignore a temperature given as a number",
      tests=["test_parallel_temperature", "test_parallel"]),
    M("L9", "kernels/digest_triton.py", "            c = inb & (tl.load(counted_ptr + o, mask=inb, other=0) != 0)",
      "            c = inb", "the agreement's token checksum ignores the mask", tests=["test_digest", "test_parallel"]),
    M("L10", "distributed/vocab_parallel.py", "return None if b.mask is None else b.mask.contiguous()",
      "return None",
      "vocabulary-parallel Triton passes: every token counted, the mask dropped", tests=["test_parallel"]),
    M("L11", "kernels/vp_merge_triton.py", "other=-1).to(tl.int64) - id_start  # this slice's id",
      "other=-1).to(tl.int64)  # this slice's id", "vocabulary-parallel sums: a global id taken as the slice's",
      tests=["test_parallel", "test_vp_merge"]),
    M("L12", "kernels/autograd.py", "g=g.to(c.dtype), tau_value=tau, id_start=id_start)\n    return",
      "g=g.to(c.dtype), tau_value=tau)\n    return", "vocabulary-parallel backward: the target written at its global id",
      tests=["test_parallel"]),
    M("L13", "api/logits.py", "                    if tau_kernels:  # (the eager order", "                    if False:  # (the eager order",
      "gtpo_loss validating: a bad temperature raised as a flagged row, not named", tests=["test_loss_temperature_in_kernels"]),
    M("L15", "kernels/loss_ops.py", "tau_seq=tau_seq, cu=cu,\n              id_start=id_start)",
      "tau_seq=tau_seq, cu=cu)", "vocabulary-parallel backward (the epilogue's op): the target at its global id",
      tests=["test_parallel"]),
    M("L16", "kernels/vp_merge_triton.py", "    tl.store(stats_out + 3 * tok + 1, tl.where(counted, log_s, 0.0), mask=inb)",
      "    tl.store(stats_out + 3 * tok + 1, tl.where(counted, 0.0 * log_s, 0.0), mask=inb)",
      "vocabulary-parallel: the finish's log S for the backward dropped", tests=["test_parallel_epilogue"]),
    M("L17", "kernels/vp_merge_triton.py", "    bad = tl.where(counted, bad | tl.where((y < 0) | (y >= V), BAD_ID, 0), 0)",
      "    bad = tl.where(counted, 0 * bad | tl.where((y < 0) | (y >= V), BAD_ID, 0), 0)",
      "vocabulary-parallel: a non-finite row not flagged by the finish", tests=["test_parallel_epilogue"]),
    M("L18", "pipeline/epilogue_attached.py",
      "    return not (cfg.top_entropy_on and not cfg.batch_term) and b.logits3.shape[-1] % vocab_block.VOCAB_BLOCK != 0",
      "    return False", "vocabulary-parallel: the row's kernel and the forward kernel two launches around the agreement",
      tests=["test_parallel_launches"]),
    M("L19", "kernels/epilogue_triton.py", "lp, en, bad = _finish_at(logp_ptr, ent_ptr, ids_ptr, stats_out, bad_ptr, o, o, inb, m, V_all)",
      "en, lp, bad = _finish_at(logp_ptr, ent_ptr, ids_ptr, stats_out, bad_ptr, o, o, inb, m, V_all)",
      "vocabulary-parallel: the epilogue's finish swaps logp and H", tests=["test_parallel_epilogue"]),
    M("L20", "kernels/vocab_fwd_triton.py", "    r_l = tl.full([HALF], -1.0, tl.float32)", "    r_l = tl.zeros([HALF], tl.float32)",
      "a huge tau: a lane's start maximum adds mass once a finite entry raises it", tests=["test_temperature"]),
    M("L21", "kernels/vocab_fwd_triton.py", "tl.reduce(tl.where(live, alpha * r_l, alpha * (r_l + 1.0)), 0, _SUM)",
      "tl.reduce(alpha * r_l, 0, _SUM)", "a huge tau: lanes without a finite entry subtract mass",
      tests=["test_temperature"]),
    M("L26", "kernels/vocab_fwd_triton.py", "tl.reduce(tl.where(live, alpha * r_l, alpha * (r_l + 1.0)), 0, _SUM)",
      "tl.reduce(tl.where(live, alpha * r_l, 0.0), 0, _SUM)", "a NaN entry on a lane without a finite one: not flagged",
      tests=["test_vp_merge", "test_api"]),
    M("L22", "kernels/vocab_fwd_triton.py",
      "s_move = tl.where(grew, r + tl.where(m != NEG_SENTINEL, 1.0, 0.0), r_b + tl.where(m_b != NEG_SENTINEL, 1.0, 0.0))",
      "s_move = tl.where(grew, r, r_b) + 1.0", "a huge tau: the merge's start and empty blocks add mass",
      tests=["test_temperature"]),
    M("L23", "kernels/vocab_torch.py",
      "s_move = torch.where(grew, r + (m != none), r_b + (m_b != none))",
      "s_move = torch.where(grew, r, r_b) + 1.0", "a huge tau: the torch merge's start and empty blocks add mass",
      tests=["test_temperature"]),
    M("L24", "core/sampling.py", " & torch.isfinite(tau.reciprocal()))", ")",
      "a float32 tau whose inverse overflows passes the check (then blamed on the logits)", tests=["test_temperature"]),
    M("L27", "distributed/agree.py", "            if err is not None or bad is not None:", "            if bad is not None:",
      "validating on a split vocabulary: the row kernel's failed check is not named (a RuntimeError instead)",
      tests=["test_parallel_checks"]),
    M("L28", "distributed/digest.py", "            same[5] = c\n", "            pass\n",
      "a check on the term of the same tensor as a checksum is dropped", tests=["test_digest", "test_parallel_checks"]),
    M("L29", "core/checks.py", '_check(x, None, "binary", None,', '_check(x, None, "finite", None,',
      "the mask's values checked as finite, not as 0 or 1", tests=["test_parallel_checks"]),
    M("L30", "core/batch.py", "checks.check_finite(name, getattr(b, attr), lambda: b.counted, b.mask)",
      "checks.check_finite(name, getattr(b, attr), lambda: b.counted, None)",
      "per-token inputs checked at masked-out tokens too", tests=["test_parallel_checks"]),
    M("L31", "kernels/digest_triton.py", "bad = bad | (inb & ((v < 0) | (v >= size_term))).to(tl.int32)",
      "bad = bad | (inb & (v < 0)).to(tl.int32)", "the row kernel's id check misses ids >= V",
      tests=["test_digest"]),
    M("L32", "kernels/digest_triton.py", "((o == n - 1) & (v != size_term)) | ", "",
      "the row kernel's cu_seqlens check misses a last boundary other than N", tests=["test_parallel_checks"]),
    M("L33", "kernels/digest_triton.py", "fails = (o > 0) & (v - prev > size_term)", "fails = (o > 1) & (v - prev > size_term)",
      "the row kernel's max_seqlen check skips the first completion", tests=["test_parallel_checks"]),
    M("L34", "pipeline/epilogue_attached.py", '            ids = b.given["ids"]  # as given', "            ids = b.ids  # as given",
      "a split vocabulary's epilogue reads the ids made for a malformed cu_seqlens: the same values, launches more",
      tests=["test_parallel_launches", "test_parallel_checks", "test_parallel_first_launch"]),
    M("L35", "kernels/vp_merge_triton.py", "NAN_FLAGGED=nan_flagged,\n", "NAN_FLAGGED=False,\n",
      "split-vocabulary token_logprobs: a flagged token's logp and H finite (the merge's finish)",
      tests=["test_parallel_checks"]),
    M("L36", "kernels/vp_merge.py", "    if nan_flagged:\n        logp, ent = nan_at_flags", "    if False:\n        logp, ent = nan_at_flags",
      "split-vocabulary token_logprobs on the torch backend: a flagged token's logp and H finite",
      tests=["test_parallel_checks"]),
    M("L37", "kernels/digest_triton.py", "(v < size_term.to(tl.float64))", "(v < size_term.to(tl.float64) - 1)",
      "the row kernel lets a value just under its bound pass (n_conf 0.5, a weight of -0.5)",
      tests=["test_digest", "test_parallel_checks"]),
    M("L38", "core/batch.py", "checks.check_at_least(b.rollout_w, 0, lambda: b.counted, b.mask, fail)",
      "checks.check_at_least(b.rollout_w, 0, lambda: b.counted, None, fail)",
      "rollout weights per token checked at masked-out tokens too", tests=["test_parallel_checks"]),
    M("L39", "distributed/digest.py", "per_row = [None, None, None, None, None, rw_rows, None, tau_rows]",
      "per_row = [None, None, None, None, None, None, None, tau_rows]",
      "per-completion rollout weights (padded) not compared: ranks that differ at a counted completion agree",
      tests=["test_parallel_checks"]),
    M("L40", "pipeline/head_ops.py", "    return backend == \"triton\" and epilogue.covers(cfg)",
      "    return backend == \"triton\" and group is None and epilogue.covers(cfg)",
      "the LM head on a split vocabulary runs the eager loss math (about a hundred launches more)",
      tests=["test_parallel_head_epilogue"]),
    M("L41", "pipeline/head_ops.py", "value = head_attach(value, *params, b.ids if vp is None else vp.ids, stats, ent, c, e, dh, dw, db,\n                            temperature, key)",
      "value = head_attach(value, *params, b.ids, stats, ent, c, e, dh, dw, db,\n                            temperature, key)",
      "the head's epilogue path on a split vocabulary reads global ids as the slice's in its backward",
      tests=["test_parallel_head_epilogue"]),
    M("L43", "kernels/vp_merge_triton.py", "    tl.store(logp_out + tok, logp, mask=inb)",
      "    tl.store(logp_out + o, logp, mask=inb)",
      "the split-vocabulary head's finish writes a tile's logp at the tile's row, not its token",
      tests=["test_parallel_head_epilogue"]),
    M("L44", "kernels/vp_merge_triton.py", "y = tl.load(ids_ptr + tok, mask=inb, other=-1)",
      "y = tl.load(ids_ptr + o, mask=inb, other=-1)", "the merge's sums read a head tile's ids at the tile's rows",
      tests=["test_parallel_head_epilogue"]),
    M("L45", "kernels/vocab_fwd_triton.py", "    at = pid if OUT_AT_ROW else tok", "    at = tok if OUT_AT_ROW else tok",
      "the forward kernel writes a head tile's slice statistics at the tokens, not the tile's rows",
      tests=["test_parallel_head_epilogue"]),
    M("L46", "kernels/vp_merge_triton.py", "            at = tok\n",
      "            at = o\n",
      "the merge's sums read a head tile's per-token temperature at the tile's rows",
      tests=["test_parallel_temperature"]),
    M("L47", "kernels/vp_merge_triton.py", "tl.store(stats_out + 3 * tok + 1,", "tl.store(stats_out + 3 * o + 1,",
      "the finish writes a head tile's log S (the backward's) at the tile's row", tests=["test_parallel_head_epilogue"]),
    M("L48", "pipeline/tiles.py", "        self.rows_vp = opts.backend == \"triton\" and", "        self.rows_vp = False and",
      "the split-vocabulary head's tiles gather their inputs and scatter their statistics (6 launches a tile more)",
      tests=["test_parallel_head_epilogue"]),
    M("L49", "pipeline/tiles.py", "        if o.backend == \"triton\" and not local:", "        if self.direct and not local:",
      "the split-vocabulary head's gradient kernel reads gathered per-token inputs (4-5 launches a tile more)",
      tests=["test_parallel_head_epilogue"]),
    M("L50", "api/logits.py", "in_kernels=fast or rules_in_kernels or tau_split,", "in_kernels=fast or rules_in_kernels,",
      "a temperature per token on a split vocabulary checked by a dozen launches unvalidated",
      tests=["test_parallel_launches"]),
    M("L51", "kernels/digest_triton.py", "& (v > 0) & (tl.abs(1.0 / v)", "& (tl.abs(1.0 / v)",
      "the agreement row's temperature check lets a negative tau pass", tests=["test_digest", "test_parallel_temperature"]),
    M("L52", "core/sampling.py", "return out if counted is None else out & made()",
      "return out", "a temperature's check counts uncounted tokens", tests=["test_temperature"]),
    M("L53", "core/sampling.py", '_check(tau, where, "positive", None, bad, fail, rows)',
      '_check(tau, None, "positive", None, bad, fail, rows)',
      "the agreement row checks a temperature at uncounted tokens too", tests=["test_parallel_temperature"]),
    M("L54", "kernels/vocab_jit.py", "tl.where((tau > 0) & (tau < float(\"inf\")), tau,", "tl.where((tau < float(\"inf\")), tau,",
      "the kernels read a negative temperature as given", tests=["test_parallel_temperature"]),
    M("L55", "pipeline/tiles.py", "softcap=o.softcap, outs=outs, rows=idx, nan_flagged=nan_flagged)",
      "softcap=o.softcap, outs=outs, rows=idx, nan_flagged=False)",
      "the head's forward kernel leaves a flagged token's logp and H finite (one process)",
      tests=["test_linear"]),
    M("L56", "pipeline/tiles.py", "nan_flagged=nan_flagged, outs=outs, rows=idx)", "nan_flagged=False, outs=outs, rows=idx)",
      "the head's merge leaves a flagged token's logp and H finite (split vocabulary)",
      tests=["test_parallel_head_epilogue"]),
    M("L57", "kernels/digest_triton.py", "            xo = o // pos\n", "            xo = o\n",
      "the row's kernel reads per-completion weights at the token's index", tests=["test_digest"]),
    M("L58", "kernels/digest_triton.py", "f, pos, n = f | 128, rows[0], flat.numel() * rows[0]",
      "f, pos, n = f | 128, rows[0], flat.numel()", "the row's kernel reads B of the B * T tokens",
      tests=["test_digest"]),
    M("L59", "core/batch.py", "seg=(b.seq_rows, lambda: b.seg))", "seg=None)",
      "per-completion rollout weights checked as if per token", tests=["test_parallel_checks"]),
    M("L60", "distributed/digest.py", "rw_rows = b.rollout_w_seq if not b.packed or b.B else None",
      "rw_rows = None", "per-completion rollout weights spread on the tokens for the checksum (3 launches more)",
      tests=["test_parallel_launches"]),
    M("L61", "pipeline/loss.py", "spread=spread or not (unchecked or validate), where=b.mask)",
      "spread=spread or not (unchecked or validate), where=None)",
      "a per-token temperature's check on a split vocabulary reads every token, counted or not",
      tests=["test_parallel_temperature"]),
    M("L62", "api/linear.py", "        with checks.one_host_read(defer=agree.deferred(g, hidden) or carry):\n            b, head, budget = _prepare(hidden, weight, bias, completion_ids, completion_mask, advantages,",
      "        with checks.one_host_read(defer=carry):\n            b, head, budget = _prepare(hidden, weight, bias, completion_ids, completion_mask, advantages,",
      "the split head's value checks launch and read on their own, not in the agreement's row",
      tests=["test_parallel_head_epilogue"]),
    M("L63", "api/linear.py", "        with checks.one_host_read(defer=agree.deferred(g, hidden) or carry):\n            b, head, budget = _prepare(hidden, weight, bias, completion_ids, completion_mask, None,",
      "        with checks.one_host_read(defer=carry):\n            b, head, budget = _prepare(hidden, weight, bias, completion_ids, completion_mask, None,",
      "split linear_token_logprobs' value checks launch and read on their own", tests=["test_parallel_launches"]),
    M("L64", "pipeline/tile_plan.py", "index_add_(0, t.seg, (live_all & counted).long())",
      "index_add_(0, t.seg, live_all.long())",
      "the fused plan counts masked-out tokens among a completion's rows with a gradient",
      tests=["test_head_floor"]),
    M("L65", "pipeline/tile_plan.py", "    live = live_all[rows]\n", "    live = live_all[:n]\n",
      "the fused plan reads the first n tokens' liveness, not the counted rows'", tests=["test_head_floor"]),
    M("L66", "core/checks.py", "if bad.numel() == 0 or not int(bad.amax()):", "if bad.numel() == 0 or not int(bad[0]):",
      "validating, a flagged token raises only when it is the first",
      tests=["test_host_reads", "test_linear", "test_head_defects", "test_defects_round2"]),
    M("L67", "core/host_read.py", 'if isinstance(failed, RowCheck) and failed.kind == "positive" and _subnormal(failed):',
      "if False:", "a subnormal temperature the device flagged is not named", tests=["test_digest"]),
    M("L68", "pipeline/head_replay.py", "p.vp.V_max, off_host)  # (else a sync: the tiles)",
      "p.vp.V_max, None)  # (else a sync: the tiles)",
      "the recorded sets' offsets read again for the plan (a host read more)", tests=["test_head_replay_epilogue"]),
    M("L69", "kernels/vp_merge_triton.py", "            at = tok // row_length\n",
      "            at = 0 * tok\n", "the merge's sums read every token's tau at completion 0's",
      tests=["test_parallel_temperature"]),
    M("L70", "pipeline/epilogue_attached.py", "(2 if b.packed else 1) * per_seq, vp.start, vp.V)",
      "0, vp.start, vp.V)", "the epilogue and backward read a tau per completion per token",
      tests=["test_parallel_temperature"]),
    M("L71", "distributed/digest.py", "tau_rows = b.tau if b.tau_per_row else None",
      "tau_rows = None", "a tau per completion checksummed as if per token: its two forms disagree",
      tests=["test_parallel_temperature"]),
    M("L72", "api/logits.py", "spread=not (per_seq or split_seq))",
      "spread=not per_seq)", "a tau per completion on a split vocabulary spread on the tokens (a launch more)",
      tests=["test_parallel_launches"]),
    M("L75", "core/batch.py", "            return Lazy(lambda: spread_packed(seq, cu, n)), seq",
      "            return Lazy(lambda: spread_packed(seq, cu, n).flip(0)), seq",
      "packed rollout weights per completion spread in the wrong order", tests=["test_defects", "test_logps_epilogue"]),
    M("L77", "pipeline/loss.py", "    cu = b.given[\"cu_seqlens\"] if b.packed else None\n",
      "    cu = b.cu_seqlens if b.packed else None\n", "a packed temperature spread on the batch's stand-in cu_seqlens (5 launches more)",
      tests=["test_parallel_launches"]),
    M("L73", "core/layout.py", "return self.tau is not None and self.tau_seq",
      "return self.tau is not None and self.tau_seq and self.tau.numel() != self.tok_shape[0]",
      "a packed tau per completion with B == N on a split vocabulary read per token", tests=["test_parallel_temperature"]),
    M("Q26", "api/logits.py", "b.tau, b.tau_seq = tau, per_seq or split_seq", "b.tau, b.tau_seq = tau, per_seq",
      "a tau per completion on a split vocabulary read per token", tests=["test_parallel_temperature"]),
    M("L74", "api/logits.py", "                         and epilogue_attached.takes(logits, cfg, backend))",
      "                         and epilogue_attached.takes(logits, cfg, backend) and not b.packed)",
      "a packed tau on a split vocabulary checked and spread by torch ops (13 -> 33 launches)",
      tests=["test_parallel_launches"]),
    # ---- per completion, packed, on a split vocabulary: found in cu_seqlens by the row's and the merge's kernels
    M("Q1", "kernels/vocab_status.py", "mask=live, other=0).to(tl.int64) <= tok", "mask=live, other=0).to(tl.int64) < tok",
      "a completion's last token read as the next completion's", tests=["test_digest", "test_parallel_epilogue"]),
    M("Q2", "kernels/vp_merge_triton.py", "            at = _seqs_of(cu_ptr, n_seq, tok)\n",
      "            at = _seqs_of(cu_ptr, n_seq, tok + 1)\n",
      "the merge's sums read a token's tau at the next token's completion", tests=["test_parallel_epilogue"]),
    M("Q3", "kernels/digest_triton.py", "            xo = _seqs_of(cu_ptr, n_cu, o)\n", "            xo = _seqs_of(cu_ptr, n_cu, o + 1)\n",
      "the row's kernel reads a token's value at the next token's completion", tests=["test_digest"]),
    M("Q4", "distributed/digest.py", "n = rows[1] if isinstance(rows, tuple) else x.numel() * rows",
      "n = x.numel() if isinstance(rows, tuple) else x.numel() * rows",
      "a packed per-completion checksum's size word counts completions, not tokens", tests=["test_digest"]),
    M("Q5", "distributed/digest.py", "values_digest(spread_rows(x.reshape(-1), rows), where)",
      "values_digest(spread_rows(x.reshape(-1).flip(0), rows), where)",
      "the torch form spreads per-completion values in the wrong order", tests=["test_digest"]),
    M("Q6", "core/layout.py", "return self.tau is not None and self.tau_seq",
      "return self.tau is not None and self.tau.numel() != self.B * self.tok_shape[-1]",
      "a packed per-token temperature read as one per completion", tests=["test_parallel_temperature"]),
    M("Q7", "core/sampling.py", "    rows = None if spread or tuple(", "    rows = None if True or tuple(",
      "a temperature per completion checked at the tokens' indices", tests=["test_parallel_checks"]),
    M("Q8", "core/layout.py", "        return spread_packed(x, *rows)\n", "        return spread_packed(x.flip(0), *rows)\n",
      "a packed per-completion temperature spread in the wrong order for the top-entropy mask's passes",
      tests=["test_parallel_epilogue"]),
    M("Q9", "kernels/digest_triton.py", "SLOTS = 8", "SLOTS = 6",
      "a packed validated row in two launches", tests=["test_parallel_launches"]),
    M("Q10", "core/batch.py", "if b.rollout_w_seq is None or not b.B:  # per token",
      "if b.rollout_w_seq is None or b.packed:  # per token",
      "packed rollout weights per completion spread on the tokens for their check (4 launches more)",
      tests=["test_parallel_launches"]),
    # ---- a batch whose completions are not known (unvalidated): every metric NaN
    M("Q11", "kernels/epilogue_terms.py", "    poison = tl.where(malformed != 0, float(\"nan\"), 0.0)\n",
      "    poison = 0.0\n", "the epilogue's metrics finite numbers over a malformed cu_seqlens",
      tests=["test_epilogue", "test_logps_epilogue"]),
    M("Q12", "pipeline/loss.py", "            res[\"metrics\"] = nan_where(poisoned, res[\"metrics\"])\n", "",
      "the eager loss on log-probs keeps finite metrics for a non-finite entropy", tests=["test_logps_epilogue"]),
    M("Q13", "pipeline/loss.py", "    if b.malformed is not None:\n        res[\"metrics\"] = nan_where(b.malformed, res[\"metrics\"])\n", "",
      "the eager surrogate's metrics finite numbers over a malformed cu_seqlens", tests=["test_epilogue"]),
    # ---- one process, the LM head: the arguments' checks read with the tile plan
    M("Q14", "core/host_read.py", "        if both[-1]:\n", "        if False:\n",
      "the checks carried to the plan's read never raise", tests=["test_host_reads"]),
    M("Q15", "api/linear.py", "    return None if backend == \"reference\" or replay.requested(",
      "    return None if True or replay.requested(", "the head's checks read on their own (a host read more)",
      tests=["test_host_reads"]),
    # ---- unvalidated, an invalid temperature over kept sets: the same NaN on both backends
    M("Q16", "api/logits.py", "logps_loss(b, cfg, logp, ent, num_items, dt, host, nan_all=False)",
      "logps_loss(b, cfg, logp, ent, num_items, dt, host, nan_all=True)",
      "the eager replay makes every output NaN for one flagged token", tests=["test_replay_api"]),
    M("Q17", "api/linear.py", "value, res = loss.logps_loss(b, cfg, logp, ent, num_items, dt, host, nan_all=False)",
      "value, res = loss.logps_loss(b, cfg, logp, ent, num_items, dt, host, nan_all=True)",
      "the head's eager replay makes every output NaN for one flagged token", tests=["test_replay_api"]),
    M("Q18", "pipeline/loss.py", "            at_tokens = poisoned & b.counted\n", "            at_tokens = poisoned\n",
      "a poisoned batch's masked-out tokens NaN on the eager path (0 on the kernels')", tests=["test_replay_api"]),
    M("Q19", "kernels/vocab_triton.py", "dict(cu_ptr=cu.reshape(-1).contiguous(), n_seq=cu.numel() - 1)",
      "dict(cu_ptr=cu, n_seq=cu.numel() - 1)", "a strided cu_seqlens read at stride 1 for a tau per completion",
      tests=["test_parallel_epilogue"]),
    M("Q20", "core/host_read.py", "    except Exception:  # a held check that failed raises its own error first, as at a read of its own\n        carry.settle()\n        raise\n",
      "", "a later error pre-empts a carried check's (the carried flag dropped)", tests=["test_host_reads"]),
    # ---- a malformed cu_seqlens, unvalidated: the kept sets' metrics NaN too, on every path
    M("Q21", "kernels/epilogue_terms.py", "(kept_sums / M_safe).to(tl.float32) + poison,", "(kept_sums / M_safe).to(tl.float32),",
      "the epilogue's kept-set metrics finite over a malformed cu_seqlens", tests=["test_defects_round2"]),
    M("Q22", "kernels/logps_triton.py", "    tl.store(met_out + 1, 0.0 + nan_met)", "    tl.store(met_out + 1, 0.0)",
      "the recorded sets' restored fraction finite over a malformed cu_seqlens", tests=["test_defects_round2"]),
    M("Q23", "api/linear.py", "                metrics = nan_where(b.malformed, metrics)",
      "                metrics = metrics", "the head's kept-set metrics finite over a malformed cu_seqlens",
      tests=["test_defects_round2"]),
    M("Q24", "pipeline/reference.py", "        r[\"metrics\"] = nan_where(b.malformed, r[\"metrics\"])",
      "        pass", "the reference backend's metrics finite over a malformed cu_seqlens", tests=["test_defects_round2"]),
    M("Q25", "api/logits.py", "        if b.malformed is not None:  # (the kept sets' metrics too: no completion is known)\n            metrics = nan_where(b.malformed, metrics)",
      "        pass", "the eager rebuild's kept-set metrics finite over a malformed cu_seqlens", tests=["test_defects_round2"]),
    M("Q27", "api/logits.py", "                metrics = nan_where(b.malformed, metrics)",
      "                metrics = metrics", "the reference backend's kept-set metrics finite over a malformed cu_seqlens",
      tests=["test_defects_round2"]),
    # ---- the fused head's tile plan formed on the device (kernels/tile_plan_triton.py)
    M("Q28", "kernels/tile_plan_triton.py", "cut = (size > 0) & (size + c > P)", "cut = size + c > P",
      "an empty tile opened before a completion that does not fit", tests=["test_tile_plan_kernel"]),
    M("Q29", "kernels/tile_plan_triton.py", "cut = (size > 0) & (size + c > P)", "cut = (size > 0) & (size + c >= P)",
      "a completion that exactly fills the open tile starts a new one", tests=["test_tile_plan_kernel"]),
    M("Q30", "kernels/tile_plan_triton.py", "full = tl.maximum(size - 1, 0) // P", "full = tl.maximum(size - 2, 0) // P",
      "a completion one row longer than a tile left whole (a tile over the budget)", tests=["test_tile_plan_kernel"]),
    M("Q31", "kernels/tile_plan_triton.py", "other=0, volatile=True) <= j)", "other=0, volatile=True) < j)",
      "a tile's first row placed in the tile before", tests=["test_tile_plan_kernel"]),
    M("Q32", "kernels/tile_plan_triton.py", "lv = c & (tl.load(live_ptr + offs, mask=c, other=0) != 0)", "lv = c",
      "every counted row counted as live in its tile", tests=["test_tile_plan_kernel"]),
    M("Q33", "pipeline/tile_plan.py", "_live_first(rows, tile_of[rows], live_all[rows])", "_live_first(rows, tile_of[rows], ~live_all[rows])",
      "the device plan puts a tile's rows known to be dead first", tests=["test_tile_plan_kernel"]),
    M("Q34", "kernels/tile_plan_triton.py", "j = before + tl.cumsum(ci, 0) - ci", "j = before + tl.cumsum(ci, 0) - ci + (t0 > 0)",
      "the counted rows' places off by one after the first block", tests=["test_tile_plan_kernel"]),
    # ---- dppo's trust region on unchecked non-finite log-probs: NaN, not a dropped token
    M("Q35", "objective/verl_modes.py",
      "coef = torch.where(torch.isfinite(logp) & torch.isfinite(old), coef, torch.full_like(coef, float(\"nan\")))",
      "coef = coef", "dppo's eager term drops a token with a non-finite log-prob (a finite loss)",
      tests=["test_unchecked_nan"]),
    M("Q36", "kernels/epilogue_policy.py", "coef = tl.where(finite, coef, float(\"nan\"))", "coef = coef",
      "dppo's kernel term drops a token with a non-finite log-prob (a finite loss)", tests=["test_unchecked_nan"]),
    M("Q37", "distributed/vocab_parallel.py", "options = (*options, *_draw_states(options, b.given[\"ids\"].device))",
      "options = options", "clip_cov's generators in different states on the ranks of a split not refused",
      tests=["test_parallel_clip_cov"]),
    # ---- bnpo: always the local count (spec 9)
    M("Q38", "pipeline/loss.py", "if num_items_in_batch is not None and cfg.local_count and cfg.loss_agg == \"token-mean\":",
      "if False:", "bnpo divides by a given num_items_in_batch", tests=["test_bnpo_local_count"]),
    M("Q39", "core/config.py", "loss_agg=\"token-mean\", local_count=True),", "loss_agg=\"token-mean\"),",
      "the bnpo preset is a plain token-mean (num_items_in_batch taken)", tests=["test_bnpo_local_count"]),
    # ---- the union tiles' bounds cut on the device (kernels/union_plan_triton.py)
    M("Q40", "kernels/union_plan_triton.py", "tl.minimum(s - s0, V.to(tl.int64)) <= budget)",
      "tl.minimum(s - s0, V.to(tl.int64)) < budget)", "a tile that exactly fills the budget cut one row short",
      tests=["test_union_plan"]),
    M("Q41", "kernels/union_plan_triton.py", "size = tl.minimum(tl.maximum(size, 0), V.to(tl.int64))",
      "size = tl.minimum(size, V.to(tl.int64))", "a malformed offset's negative size shrinks the running sums",
      tests=["test_union_plan"]),
    M("Q42", "kernels/union_plan_triton.py", "inside = (end <= M) & (r <= max_rows)", "inside = end <= M",
      "a tile longer than max_rows", tests=["test_union_plan"]),
    M("Q43", "kernels/union_plan_triton.py", "r * tl.minimum(s - s0, V.to(tl.int64)) <= budget)",
      "r * (s - s0) <= budget)", "a tile's entries counted past V", tests=["test_union_plan"]),
    M("Q44", "kernels/tile_union.py", "if device_bounds != host_bounds:", "if False:",
      "a device plan that differs from the host's used unchecked", tests=["test_union_plan"]),
    M("Q45", "pipeline/head_replay.py", "sizes = [max(k, 0) for k in sizes]", "pass",
      "the host plan counts a malformed offset's negative size", tests=["test_union_plan"]),
    # ---- this round's fixes: non-finite log-probs, NaN gradient rows, the KL's own ratio, the reference
    M("Q46", "kernels/logps_triton.py",
      "            flag = tl.where(m & ((tl.abs(raw) < float(\"inf\")) == 0), flag | BAD_NONFINITE, flag)\n", "",
      "a non-finite log-prob passes the kernels' validation", tests=["test_unchecked_nan"]),
    M("Q47", "pipeline/loss.py",
      "raw = raw + torch.where(torch.isfinite(raw.detach()), zero, torch.full_like(zero, float(\"nan\")))",
      "raw = raw", "an infinite log-prob gives the torch backend a finite per-token loss", tests=["test_unchecked_nan"]),
    M("Q48", "api/logps.py", "        checks.check_finite(\"logps\", logps.detach(), b.counted)\n", "",
      "validate=True takes a non-finite log-prob on the host", tests=["test_unchecked_nan"]),
    M("Q49", "objective/surrogate.py",
      "own = cfg.policy_loss == \"geo-mean\" or (spread is None and cfg.importance_sampling_level == \"token\")",
      "own = cfg.policy_loss == \"geo-mean\"", "the bias-corrected KL's two terms cancel again (eager)",
      tests=["test_kl_conditioning"]),
    M("Q50", "kernels/epilogue_terms.py", "            if SEQ and POLICY != 8:", "            if POLICY != 8:",
      "the bias-corrected KL's two terms cancel again (kernel)", tests=["test_kl_conditioning"]),
    M("Q51", "kernels/replay_triton.py", "mask=nan & (y >= 0) & (y < V))", "mask=nan & (y >= 0) & (y < 0))",
      "a NaN coefficient over an empty set leaves a zero gradient row (Triton)", tests=["test_unchecked_nan"]),
    M("Q52", "kernels/replay_torch.py", "    nan = nan & (yl >= 0) & (yl < V)\n", "    nan = nan & (yl < 0)\n",
      "a NaN coefficient over an empty set leaves a zero gradient row (torch)", tests=["test_unchecked_nan"]),
    M("Q53", "pipeline/head_replay.py",
      "        dhc.masked_fill_(nan_rows[:, None], float(\"nan\"))\n", "",
      "the head's dL/dh rows of tokens whose sets project nothing stay 0", tests=["test_union_plan"]),
    M("Q54", "pipeline/replay.py", "return x[pos] if isinstance(x, torch.Tensor) and x.dim() else x",
      "return x[pos] if isinstance(x, torch.Tensor) else x", "a 0-d temperature indexed per token (reference)",
      tests=["test_reference_backend"]),
    M("Q55", "pipeline/reference.py",
      "    return keep, replay_metrics(offsets, restored, kept_mass=(full * keep[pos]).sum(-1), bad=bad)",
      "    return keep, replay_metrics(offsets, restored, bad=bad)", "the reference's rebuilt sets without kept_mass",
      tests=["test_reference_backend"]),
    M("Q56", "pipeline/head.py", "    z = z.to(float_dtype_for(z)) * scale", "    z = z * scale",
      "the reference head scales and soft-caps 16-bit logits in 16 bits", tests=["test_reference_backend"]),
    M("Q57", "kernels/verl_metrics_triton.py", "lower = ((tl.maximum(l1, l2) > -a * c) & (a < 0.0)).to(tl.float32)",
      "lower = ((tl.maximum(l1, l2) > -a * c) & (a > 0.0)).to(tl.float32)",
      "vanilla's dual-clip fraction counts positive advantages", tests=["test_verl_token_modes"]),
    M("Q58", "kernels/verl_metrics_triton.py", "    if MODE <= 3:  # vanilla, dppo, cispo clamp log r",
      "    if MODE <= 2:  # vanilla, dppo, cispo clamp log r", "cispo's ppo_kl on the unclamped log-ratio",
      tests=["test_verl_token_modes"]),
    M("Q59", "integrations/trl_metrics.py", "        if cfg.delta is not None:\n            r = r.clamp(max=cfg.delta)\n",
      "", "TRL's clip metrics without delta's cap", tests=["test_trl_losses"]),
    M("Q60", "integrations/trl_metrics.py", "    if cfg.use_bias_correction_kl:",
      "    if False:", "TRL's kl metric without the bias correction", tests=["test_trl_losses"]),
    M("Q61", "kernels/union_plan_triton.py", "        m0 += tl.sum(fits.to(tl.int64), 0)",
      "        m0 += tl.sum(fits.to(tl.int64), 0) + (j == 1)", "the second union tile starts a row late",
      tests=["test_union_plan"]),
    M("Q62", "integrations/trl_metrics.py", "    if is_w is not None:  # per completion", "    if False:  # per completion",
      "TRL's vespo/phi_seq_mean without the engine's importance ratios", tests=["test_trl_losses"]),
    # ---- torch.compile with 0-d tensor hyper-parameters; top_k = 0 over a split, unvalidated
    M("Q63", "core/config.py", 'object.__setattr__(self, "_read", () if torch.compiler.is_compiling() else read)',
      'object.__setattr__(self, "_read", read)',
      "a traced call re-runs the config's value checks (float() of a traced tensor)", tests=["test_compile_tensors"]),
    M("Q67", "core/config.py", "        new.__post_init__(read=tuple(changes))\n", "",
      "replace skips the checks and the names' normalisation", tests=["test_compile_tensors"]),
    M("Q68", "core/config.py", "new.__post_init__(read=tuple(changes))", "new.__post_init__(read=None)",
      "replace reads every 0-d tensor field again, per call", tests=["test_host_reads"]),
    M("Q69", "api/logits.py", "tuple(x.detach() for x in reference.token_logprobs(b, logits, temperature, keep, host))",
      "reference.token_logprobs(b, logits, temperature, keep, host)",
      "token_logprobs' reference backend returns tensors attached to the logits' graph",
      tests=["test_reference_backend"]),
    # ---- malformed recorded offsets through the LM head on the torch backend
    M("Q70", "core/sampling.py", "torch.where(broken, 0, flat)", "flat",
      "malformed offsets keep their sets: the head's tiles planned on sizes they made up", tests=["test_head_replay"]),
    M("Q71", "kernels/replay_torch.py", "    if V:  # (no column", "    if True:  # (no column",
      "the NaN write at the sampled id into an empty union's gradient (IndexError)", tests=["test_head_replay"]),
    # ---- a DTensor's mesh order; VOCAB_BLOCK in the agreement
    M("Q72", "distributed/vocab_parallel.py", "    if in_order and at != dist.get_rank(group):",
      "    if False and at != dist.get_rank(group):", "a DTensor on a mesh out of rank order: slices misplaced",
      tests=["test_gloo_scenarios"]),
    M("Q73", "distributed/vocab_parallel.py", "fingerprint_field((host, vocab_block.VOCAB_BLOCK, *options))",
      "fingerprint_field((host, *options))", "ranks with different GTPO_VOCAB_BLOCK merge differently (a hang)",
      tests=["test_gloo_scenarios"]),
    M("Q74", "core/config.py", '            self.__dict__.pop("_read")', "            pass",
      "the check's state left on the config (vars(config) passes it on as a field)", tests=["test_compile_tensors"]),
    # ---- the sequence level's bias-corrected KL without cancellation; compile around a process group
    M("Q75", "objective/surrogate.py", "kl_term(logp, ref, log_r, cfg, None if own else lambda x: (",
      "kl_term(logp, ref, log_r, cfg, None if True else lambda x: (",
      "gspo's bias-corrected KL as a token-level ratio's (-r d)", tests=["test_kl_conditioning"]),
    M("Q76", "objective/surrogate.py", "d64 = ref.double() - logp.double()", "d64 = (ref - logp).double()",
      "d rounded in float32 before the pivot: its error times e^P", tests=["test_kl_conditioning"]),
    M("Q77", "kernels/epilogue_terms.py", "a = ref.to(tl.float64) - lp.to(tl.float64) - kl_p",
      "a = (ref - lp - kl_p.to(tl.float32)).to(tl.float64)", "the kernel's d - P in float32", tests=["test_kl_conditioning"]),
    M("Q78", "kernels/epilogue_triton.py", "SEQ and BIAS_KL and HAS_KL)", "False)",
      "the kernel's pivot never formed (P = 0, mean expm1 = 0)", tests=["test_kl_conditioning"]),
    M("Q79", "core/entry.py", "            if _grouped(args, kwargs):", "            if False:",
      "a call on a process group traced by torch.compile", tests=["test_compile_group"]),
    M("Q80", "core/entry.py", "return bool(args) and isinstance(args[0], dtensor)", "return False",
      "a DTensor's call traced by torch.compile", tests=["test_compile_group"]),
    M("Q64", "objective/policy.py", "        u2 = clip(r, lo, hi) * A", "        u2 = torch.clamp(r, lo, hi) * A",
      "ppo's 0-d tensor clip bounds through torch.clamp (fullgraph fails)",
      tests=["test_compile_tensors"]),
    M("Q65", "pipeline/epilogue.py", "loss_ops.token_logps(b.logits3.detach(), ", "loss_ops.token_logps(b.logits3, ",
      "token_logprobs hands logits with grad to an op with no autograd formula", tests=["test_compile_tensors"]),
    M("Q66", "distributed/vocab_replay.py", "kmax = min(max(int(k_all.max()), 1), max(vp.V_max, 1)) if M else 1",
      "kmax = min(int(k_all.max()), max(vp.V_max, 1)) if M else 1", "top_k = 0 over a split, unvalidated, raises IndexError",
      tests=["test_mutants_round3"]),
    M("Q81", "core/flags.py", 'return tau if 0 < tau <= FLT_MAX and 1 / tau <= FLT_MAX else',
      'return tau if 0 < tau and 1 / tau <= FLT_MAX else',
      "a schedule set to inf: 1 / tau = 0, finite wrong outputs (torch)",
      tests=["test_temperature_schedule"]),
    M("Q82", "core/entry.py", "and math.isnan(tau_or_nan(float(tau))):", "and float(tau) < 0:",
      "a schedule set to 0, NaN or inf blamed on the logits' rows", tests=["test_temperature_schedule"]),
    M("Q83", "kernels/replay_triton.py", " | tl.where(inv_t != inv_t, BAD_NONFINITE, 0)", "",
      "a NaN 1 / tau over recorded sets not flagged: validated, accepted", tests=["test_temperature_schedule"]),
    M("Q84", "kernels/vocab_torch.py",
      "        flag |= torch.isnan(r).to(torch.int8) * BAD_NONFINITE  # (a NaN 1 / tau too, as the Triton kernel flags it)\n",
      "", "torch pass: a NaN 1 / tau not flagged (validated: accepted)", tests=["test_temperature_schedule"]),
    M("Q85", "kernels/replay_torch.py", "wide = torch.float64 if x.dtype.is_floating_point else x.dtype", "wide = x.dtype",
      "a kept set summed in float32 (150k entries: 1e-5 off)", tests=["test_sampling_replay"]),
    M("Q86", "pipeline/reference.py", "        keep[bad] = False\n", "        pass\n",
      "reference backend: an invalid rule value taken as off (finite outputs)", tests=["test_reference_backend"]),
    M("Q87", "core/config.py", 'if pl in ("verl-cispo", "dppo-tv", "dppo-kl") else (1.0, "in [0, 1)")',
      'if False else (1.0, "in [0, 1)")',
      "verl-cispo's clip_ratio_low >= 1 (no lower bound) refused", tests=["test_verl_modes", "test_contract"]),
    M("Q88", "kernels/replay.py", "nan_where(bad.any(), metrics)", "nan_where(bad.all(), metrics)", "replay metrics finite unless every token is flagged",
      tests=["test_replay_metrics_nan"]),
    M("Q89", "kernels/epilogue_terms.py", "    x = tl.where((inb & m & bad)[:, None] & (col < 3)[None, :], float(\"nan\"), x)\n",
      "", "the epilogue's kept-set sums over a flagged token finite", tests=["test_replay_metrics_nan"]),
    M("Q90", "kernels/logps_triton.py", '        tl.store(met_ptr + tl.arange(0, 2), tl.full([2], float("nan"), tl.float32))\n',
      "", "recorded sets' metrics finite over a flagged token", tests=["test_replay_metrics_nan"]),
    M("Q91", "pipeline/head_replay_ops.py", "bad = flags.any() if p.invalid is None else flags.any() | p.invalid.any()",
      "bad = flags.any()", "the head's metrics finite with an invalid rule value", tests=["test_replay_metrics_nan"]),
    M("Q92", "pipeline/replay.py", "_any(flags != 0, None if invalid is None else invalid.reshape(-1))",
      "_any(flags != 0, None)", "eager replay metrics finite with an invalid rule",
      tests=["test_replay_metrics_nan"]),
    M("Q97", "core/flags.py", 'torch.where((tau > 0) & (tau <= FLT_MAX) & (tau.reciprocal() <= FLT_MAX), tau,',
      'torch.where((tau > 0) & (tau.reciprocal() <= FLT_MAX), tau,', "tau_or_nan keeps an infinite tensor tau",
      tests=["test_temperature_schedule"]),
    M("Q98", "kernels/replay_triton.py", "    return _inv_tau(tau_value)", "    return 1.0 / tau_value",
      "the replay kernel takes a number tau's 1 / tau as it comes (-1: finite outputs)", tests=["test_sampling_replay"]),
    M("Q93", "distributed/vocab_replay.py", "mp = torch.where((mp >= 0) & (mp <= 1), mp,",
      "mp = torch.where((mp >= 0) & (mp < 1), mp,", "min_p 1 taken as off across a vocabulary split",
      tests=["test_parallel_replay"]),
    M("Q94", "api/logits.py", "tau = tau_or_nan(float(tau)) if not", "tau = float(tau) if not",
      "a schedule set to -1 over kept sets across a split: finite numbers, accepted validating",
      tests=["test_parallel_replay"]),
    M("Q95", "kernels/vocab_jit.py", 'return tl.where(inv < float("inf"), inv, float("nan"))', "return inv",
      "a schedule set to 1e-39 over recorded sets (Triton): log-probs -inf, not NaN", tests=["test_temperature_schedule"]),
    M("Q96", "pipeline/head.py", "higher = torch.is_grad_enabled()  # create_graph", "higher = False  # create_graph",
      "the reference head's second-order gradient silently 0", tests=["test_head_defects"]),
    M("Q99", "pipeline/head_replay.py", "            g.masked_fill_(poisoned, float(\"nan\"))", "            pass",
      "the head over kept sets: dL/dW and dL/db finite (0 with malformed offsets) at a NaN coefficient",
      tests=["test_head_replay"]),
    M("Q100", "pipeline/reference.py", "    t = cfg.temperature\n    if tau is not None or",
      "    t = None\n    if tau is not None or",
      "backend='reference' hands the oracle a schedule changed in place to -1: refused unvalidated",
      tests=["test_temperature_schedule"]),
    M("Q101", "distributed/data_parallel.py", "        checks.check_ids_in_range(b.ids, b.counted, ID_LIMIT)",
      "        pass", "data-parallel conflict_weights validating takes a counted negative id",
      tests=["test_collective_failures"]),
    M("Q102", "objective/policy.py", "    return torch.where((A == 0) & torch.isinf(x), torch.zeros((), dtype=x.dtype, device=x.device), x * A)",
      "    return x * A", "an overflowing ratio times a zero advantage: NaN (torch)", tests=["test_ratio_overflow"]),
    M("Q103", "kernels/epilogue_policy.py", "    return tl.where(x == float(\"inf\"), tl.where(A == 0.0, 0.0, x * A), x * A)", "    return x * A",
      "an overflowing ratio times a zero advantage: NaN (the epilogue kernel)", tests=["test_ratio_overflow"]),
    M("Q104", "objective/policy.py", "slope = torch.where(r == math.inf, torch.zeros((), dtype=r.dtype, device=r.device), sig * torch.sigmoid(-x) * r)",
      "slope = torch.where(r == -math.inf, torch.zeros((), dtype=r.dtype, device=r.device), sig * torch.sigmoid(-x) * r)", "SAPO's slope at an overflowing ratio: NaN (torch)",
      tests=["test_ratio_overflow"]),
    M("Q108", "objective/policy.py", "torch.where((A == 0) & torch.isinf(x),", "torch.where(A == 0,",
      "a NaN ratio (invalid input) times a zero advantage: 0, a finite gradient (torch)", tests=["test_ratio_overflow"]),
    M("Q109", "kernels/epilogue_policy.py", "    return tl.where(x == float(\"inf\"), tl.where(A == 0.0, 0.0, x * A), x * A)",
      "    return tl.where(A == 0.0, 0.0, x * A)",
      "a NaN ratio (invalid input) times a zero advantage: 0, a finite gradient (the epilogue kernel)",
      tests=["test_ratio_overflow"]),
    M("Q110", "kernels/epilogue_policy.py", 'tl.where(r == float("inf"), 0.0, sig * tl.sigmoid(-x) * r)',
      'tl.where(r < float("inf"), sig * tl.sigmoid(-x) * r, 0.0)', "SAPO's slope at a NaN ratio: 0 (the epilogue kernel)",
      tests=["test_ratio_overflow"]),
    M("Q111", "pipeline/reference.py", "flags = row_flags(nonfinite_rows(lg.detach()), z_y.detach()) * m",
      "flags = row_flags(nonfinite_rows(lg.detach()), z_y.detach()) * 0",
      "backend='reference', validating, takes a NaN / +inf row or a -inf target (a NaN loss)",
      tests=["test_reference_backend"]),
    M("Q112", "distributed/vocab_parallel.py", "            pending.g.error = e\n            pending.made()\n",
      "            raise\n", "a failing first launch raised on its rank alone: a rank in the agreement left waiting",
      tests=["test_parallel_first_launch"]),
    M("Q113", "kernels/vp_first_triton.py", '"ROW_MASK": meta["HAS_MASK"], "BLOCK": ROW_BLOCK}',
      '"ROW_MASK": meta["HAS_MASK"], "BLOCK": ROW_BLOCK * 0 + 64}',
      "the first launch's row program loops over 64 elements: the same row (equivalent: its sums do not depend on it)",
      tests=["test_parallel_first_launch"],
      equivalent="the row's checksums are int64 sums mod 2**64 and its checks any / max: no block width changes them"),
    M("Q105", "kernels/vp_first_triton.py", "    if pid < 0:\n", "    if pid < -1:\n",
      "the first launch skips the agreement's row: every rank's checksums 0, ranks that differ agree",
      tests=["test_parallel_first_launch"]),
    M("Q106", "kernels/vp_merge_triton.py", "        t_r = (z_y - m) * inv_t", "        t_r = z_y - m",
      "the owner's target logit not divided by tau (TARGET_Z)", tests=["test_parallel_first_launch"]),
    M("Q107", "kernels/vp_merge_triton.py", "(tok - i * T + logits_start) * stride_lt + y", "(tok + logits_start) * stride_lt + y",
      "the owner reads its target logit from the wrong row (TARGET_Z)", tests=["test_parallel_first_launch"]),
    M("Q114", "kernels/conflict_triton.py", "        share = tl.cdiv(N, n_groups)", "        share = tl.cdiv(N, tl.num_programs(0))",
      "folded into the sums launch, the conflict groups' NaN shares of a malformed cu_seqlens leave gaps",
      tests=["test_parallel_conflicts"]),
    M("Q115", "kernels/vp_merge_triton.py", "    if conflicts is not None and not conflicts.done:",
      "    if conflicts is not None and conflicts.done:", "the conflict weights not folded: a launch of their own (9)",
      tests=["test_parallel_conflicts"]),
    M("Q116", "pipeline/epilogue_attached.py", "        b.conflicts.launch()", "        pass",
      "where no sums launch took them, the conflict weights never made (lam uninitialized)",
      tests=["test_parallel_conflicts"]),
    M("Q117", "kernels/conflict_triton.py", "        lam_f = tl.where(bad[:, None] | lost, nan,",
      "        lam_f = tl.where(bad[:, None], nan,", "a NaN advantage's group gets finite lam (the kernel)",
      tests=["test_conflict_nan_advantage"]),
    M("Q118", "objective/conflict.py", "    cut = torch.isnan(b.adv)", "    cut = torch.isinf(b.adv)",
      "a NaN advantage's group gets finite lam (torch)", tests=["test_conflict_nan_advantage"]),
    M("Q119", "kernels/kept_set.py", "    prob = torch.softmax(srt.to(torch.float64), dim=-1)",
      "    prob = torch.softmax(srt, dim=-1)", "top-p's masses summed in float32 (torch): a mass above the cut rounded onto it",
      tests=["test_sampling_rules"]),
    M("Q120", "pipeline/reference.py", "        invalid = _any(invalid, nf)", "        invalid = _any(invalid, None)",
      "backend='reference', rules over a NaN row unvalidated: a finite log-prob", tests=["test_reference_backend"]),
    M("Q121", "core/layout.py", "        L, pos = packed_layout(b, longest=True)\n        rows =",
      "        L, pos = packed_layout(b)\n        rows =", "backend='reference': a short max_seqlen indexes out of bounds",
      tests=["test_reference_backend"]),
    M("Q122", "core/config.py", "lambda v: FLT_MAX >= v > 0 and 1 / v <= FLT_MAX",
      "lambda v: v > 0 and 1 / v <= FLT_MAX", "a temperature above float32's range taken (the rules' paths crash)",
      tests=["test_temperature"]),
    M("Q123", "integrations/trl_sampler.py", "        if ends[i] and n != ends[i]:", "        if n != ends[i]:",
      "TRL's recorded sets of a completion masked out (mask_truncated_completions) refused", tests=["test_trl_replay"]),
    M("Q124", "core/sampling.py", "(_is_number(x) and math.isfinite(x) and (not integer or x == int(x)) and ok(x))",
      "(_is_number(x) and (not integer or x == int(x)) and ok(x))",
      "a trainer's top_k = inf: OverflowError, not the error naming the field", tests=["test_sampling_checks"]),
    M("Q125", "integrations/verl_modes.py", "    if mode in READS_CLIP:", "    if True:",
      "gpg / dro / kl_cov refuse a clip_ratio their verl functions never read", tests=["test_verl_token_modes"]),
    M("Q126", "integrations/token_ppo.py", "logps = torch.where(torch.isfinite(logps), torch.clamp(",
      "logps = torch.where(torch.isfinite(logps) | True, torch.clamp(",
      "SkyRL's / OpenRLHF's clamp makes a log-prob of +-inf a finite ratio (validated)",
      tests=["test_verl_token_modes"]),
    M("Q127", "objective/policy.py", "sig * torch.sigmoid(-x) * r)", "sig * (1.0 - sig) * r)",
      "SAPO's slope with 1 - sigma: 0 where the gate saturates in float32 (torch)", tests=["test_ratio_overflow"]),
    M("Q128", "kernels/epilogue_policy.py", "sig * tl.sigmoid(-x) * r)", "sig * (1.0 - sig) * r)",
      "SAPO's slope with 1 - sigma: 0 where the gate saturates in float32 (the epilogue kernel)",
      tests=["test_ratio_overflow"]),
    M("Q129", "pipeline/reference.py", "        out[k] = fix(extras[k], finite)", "        out[k] = extras[k]",
      "backend='reference' hands an unvalidated +inf old log-prob to the oracle: a finite loss",
      tests=["test_unchecked_nan"]),
    M("Q130", "pipeline/reference.py", "    return lg.double() / torch.where(m, t, 1.0)[..., None]",
      "    return lg.double() / t[..., None]", "backend='reference' reads a masked-out token's temperature (NaN rows)",
      tests=["test_reference_backend"]),
    M("Q131", "pipeline/reference.py", "lg.gather(-1, ids.long().clamp(", "lg.gather(-1, ids.clamp(",
      "backend='reference' validating gathers with int16 ids: RuntimeError", tests=["test_reference_backend"]),
    M("Q132", "integrations/trl.py", "        tau = float(self.gtpo_config.temperature) != float(self.args.temperature)",
      "        tau = False", "gtpo_head='logits': old / ref passes at args.temperature, the loss at generation_kwargs'",
      tests=["test_trl_replay"]),
    M("Q133", "api/logits.py", "tau_kernels = (fast or rules_in_kernels) and _per_token_tau(temperature)",
      "tau_kernels = fast and _per_token_tau(temperature)",
      "rules with a temperature tensor, validating: its check in a dozen torch ops (23 launches)",
      tests=["test_launches"]),
    M("Q134", "api/logits.py", "in_kernels=fast or (one and not host), spread=not per_seq)",
      "in_kernels=fast or (kern and not host), spread=not per_seq)",
      "token_logprobs with rules and a temperature tensor, unvalidated: its NaN fill in torch ops (17 launches)",
      tests=["test_launches"]),
    M("Q135", "core/config.py", 'if pl in ("verl-cispo", "dppo-tv", "dppo-kl") else (1.0, "in [0, 1)")',
      'if pl in ("verl-cispo",) else (1.0, "in [0, 1)")', "dppo's divergence threshold of 1 or more refused",
      tests=["test_verl_token_modes"]),
    M("Q136", "kernels/digest_triton.py", "head = tl.where(k == n_fields + 1, key,", "head = tl.where(k == n_fields, key,",
      "the agreement row's kernel writes the host values' checksum into the wrong slot", tests=["test_digest"]),
    M("Q137", "distributed/agree.py", 'return [(c + v) & _MASK61 if kind == "digest" else',
      'return [v if kind == "digest" else', "a Digest's constant not added back to the gathered row's field",
      tests=["test_digest"]),
    M("Q138", "distributed/agree.py", "if len({row[-1] for row in rows}) > 1:", "if False:",
      "ranks whose host values differ are compared on this rank's values (the shapes, the options)",
      tests=["test_collective_failures"]),
    M("Q139", "api/advantages.py", '        checks.check_finite("entropy", entropy, m.reshape(-1))', "        pass",
      "gtpo_token_advantages takes a NaN entropy at a counted token (filtered out: a finite 0)",
      tests=["test_argument_names"]),
    M("Q140", "api/weights.py", '    checks.check_float_dtype("dtype", dtype)  #', "    #",
      "conflict_weights takes an integer or bool dtype", tests=["test_argument_names"]),
    M("Q141", "distributed/data_parallel.py", "sign = torch.where(torch.isnan(adv), 2.0, torch.sign(adv)).long()",
      "sign = torch.sign(adv).nan_to_num(0.0).long()",
      "data-parallel conflict weights: a NaN advantage travels as inactive (finite weights)", tests=["test_parallel_dp"]),
    M("Q142", "distributed/vocab_replay.py", "| ((extra > 0) & survives) | (yc < 0) | (yc >= vp.V))",
      "| ((extra > 0) & survives))", "split rules: a sampled id outside the vocabulary, unvalidated, gives a finite logp",
      tests=["test_parallel_replay_inputs"]),
    M("Q143", "distributed/vocab_replay.py", "kmax = min(max(int(k_all.max()), 1), max(vp.V_max, 1)) if M else 1",
      "kmax = max(int(k_all.max()), 1) if M else 1", "split rules: a top_k above V gathers top_k-wide candidates",
      tests=["test_parallel_replay_inputs"]),
    M("Q144", "core/sampling.py", "    return (token_ids.to(device=device, dtype=torch.long).contiguous(),",
      "    return (token_ids.to(device=device, dtype=torch.long),",
      "a strided int64 sampling_mask.token_ids read at stride 1 by the Triton kernels",
      tests=["test_parallel_replay_inputs"]),
    M("Q145", "kernels/kept_rule_triton.py", "inv_temp, counted = _token(_tau_at(pid, pid, T, seq_cu_ptr, n_seq, TEMP_PER_SEQ),",
      "inv_temp, counted = _token(_tau_at(pid, pid, T, seq_cu_ptr, n_seq, 0),",
      "the rules' kernel reads a temperature per completion at the token's index", tests=["test_temperature"]),
    M("Q146", "api/logits.py", "per_seq = tau_kernels and _per_completion(temperature, b)",
      "per_seq = fast and tau_kernels and _per_completion(temperature, b)",
      "gtpo_loss with rules spreads a temperature per completion on the tokens (packed: 4 launches more)",
      tests=["test_launches"]),
    M("Q147", "core/checks.py", "x = _rounded(float(num_items), dtype)  #",
      "x = float(torch.tensor(float(num_items), dtype=dtype))  #",
      "num_items_in_batch as a number rounded through a host tensor (a counted read and tensor from host data)",
      tests=["test_launches"]),
    M("Q148", "distributed/vocab_replay.py", "g_h = -pk * g_ent[seg] * (d + ent[seg])",
      "g_h = 0.0 * pk", "the split head's backward over kept sets without the entropy's gradient",
      tests=["test_parallel_head_replay_backward"]),
    M("Q149", "distributed/vocab_replay.py", "gs = torch.where(mine & ok[seg] & ((pk > 0) | hit), gs, 0.0)",
      "gs = torch.where(ok[seg] & ((pk > 0) | hit), gs, 0.0)",
      "the split head's backward puts the other slices' entries on a clamped column of this one",
      tests=["test_parallel_head_replay_backward"]),
    M("Q150", "pipeline/reference.py", "v = x.detach().reshape(-1).to(torch.float64)", "v = x.reshape(-1).to(torch.float64)",
      "backend='reference' differentiates the loss's constants (advantages, old / ref log-probs, weights)",
      tests=["test_reference_backend"]),
    M("Q151", "pipeline/reference.py", 'if b.packed and cfg.policy_loss == "clip-cov":', "if False:",
      "backend='reference' draws clip_cov's keys in the padded layout for a packed batch",
      tests=["test_reference_backend"]),
    M("Q152", "core/config.py", "unknown = set(overrides) - set(cls.__dataclass_fields__)",
      "unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}",
      "GTPOConfig.preset inside torch.compile(fullgraph=True) fails to trace", tests=["test_compile_tensors"]),
    M("Q153", "objective/verl_modes.py", "return pg, spread, (s * log_r > s * xc) & (s != 0)",
      "return pg, spread, ~spread & (A != 0)", "geo_mean (torch) counts a NaN advantage's tokens as clipped",
      tests=["test_reference_backend"]),
    M("Q154", "kernels/epilogue_policy.py", "clipped = ((sgn * log_r > sgn * xc) & (sgn != 0.0)).to(tl.int32)",
      "clipped = (spread.to(tl.int32) == 0).to(tl.int32) * (A != 0.0).to(tl.int32)",
      "geo_mean (Triton) counts a NaN log r's token as clipped", tests=["test_reference_backend"]),
    M("Q155", "kernels/vocab_bwd_triton.py", "            if KEEP:  # exactly 0 outside the set, a NaN coefficient's token too (spec 13)\n                g = tl.where(z == float(\"-inf\"), 0.0, g)\n",
      "", "the rules' backward multiplies a NaN coefficient into the entries outside the kept set",
      tests=["test_reference_backend"]),
    M("Q156", "kernels/vocab_bwd_triton.py", "            if KEEP:\n                g = tl.where(z == float(\"-inf\"), 0.0, g)\n",
      "", "the rules' backward (its partial block) multiplies a NaN coefficient into the entries outside the set",
      tests=["test_reference_backend"]),
    M("Q157", "distributed/agree.py", "    def part(i, f):\n        if isinstance(f, Digest):",
      "    def part(i, f):\n        if i < raw:\n            return \"raw\", int(f)\n        if isinstance(f, Digest):",
      "the agreement's raw fields read as ints: a data-parallel config holding a 0-d tensor refused",
      tests=["test_parallel_dp"]),
    M("Q158", "kernels/kept_set.py", "    drop[:, -1:].fill_(False)", "    drop[:, -1] = False",
      "top-p's last kept entry set from a 0-d tensor made from a Python bool (a host-to-device copy a call)",
      tests=["test_parallel_launches"]),
    M("Q159", "api/logits.py", "            warns = host and (fast_replay or cfg.entropy_threshold is not None)",
      "            warns = host", "a split replay reads the epilogue's status word when nothing needs it",
      tests=["test_parallel_launches"]),
    M("Q160", "core/sampling.py", "_rounded(float(x), dtype)), None", "float(x)), None",
      "a rule given as a number is decided in float64 by the reference backend, in float32 by the others",
      tests=["test_rule_numbers"]),
    M("Q161", "core/sampling.py", "min(int(x), _TOP_K_MAX)", "int(x)",
      "a top_k past int64 overflows the torch backend's tensor and the Triton launch's argument",
      tests=["test_rule_numbers"]),
    M("Q163", "kernels/logps_triton.py",
      "    if m & ((flag != 0) | ((tl.abs(en) < float(\"inf\")) == 0)):",
      "    if m & ((tl.abs(en) < float(\"inf\")) == 0):",
      "an invalid recorded set's size is averaged into mean_kept_size (Triton)", tests=["test_replay_nan_token"]),
    M("Q164", "kernels/top_entropy.py", "    return tl.where(edge != edge, float(\"nan\"), thr)", "    return thr",
      "the kernels' quantile passes over a NaN counted entropy (sorted last)", tests=["test_replay_nan_token"]),
    M("Q165", "objective/surrogate.py",
      "    return torch.where(m & torch.isnan(srt[-1]), torch.full_like(keep, float(\"nan\")), keep)", "    return keep",
      "the eager quantile passes over a NaN counted entropy (sorted last)", tests=["test_replay_nan_token"]),
    M("Q166", "distributed/vocab_replay.py", "    logp, ent = logp + poison, ent + poison",
      "    logp, ent = torch.where(bad, nan, logp), torch.where(bad, nan, ent)",
      "the split kept sets' NaN tokens pass no gradient (a malformed cu_seqlens: a zero gradient)",
      tests=["test_parallel_replay_nan_grad"]),
    M("Q167", "kernels/kept_set.py", "keep.scatter_(1, yc, held | inr)", "keep.scatter_(1, yc, True)",
      "an out-of-range sampled id adds the clamped column V - 1 to its kept set",
      tests=["test_parallel_replay_nan_grad"]),
    M("Q168", "kernels/epilogue_triton.py", "shaped = tl.where(penalty == 0.0, adv, adv - penalty * hbar)",
      "shaped = adv - penalty * hbar", "the kernel's shaping at a 0-d tensor gamma of 0 spreads a NaN Hbar",
      tests=["test_replay_nan_token"]),
    M("Q169", "objective/surrogate.py", "shaped = torch.where(pen == 0, adv, shaped)", "shaped = shaped",
      "the eager shaping at a 0-d tensor gamma of 0 spreads a NaN Hbar", tests=["test_replay_nan_token"]),
    M("Q170", "kernels/kept_rule_triton.py", "inside = rule | ((offs == y) & (offs < V))", "inside = rule | (offs == y)",
      "the kept set's size counts a sampled id past V at a masked lane", tests=["test_kept_set_tile"]),
    M("Q171", "kernels/epilogue_terms.py", "kr = tl.where(k3 < float(\"inf\"), k3 * r, tl.exp(d + log_r) - (d + 1.0) * r)",
      "kr = k3 * r", "the kernel's bias-corrected k3 r as a product where k3 overflows (inf or NaN)",
      tests=["test_kl_bias_overflow"]),
    M("Q172", "kernels/epilogue_terms.py", "return tl.where(xf <= 80.0, e_l * _expm1(tl.minimum(xf, 80.0)), tl.exp((lg + x).to(tl.float32)) - e_l)",
      "return e_l * _expm1(xf)", "the kernel's sequence KL gradient forms expm1(d - P) alone past 80 (overflow)",
      tests=["test_kl_bias_overflow"]),
    M("Q173", "objective/surrogate.py", "kr = torch.where(k3 < math.inf, k3 * r, torch.exp(d + log_r) - (d + 1) * r)",
      "kr = k3 * r", "the eager bias-corrected k3 r as a product where k3 overflows", tests=["test_kl_bias_overflow"]),
    M("Q174", "objective/surrogate.py", "re = torch.where(xf <= 80, e_l * torch.expm1(xf.clamp(max=80)), torch.exp((lg + x).to(d.dtype)) - e_l)",
      "re = e_l * torch.expm1(xf)", "the eager sequence KL gradient forms expm1(d - P) alone past 80 (overflow)",
      tests=["test_kl_bias_overflow"]),
    M("Q175", "distributed/vocab_replay.py", "t_r = zero.index_add(0, seg, torch.where(hit, s - mx[seg], torch.zeros_like(s)))",
      "t_r = zero.index_add(0, seg, torch.where(hit & False, s - mx[seg], torch.zeros_like(s)))",
      "the split merge's target term dropped", tests=["test_parallel_replay_bf16"]),
    M("Q176", "distributed/vocab_replay.py", "gs = torch.where(hit, -torch.expm1(d) * g_logp[seg] + g_h, -pk * g_logp[seg] + g_h)",
      "gs = -pk * g_logp[seg] + g_h", "the split head's backward drops the sampled id's own term",
      tests=["test_parallel_replay_bf16"]),
    M("Q177", "pipeline/reference.py", "lg = lg + torch.where(flags != 0, float(\"nan\"), 0.0).to(lg.dtype)[..., None]",
      "lg = lg", "the reference backend hands an invalid row to the oracle unvalidated (a finite loss)",
      tests=["test_reference_backend_invalid_rows"]),
    M("Q178", "pipeline/reference.py", "bad = bad_tok.any(-1).to(nan_group.device) | nan_group",
      "bad = bad_tok.any(-1).to(nan_group.device)", "the reference backend's conflict weights finite in a NaN advantage's group",
      tests=["test_conflict_nan_advantage"]),
    M("Q179", "pipeline/reference.py", "if (extras[\"lam\"] is None or extras[\"n_conf\"] is None) and cfg.use_conflict_mask",
      "if (extras[\"lam\"] is None and extras[\"n_conf\"] is None) and cfg.use_conflict_mask",
      "the reference backend's NaN conflict contract only when neither lam nor n_conf is given",
      tests=["test_conflict_nan_advantage"]),
    M("L14", "kernels/vocab_bwd_triton.py", "            at = i\n", "            at = tok\n",
      "the backward reads a tau per completion at the token's index (padded)", tests=["test_loss_temperature_in_kernels"]),
]


TEST_OVERRIDE = None  # --tests: these pytest arguments in place of the mapping
WITHOUT_NEW = False  # --before: the suite without NEW_TESTS


def tests_for(m, root):
    if TEST_OVERRIDE:
        return TEST_OVERRIDE
    files = [f"tests/{t}.py" for t in (m.tests or TESTS[m.file])]
    if not WITHOUT_NEW and os.path.exists(os.path.join(root, NEW_TESTS)):
        files.insert(0, NEW_TESTS)  # first: the outcome does not depend on the order, -x stops sooner
    return files


def apply(m, root):
    """The file's original text, after writing the mutant (None when the snippet is not there once)."""
    path = os.path.join(root, "gtpo_kernels", m.file)
    with open(path) as f:
        src = f.read()
    if src.count(m.old) != 1:
        return None
    with open(path, "w") as f:
        f.write(src.replace(m.old, m.new))
    return src


def run(m, root, timeout):
    path = os.path.join(root, "gtpo_kernels", m.file)
    src = apply(m, root)
    if src is None:
        return "stale", 0.0, ""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", HYPOTHESIS_PROFILE="mutation",
               PYTHONPATH=os.pathsep.join([PLUGIN_DIR] + ([os.environ["PYTHONPATH"]] if "PYTHONPATH" in os.environ
                                                          else [])))
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "gtpo_mutation_profile"]
    cmd += tests_for(m, root) + [f"--deselect={d}" for d in DESELECT]
    t0 = time.time()
    try:
        r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        status = "survived" if r.returncode == 0 else "killed"
        tail = (r.stdout + r.stderr).strip().splitlines()
        tail = tail[-1] if tail else ""
        if r.returncode not in (0, 1):  # 2: interrupted / collection error, 5: no tests: still a kill, noted
            tail = f"rc={r.returncode} {tail}"
    except subprocess.TimeoutExpired:
        status, tail = "timeout", ""
    finally:
        with open(path, "w") as f:
            f.write(src)
    return status, time.time() - t0, tail


# ci's examples, derandomized, but no shrinking: a failing example ends the run at once (shrinking a
# mutant's failure took minutes); registered before tests/conftest.py loads HYPOTHESIS_PROFILE
PLUGIN = """from hypothesis import HealthCheck, Phase, settings
settings.register_profile("mutation", max_examples=50, derandomize=True, deadline=None, database=None,
                          phases=(Phase.explicit, Phase.reuse, Phase.generate),
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
"""
PLUGIN_DIR = tempfile.mkdtemp(prefix="gtpo-mut-plugin-")
with open(os.path.join(PLUGIN_DIR, "gtpo_mutation_profile.py"), "w") as _f:
    _f.write(PLUGIN)


def copy_tree():
    dst = tempfile.mkdtemp(prefix="gtpo-mut-")
    shutil.copytree(ROOT, os.path.join(dst, "repo"), ignore=shutil.ignore_patterns(
        ".git", "__pycache__", ".hypothesis", "*.pyc", ".pytest_cache"))
    root = os.path.join(dst, "repo")
    out = subprocess.run([sys.executable, "-c", "import gtpo_kernels; print(gtpo_kernels.__file__)"], cwd=root,
                         capture_output=True, text=True).stdout.strip()
    assert out.startswith(root), f"the copy imports {out}, not its own package"
    return dst, root


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", help="only mutants of files whose path contains this")
    ap.add_argument("--only", help="comma-separated mutant ids")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per mutant")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--check", action="store_true", help="check the snippets only")
    ap.add_argument("--in-place", action="store_true", help="mutate this checkout (restored after each)")
    ap.add_argument("--before", action="store_true", help=f"without {NEW_TESTS} (the score before those tests)")
    ap.add_argument("--resume", help="a previous sweep's output: its killed mutants are taken as killed (valid when "
                    "tests were only added since: the same runs, with more tests), the others run again")
    ap.add_argument("--report", help="print the table and score of previous sweeps' outputs, comma-separated, a "
                    "later one overriding (nothing run), with this list's current equivalence notes")
    ap.add_argument("--tests", help="comma-separated pytest arguments run in place of the mapped test files")
    a = ap.parse_args()
    global TEST_OVERRIDE, WITHOUT_NEW
    WITHOUT_NEW = a.before
    TEST_OVERRIDE = a.tests.split(",") if a.tests else None
    ids = set(a.only.split(",")) if a.only else None
    sel = [m for m in MUTANTS if (ids is None or m.id in ids) and (a.file is None or a.file in m.file)]
    assert len({m.id for m in MUTANTS}) == len(MUTANTS), "duplicate ids"
    if a.list or a.check:
        bad = 0
        for m in sel:
            with open(os.path.join(ROOT, "gtpo_kernels", m.file)) as f:
                n = f.read().count(m.old)
            bad += n != 1
            print(f"{m.id:5} {m.file:28} {'ok' if n == 1 else f'STALE ({n})':10} "
                  f"{'[equivalent] ' if m.equivalent else ''}{m.what}")
        print(f"{len(sel)} mutants, {bad} stale")
        return 1 if bad and a.check else 0
    prior = {}
    if a.report:
        by_id, status = {m.id: m for m in MUTANTS}, {}
        for path in a.report.split(","):  # a later output (a --resume run) overrides an earlier one
            with open(path) as f:
                for w in (line.split() for line in f):
                    if len(w) > 2 and w[0] in by_id and w[1] in ("killed", "timeout", "survived", "stale"):
                        status[w[0]] = w[1]
        report([(m, status[m.id], 0.0, "") for m in MUTANTS if m.id in status])
        return 0
    if a.resume:
        with open(a.resume) as f:
            for line in f:
                w = line.split()
                if len(w) > 2 and w[1] in ("killed", "timeout", "survived", "stale"):
                    prior[w[0]] = w[1]
    tmp, root = (None, ROOT) if a.in_place else copy_tree()
    rows = []
    try:
        for m in sel:
            if prior.get(m.id) in ("killed", "timeout"):
                rows.append((m, prior[m.id], 0.0, "(killed in " + a.resume + ")"))
                continue
            status, dt, tail = run(m, root, a.timeout)
            rows.append((m, status, dt, tail))
            print(f"{m.id:5} {status:8} {dt:6.1f}s {m.file:28} {'[eq] ' if m.equivalent else ''}{m.what} | {tail}",
                  flush=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(PLUGIN_DIR, ignore_errors=True)
    report(rows)


def report(rows):
    print("\n== per file (killed / applied; stale not counted; timeout counts as killed)")
    files = sorted({m.file for m, *_ in rows})
    tot = dict(k=0, n=0, eq=0, eqs=0)
    for f in files:
        rs = [r for r in rows if r[0].file == f and r[1] != "stale"]
        k = sum(r[1] in ("killed", "timeout") for r in rs)
        eq = sum(r[0].equivalent is not None for r in rs)
        eqs = sum(r[0].equivalent is not None and r[1] == "survived" for r in rs)
        stale = sum(r[0].file == f and r[1] == "stale" for r in rows)
        tot["k"] += k
        tot["n"] += len(rs)
        tot["eq"] += eq
        tot["eqs"] += eqs
        print(f"  {f:30} {k:3} / {len(rs):3}   non-equivalent {k - (eq - eqs):3} / {len(rs) - eq:3}   "
              f"(equivalent {eq}, of which survived {eqs}" + (f"; stale {stale})" if stale else ")"))
    n_ne = tot["n"] - tot["eq"]
    k_ne = tot["k"] - (tot["eq"] - tot["eqs"])
    print(f"\nSCORE killed {tot['k']} / {tot['n']} applied mutants; non-equivalent killed {k_ne} / {n_ne}")
    surv = [r[0] for r in rows if r[1] == "survived"]
    if surv:
        print("survivors:")
        for m in surv:
            print(f"  {m.id:5} {m.file:28} {'EQUIVALENT: ' + m.equivalent if m.equivalent else 'NOT EQUIVALENT'}"
                  f" -- {m.what}")


if __name__ == "__main__":
    sys.exit(main())
