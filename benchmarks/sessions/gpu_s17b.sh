#!/usr/bin/env bash
# Session 17, call 2 (~9 minutes, right after call 1): the mHC pre and post-pre variants at
# 64 and 256 tokens (latency_kernels.py); the fused MoE's down kernel alone at T = 256 with
# 16- and 32-row blocks, h split in registers or stacked (moe_tiling_sweep.py); issue 20's
# FP4 experts at batch 8 next to bf16 (bench forward).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s17b.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-540}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 150); echo "== mHC pre and post-pre variants (${t}s)"
((t)) && timeout "$t" python3 benchmarks/latency_kernels.py --parts hc post align --tokens 64 256 \
  --output "$R/latency_kernels.json" > "$R/latency_kernels.txt" 2>&1; grep -c us "$R/latency_kernels.txt"
t=$(cap 120); echo "== MoE down kernel sweep, T = 256 (${t}s)"
((t)) && timeout "$t" python3 benchmarks/moe_tiling_sweep.py --tokens 256 --block-m 32 16 \
  --stack-h 0 1 --kernels down --jobs 15 --output "$R/moe_tiling.json" 2>&1 | grep -v Warning | tail -30
t=$(cap 80); echo "== MoE down kernel sweep, T = 1, 64, stacked h (${t}s)"
((t)) && timeout "$t" python3 benchmarks/moe_tiling_sweep.py --tokens 1 64 --stack-h 1 \
  --kernels down --jobs 15 --output "$R/moe_tiling_small.json" 2>&1 | grep -v Warning | tail -16
t=$(cap 150); echo "== bench forward, bf16 and FP8 linears + FP4 experts at decode:8 (${t}s)"
((t)) && forward_with "pass" "$R/forward_bf16_8.json" --iters 20 --warmup 3 --batch decode:8@4096
((t)) && forward_with "pass" "$R/forward_fp4_8.json" --quantization fp8 --expert-dtype fp4 \
  --iters 20 --warmup 3 --batch decode:8@4096
echo "== done in ${SECONDS}s"
