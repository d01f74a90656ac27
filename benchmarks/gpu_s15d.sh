#!/usr/bin/env bash
# Session 15, call 4 (~7 minutes): issue 13's prefill attention at two programs per SM (the
# output columns in two one-warpgroup programs, 16-row tiles: 112 KB of shared memory
# each), against the default; then issue 17's TTFT on the 43-layer checkpoint with seven
# repeats (session 14's call 4 had three: the prefill engine's TTFT moved by ~10 ms between
# runs), after the prefill engine's export moved behind its answer.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/gpu_s15d.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/device_env.sh"
start_call
t=$(cap 90); echo "== prefill attention at 8192 queries (${t}s)"
((t)) && timeout "$t" python3 benchmarks/prefill_bench.py --output "$R/prefill_attn.json" \
  --attention-only dv2_w4_bn16,dv2_w4_bn16_stages3 2>&1 | tail -8
OUT=$OUT BUDGET_S=$((BUDGET_S - SECONDS)) LENGTHS=${LENGTHS:-1024,4096} REPEATS=${REPEATS:-7} \
  bash "$(dirname "$0")/gpu_s14a.sh"
