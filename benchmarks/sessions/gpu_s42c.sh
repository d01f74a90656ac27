#!/usr/bin/env bash
# Session 42, for an H200: the grouped GEMV's GPU tests (session 42's call 1 cut them), the
# graph replay timelines of decode:1@4096 and decode:64@512 (the
# defaults), then the grouped GEMV (opt-in, ops.GROUPED_GEMV_MAX_TOKENS) against the batched
# cuBLAS GEMM for wo_a in bench forward at decode:1 and decode:4 (two alternating passes).
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s42c.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-330}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 45); echo "== GPU tests: the grouped GEMV (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/ops/test_gemv.py -k grouped > "$R/gemv_tests.log" 2>&1
tail -1 "$R/gemv_tests.log"
replay_timelines 120 "$R/graph_gap.json" decode:1@4096 decode:64@512
forward_ab grouped_gemv 'import rackserve.ops as o; o.GROUPED_GEMV_MAX_TOKENS = 16' \
  batched_cublas 'pass' \
  --iters 30 --warmup 3 --batch decode:1@4096 --batch decode:4@4096
(cd "$OUT" && tar czf s42c.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
