#!/usr/bin/env bash
# The GPU check, one script (at most 9 minutes on one H200: each step has its own time limit, 540 s in all,
# plus a few seconds of shell between them):
#   step                                                                              limit (s)
#   0  the peers (Liger-Kernel, TRL) installed from $WHEELS when missing, the targets,    35
#      the tree that runs (refused when uncommitted), the GPU, the versions
#      (python -m bench.gpu_report begin: tree.txt, run.json)
#   1  the property tests on CUDA (tests/test_kernels.py -k match_reference, Triton       40
#      compiled) against the float64 reference (property_tests.txt)
#   2  tests/cuda_runtime_check.py: no sync with validate=False, no recompilation         25
#      across lengths, one CUDA graph (cuda_runtime_check.txt)
#   3  tests/cuda_sync_check.py: host syncs counted as they happen                        25
#      (set_sync_debug_mode("warn")): 0 with validate=False, 1 with validate=True, the
#      head's only in its tile planning (cuda_sync_check.txt / .json)
#   4  tests/cuda_graph_check.py: CUDA-graph capture and replay equal to eager for every  70
#      preset, padded and packed with max_seqlen, token_logprobs, recorded-set replay
#      (cuda_graph_check.txt / .json)
#   5  tests/cuda_bitwise_check.py: the vocabulary-parallel merge bitwise the single      30
#      kernel, compiled (cuda_bitwise_check.txt)
#   6  the grid: V in {32000, 151936, 262144} x tokens in {4096, 16384, 32768}, bf16,    145
#      fwd / bwd / fwd+bwd in interleaved rounds, % of the copy bandwidth measured in
#      the same run over the bytes each implementation moves: ours validated (the
#      default row: gtpo preset, entropies), ours with validate=False, ours doing
#      Liger's work (grpo preset, validate=False), Liger-Kernel's triton_grpo_loss
#      (GRPO, no entropy, no checks); every implementation checked against the float64
#      reference first, on sampled completions (past 2**31 elements at the large
#      sizes). Sizes not started after --time-budget 120 s are recorded as skipped,
#      so that the largest still ends and the JSON is written in time; no plots
#      (latest-cuda.json)
#   7  the LM head at 4096 x 2048 x 151936 and 8192 x 4096 x 151936, bf16, TRL's tile     75
#      budget (256 MiB): linear_gtpo_loss fused / recompute against TRL's chunked head,
#      Liger's LigerFusedLinearGRPOLoss and its fused linear cross-entropy
#      (latest-linear-cuda.json)
#   8  python -m bench.timing.profile at 4096 x 32000 and 16384 x 151936: wall against    30
#      device time, kernels and host syncs per call (counted by set_sync_debug_mode),
#      ours validated / not / replaying top_k = 50, top_p = 0.95 sets: the replay row
#      of spec 13 (profile-cuda.json)
#   9  python -m bench.launches --device cuda: launches and host reads of each call,      25
#      the kernels compiled (launches.txt)
#   10 replaying recorded kept sets at 16384 x 151936 (bench.timing.replay): gtpo_loss    25
#      and token_logprobs against the full vocabulary, with the bytes each moves, and
#      the same sets rebuilt in the call from top_k and top_p (--rules: the kept sets'
#      kernel, checked against the recorded sets first) (latest-replay-cuda.json; after
#      steps 4 and 8, which compiled the replay kernels)
#   11 python -m bench.gpu_report targets: every JSON names this tree and none is         15
#      marked uncommitted; PASS / FAIL for each target (targets.txt, targets.json)
#   total                                                                                540
# Cut to fit 9 minutes (least valuable for the targets; each runs apart): the separate large-problem check
# (step 6 checks every implementation at 16384 and 32768 tokens first), V = 128256, the eager baseline and
# torch.compile rows (measured on 2026-12-04), the spec-14 head options (python -m bench.head_dtype --time),
# the launch configurations (python -m bench.aot.tune --gpu).
# A run's record: every step's exit code, seconds and limit in steps.tsv; each failed step with its exit
# code (124 = its time limit) in failures.txt ("none" when none failed); the log of each step beside them.
# The tree: every JSON carries `tree` (bench.common.record.tree_hash, the same on any copy of the tree, with
# or without git) and `tree_committed`; step 0 refuses a tree that git sees as uncommitted, or whose hash is
# not $GTPO_COMMITTED_TREE when set (`python -m bench.common.record --tree` on the clean checkout);
# GPU_CHECK_ALLOW_DIRTY=1 runs anyway and every record is marked. Afterwards, on the clean checkout:
# `python -m bench.common.record FILE...` checks that the files name its tree.
# Results go to $OUT when set (the device runner brings that folder back), else bench/out/gpu-check.
# Peers: pip download --no-deps liger-kernel==0.8.5 trl==1.16.0 datasets dill multiprocess -d .whl
#   on a machine with the registry (TRL's head imports datasets); $WHEELS (default .whl/) is read here.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-bench/out/gpu-check}"
mkdir -p "$OUT_DIR"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-dev}"
# the package and its float64 reference from this checkout, installed or not; the peers' folder
PEERS=/tmp/gtpo-peers
mkdir -p /tmp/gtpo-src "$PEERS" && ln -sfn "$PWD/reference" /tmp/gtpo-src/gtpo_reference
export PYTHONPATH="$PWD:/tmp/gtpo-src:$PEERS${PYTHONPATH:+:$PYTHONPATH}"
status=0
STEPS="$OUT_DIR/steps.tsv"
FAILURES="$OUT_DIR/failures.txt"
printf 'step\texit\tseconds\tlimit\n' > "$STEPS"
echo "# failed steps of the GPU check started $(date -u +%FT%TZ): step, exit code (124 = its time limit)" > "$FAILURES"
step() { echo; echo "=== $* ($(date +%T))"; T0=$(date +%s); }
# done_step NAME LIMIT EXIT: one line of steps.tsv; a failure also into failures.txt and the status
done_step() {
  printf '%s\t%s\t%s\t%s\n' "$1" "$3" "$(( $(date +%s) - T0 ))" "$2" >> "$STEPS"
  if [ "$3" != 0 ]; then
    status=1
    echo "$1: exit $3$([ "$3" = 124 ] && echo " (time limit, $2 s)")" | tee -a "$FAILURES"
  fi
}
summary() {
  step "done: status $status"
  grep -q -v '^#' "$FAILURES" || echo "none" >> "$FAILURES"
  column -t -s "$(printf '\t')" "$STEPS" 2>/dev/null || cat "$STEPS"
  echo "failed steps:"; grep -v '^#' "$FAILURES"
}

