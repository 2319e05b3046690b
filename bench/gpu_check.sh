#!/usr/bin/env bash
# The GPU check, one script (about 6 minutes on an H200; each step has its own time limit, 590 s in all):
#   1. the correctness tests on CUDA (Triton compiled, not interpreted) and the runtime checks of
#      tests/cuda_runtime_check.py (host syncs, JIT cache, CUDA graphs);
#   1b. tests/cuda_sync_check.py: the logits path and the head's two schedules with every sync an error;
#   2. our kernels against the float64 reference on sampled completions of a problem with
#      N * V > 2**31 (16384 x 151936 bf16; the last completion sits past 2**31 elements);
#   3. the benchmark: V in {32000, 128256, 151936, 262144} x tokens in {4096, 16384, 32768}, bf16,
#      fwd / bwd / fwd+bwd with do_bench, % of the copy bandwidth measured in the same run, peak
#      memory, against eager and Liger-Kernel's triton_grpo_loss; 3b. torch.compile of the eager loss at
#      4096 x 32000 (its first compile alone takes over a minute);
#   4. the linear suite (the loss from hidden states and the LM head) at N = 4096, D = 2048,
#      V = 151936, bf16: materialized logits + gtpo_loss, linear_gtpo_loss fused / recompute, TRL's
#      ChunkedLogProbFunction + the same loss, Liger-Kernel's LigerFusedLinearGRPOLoss; fwd+bwd time over
#      TRL's and peak memory above inputs and gradients, at TRL's default tile (4096 x 32768 bf16 = 256 MiB);
#   4b. the LM head alone at V = 151936 and a 7-8B model's hidden size (N = 8192, D = 4096) with the budget
#      TRL uses (its 256 MiB tile): linear_gtpo_loss fused / recompute against TRL's and Liger's heads;
#   4c. the head's spec-14 options timed (python -m bench.head_dtype --time): default, batch_invariant=True,
#      head_dtype=torch.float32 and both, fwd+bwd at 4096 x 2048 x 151936 bf16 (head_options.txt);
#   5. the launch configurations of bench/aot/tune.py's static model (BLOCK_V x warps) timed on this GPU
#      (tune-cuda.json), to confirm or replace the model's choice in gtpo_kernels/kernels/vocab_triton.py;
#   6. bench.timing.profile at 4096 x 32000 and 16384 x 151936: wall against device time, kernels and host
#      reads per call, for ours (validate on / off, and replaying top_k = 50 / top_p = 0.95 kept sets:
#      the replay row of spec 13) and eager (profile-cuda.json);
#   0. the tree that runs: `python -m bench.common.record --tree` (a hash of the files, the same on any copy of
#      the tree, with or without git; every JSON written carries it as `tree`): commit first, then run, then
#      `python -m bench.common.record FILE...` on the clean checkout checks that the files name it;
#   6b. python -m bench.launches --device cuda: kernel launches, host reads and host-data tensors of each
#      call, counted with the kernels compiled (launches.txt; the CPU count is in docs/benchmarks.md);
#   7. replaying recorded kept sets (spec 13's sampling_mask) at 16384 x 151936 bf16: gtpo_loss (fwd+bwd)
#      and token_logprobs with sampling_mask= against the same calls on the full vocabulary, with the
#      bytes each moves; sets drawn as top_k = 512 / top_p = 0.95 keep them from peaked rows (tens to
#      hundreds of ids per token), checked against float64 first (bench.timing.replay,
#      latest-replay-cuda.json). Run after step 6, whose replay row has compiled the replay kernels.
# Results (JSON, PNG) go to $OUT when set (the device runner brings that folder back), else bench/results.
# Peers: pip download --no-deps liger-kernel==0.8.5 trl==1.16.0 datasets dill multiprocess -d .whl
#   on a machine with the registry (TRL's head imports datasets).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-bench/results}"
mkdir -p "$OUT_DIR"
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-dev}"
# the package and its float64 reference from this checkout, installed or not
mkdir -p /tmp/gtpo-src && ln -sfn "$PWD/reference" /tmp/gtpo-src/gtpo_reference
export PYTHONPATH="$PWD:/tmp/gtpo-src${PYTHONPATH:+:$PYTHONPATH}"
status=0
step() { echo; echo "=== $* ($(date +%T))"; }

step "0. the tree that runs"
echo "tree $(python -m bench.common.record --tree)" | tee "$OUT_DIR/tree.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"

# Liger-Kernel and TRL (for their rows): installed from wheels in $WHEELS (default .whl/) when missing,
# into a folder of their own put on PYTHONPATH (no registry needed)
WHEELS="${WHEELS:-.whl}"
for mod in liger_kernel trl datasets dill multiprocess; do  # the last three: what TRL's head imports
  python -c "import $mod" 2>/dev/null && continue
  wheel="$(ls "$WHEELS"/${mod}-*.whl 2>/dev/null | tail -1)"
  if [ -n "$wheel" ]; then
    step "installing $mod from $wheel"
    python -m pip install -q --no-deps --no-index --no-compile --target /tmp/gtpo-peers "$wheel" \
      && export PYTHONPATH="/tmp/gtpo-peers${PYTHONPATH:+:$PYTHONPATH}" || echo "$mod install failed: reported as not installed"
  else
    echo "$mod not installed and no wheel in $WHEELS: reported as not installed"
  fi
