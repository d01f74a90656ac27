#!/usr/bin/env bash
# Session 40, call 1: the routed experts' GEMMs, CUTLASS's grouped GEMM against cuBLAS's
# batched GEMM over padded rows (sessions/s40_grouped_gemm.py), then session 39's prepared
# A/B (gpu_s39b.sh: the step's upload through PinnedStaging against the old staging).
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s40.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-260}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 60); echo "== grouped vs batched GEMM (${t}s)"
((t)) && timeout "$t" python3 benchmarks/sessions/s40_grouped_gemm.py --output "$R/gemm.json"
cp -r "$R" "$OUT/s40" && rm -rf "$R"
BUDGET_S=$((BUDGET_S - SECONDS)) bash "$(dirname "$0")/gpu_s39b.sh"
echo "== done in ${SECONDS}s"