step "0. the peers, the targets, the tree that runs, the GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT_DIR/nvidia-smi.txt"
timeout 35 python -m bench.gpu_report begin --out "$OUT_DIR" --wheels "${WHEELS:-.whl}" --peers "$PEERS" 2>&1 \
  | tee "$OUT_DIR/begin.txt"
rc=${PIPESTATUS[0]}; done_step "0 begin" 35 "$rc"
if [ "$rc" != 0 ]; then summary; exit "$rc"; fi  # 3: an uncommitted tree, refused

step "1. the property tests on CUDA (Triton compiled) against the float64 reference"
GTPO_TEST_DEVICE=cuda timeout 40 python -m pytest -q -x tests/test_kernels.py -k "match_reference" \
  -p no:cacheprovider 2>&1 | tee "$OUT_DIR/property_tests.txt" | tail -25
done_step "1 property tests" 40 "${PIPESTATUS[0]}"

step "2. runtime checks: no sync with validate=False, one JIT variant across lengths, a CUDA graph"
timeout 25 python tests/cuda_runtime_check.py 2>&1 | tee "$OUT_DIR/cuda_runtime_check.txt"
done_step "2 runtime checks" 25 "${PIPESTATUS[0]}"

step "3. host syncs counted: 0 with validate=False, 1 with validate=True, the head's only in its planning"
timeout 25 python tests/cuda_sync_check.py --cuda-only --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/cuda_sync_check.txt"
done_step "3 sync counts" 25 "${PIPESTATUS[0]}"

step "4. CUDA graphs: every preset, padded and packed, token_logprobs, recorded-set replay, equal to eager"
timeout 70 python tests/cuda_graph_check.py --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/cuda_graph_check.txt"
done_step "4 CUDA graphs" 70 "${PIPESTATUS[0]}"

step "5. the vocabulary-parallel merge bitwise the single kernel (compiled)"
timeout 30 python tests/cuda_bitwise_check.py 2>&1 | tee "$OUT_DIR/cuda_bitwise_check.txt"
done_step "5 bitwise merge" 30 "${PIPESTATUS[0]}"

step "6. the grid against Liger-Kernel: ours validated, not validated, and doing Liger's work"
timeout 145 python -m bench --device cuda --settle 0 --suite logits --tokens 4096,16384,32768 --vocab 32000,151936,262144 \
  --impls triton,triton-novalidate,triton-grpo,liger --no-aot --no-traffic --no-plots --warmup 2 --time-budget 120 \
  --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/grid.txt"
done_step "6 grid" 145 "${PIPESTATUS[0]}"

step "7. the LM head at 4096 x 2048 and 8192 x 4096 x 151936 against TRL's and Liger's heads"
timeout 75 python -m bench --device cuda --settle 0 --suite linear --linear-size 4096,2048,151936 \
  --linear-size 8192,4096,151936 --linear-impls fused,recompute,trl,liger,liger-flce --linear-tile 256 --repeats 6 \
  --no-plots --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/head.txt"
done_step "7 head" 75 "${PIPESTATUS[0]}"

step "8. where one call spends its time: kernels and host syncs per call (validated, not, replay row)"
timeout 30 python -m bench.timing.profile --device cuda --size 4096x32000 --size 16384x151936 \
  --impls triton,triton-novalidate,triton-replay --out "$OUT_DIR" 2>&1 | grep -v "^USDT" | tee "$OUT_DIR/profile.txt"
done_step "8 profile" 30 "${PIPESTATUS[0]}"

step "9. launches and host reads of each call, the kernels compiled"
timeout 25 python -m bench.launches --device cuda 2>&1 | tee "$OUT_DIR/launches.txt"
done_step "9 launches" 25 "${PIPESTATUS[0]}"

step "10. replaying recorded kept sets at 16384 x 151936: gtpo_loss and token_logprobs against the full vocabulary, and the sets rebuilt by the rules"
timeout 25 python -m bench.timing.replay --device cuda --tokens 16384 --vocab 151936 --rounds 6 --warmup 1 --rules \
  --out "$OUT_DIR" 2>&1 | tee "$OUT_DIR/replay.txt"
done_step "10 replay" 25 "${PIPESTATUS[0]}"

step "11. the records (every JSON names this tree) and the targets, PASS / FAIL"
timeout 15 python -m bench.gpu_report targets --out "$OUT_DIR" 2>&1
done_step "11 records and targets" 15 "${PIPESTATUS[0]}"

summary
exit $status