done

step "1. correctness tests on CUDA (property tests against the float64 reference, then runtime checks)"
GTPO_TEST_DEVICE=cuda timeout 60 python -m pytest -q -x tests/test_kernels.py -k "match_reference" \
  -p no:cacheprovider 2>&1 | tail -25
rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { echo "correctness tests: exit $rc (124 = time limit)"; status=1; }
# no host sync with validate=False, one JIT variant across lengths, CUDA-graph capture and replay
timeout 40 python tests/cuda_runtime_check.py 2>&1 | tee "$OUT_DIR/cuda_runtime_check.txt"
rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { echo "runtime checks: exit $rc"; status=1; }
# the logits path and both head schedules under torch.cuda.set_sync_debug_mode("error"), validate=False
# (the head's tile planning is its one allowed host read)
timeout 40 python tests/cuda_sync_check.py --cuda-only 2>&1 | tee "$OUT_DIR/cuda_sync_check.txt"
rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { echo "sync checks: exit $rc"; status=1; }

step "2. sampled completions of N*V > 2**31 against the reference"
timeout 30 python -m bench --device cuda --suite logits --check-only --settle 0 --tokens 16384 --vocab 151936 --impls triton \
  --no-traffic --no-plots --out "$OUT_DIR" 2>&1 | grep -A3 '^implementation'
rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { echo "large-problem check: exit $rc"; status=1; }

step "3. benchmark: the GPU grid against eager and Liger-Kernel"
timeout 85 python -m bench --device cuda --settle 0 --suite logits --gpu-sizes --impls triton,eager,liger --no-aot --no-traffic \
  --time-budget 80 --out "$OUT_DIR" 2>&1
rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { echo "benchmark: exit $rc"; status=1; }

step "3b. torch.compile of the eager loss at one size (its first compile takes over a minute)"
timeout 80 python -m bench --device cuda --settle 0 --suite logits --tokens 4096 --vocab 32000 --impls triton,eager,compile \
  --no-aot --no-traffic --no-plots --out "$OUT_DIR/compile" 2>&1
rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { echo "torch.compile row: exit $rc"; status=1; }

step "4. linear suite (from hidden states) at V = 151936"
timeout 40 python -m bench --device cuda --settle 0 --suite linear --linear-size 4096,2048,151936 --linear-tile 256 --out "$OUT_DIR" 2>&1
rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { echo "linear suite: exit $rc"; status=1; }

step "4b. the LM head at V = 151936, D = 4096, TRL's tile budget: ours against TRL's and Liger's heads"
timeout 40 python -m bench --device cuda --settle 0 --suite linear --linear-size 8192,4096,151936 \
  --linear-impls fused,recompute,trl,liger --linear-tile 256 --out "$OUT_DIR" 2>&1
rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { echo "LM head at V = 151936: exit $rc"; status=1; }

step "4c. the head's spec-14 options at V = 151936, D = 2048: default, batch_invariant, head_dtype=float32, both"
timeout 15 python -m bench.head_dtype --time --device cuda --size 4096,2048,151936 2>&1 | tee "$OUT_DIR/head_options.txt"
rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { echo "head options: exit $rc (124 = time limit)"; status=1; }

step "5. launch configurations: the static model's candidates (bench/aot/tune.py) timed on this GPU"
timeout 30 python -m bench.aot.tune --gpu --out "$OUT_DIR" 2>&1 | tail -12
rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { echo "tune: exit $rc"; status=1; }

step "6. where one call spends its time: torch.profiler per implementation (validate on / off, kept-set replay, eager)"
timeout 70 python -m bench.timing.profile --device cuda --size 4096x32000 --size 16384x151936 --out "$OUT_DIR" 2>&1 \
  | grep -v "^USDT"
rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { echo "profile: exit $rc"; status=1; }

step "6b. launches and host reads of each call, the kernels compiled"
timeout 30 python -m bench.launches --device cuda 2>&1 | tee "$OUT_DIR/launches.txt"
rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { echo "launch count: exit $rc"; status=1; }

step "7. replaying recorded kept sets at 16384 x 151936: gtpo_loss and token_logprobs against the full vocabulary"
timeout 30 python -m bench.timing.replay --device cuda --tokens 16384 --vocab 151936 --out "$OUT_DIR" 2>&1
rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { echo "replay timing: exit $rc (124 = time limit)"; status=1; }

step "done: status $status"
exit $status
