#!/usr/bin/env bash
# Session 42: the grouped GEMV for wo_a (ops.GROUPED_GEMV_MAX_TOKENS) on the GPU (its tests,
# then bench forward A/B against the batched cuBLAS GEMM at decode:1 / 4 / 64), wq_b's GEMV
# tilings against cuBLAS (gemv_bench), then gpu_s42.sh's timelines and synchronous profile
# with what is left.
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s42b.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 60); echo "== GPU tests: the GEMV, grouped (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/ops/test_gemv.py > "$R/gemv_tests.log" 2>&1
tail -2 "$R/gemv_tests.log"
forward_ab grouped_gemv 'pass' batched_cublas \
  'import rackserve.ops as o; o.GROUPED_GEMV_MAX_TOKENS = None' \
  --iters 30 --warmup 3 --batch decode:1@4096 --batch decode:4@4096 --batch decode:64@4096
t=$(cap 60); echo "== gemv_bench wq_b (${t}s)"
((t)) && timeout "$t" python3 benchmarks/gemv_bench.py --shapes wq_b,wq_b_csa \
  --output "$R/gemv_bench.json" 2>&1 | tail -2
BUDGET_S=$((BUDGET_S - SECONDS)) bash "$(dirname "$0")/gpu_s42.sh"
