#!/usr/bin/env bash
# Session 16, call 2 (~8 minutes): launch-shape sweeps for the batch-1 decode step's kernels
# (gpu_s16a's timeline): the fused MoE's gate-up and down kernels alone at T = 1 and 64
# (moe_tiling_sweep.py), the latency-bound router + align and mHC pre (latency_kernels.py),
# the GEMV's variants at one token (gemv_bench.py).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s16b.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-500}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 100); echo "== latency kernels (${t}s)"
((t)) && timeout "$t" python3 benchmarks/latency_kernels.py --output "$R/latency_kernels.json" 2>&1 | tail -70
t=$(cap 270); echo "== MoE tiling sweep (${t}s)"
((t)) && timeout "$t" python3 benchmarks/moe_tiling_sweep.py --tokens 1 64 --jobs 14 \
  --output "$R/moe_tiling.json" 2>&1 | grep -v Warning | tail -30
t=$(cap 120); echo "== GEMV variants at one token (${t}s)"
((t)) && timeout "$t" python3 benchmarks/gemv_bench.py --tokens 1 --output "$R/gemv_bench.json" \
  2>&1 | tail -80
echo "== done in ${SECONDS}s"
