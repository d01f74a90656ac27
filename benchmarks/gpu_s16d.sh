#!/usr/bin/env bash
# Session 16, call 4 (~9 minutes): the gates after this session's changes, in one call:
# bench forward (bf16) at the decode and prefill gates, launches per layer
# (profile_forward.py), bench forward with FP8 linears + FP4 experts at batch 1 / 8 / 64 /
# 256, and bench decode at 1 and 64 requests next to transformers' decode step.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/gpu_s16d.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/device_env.sh"
start_call
t=$(cap 100); echo "== bench forward bf16 (${t}s)"
((t)) && forward_with "pass" "$R/forward_bf16.json" --iters 20 --warmup 3 \
  --batch decode:1@4096 --batch decode:8@4096 --batch decode:64@4096 --batch decode:256@4096 \
  --batch decode:64@65536 --batch prefill:2048 --batch prefill:8192
t=$(cap 60); echo "== launches per layer (${t}s)"
((t)) && timeout "$t" python3 benchmarks/profile_forward.py --batch decode:1@4096 \
  --batch decode:64@4096 --batch decode:256@4096 --output "$R/profile.json" 2>&1 \
  | grep "^=="
t=$(cap 80); echo "== bench forward, FP8 linears + FP4 experts (${t}s)"
((t)) && forward_with "pass" "$R/forward_fp4.json" --quantization fp8 --expert-dtype fp4 \
  --iters 20 --warmup 3 --batch decode:1@4096 --batch decode:8@4096 --batch decode:64@4096 \
  --batch decode:256@4096
decode_vs_transformers
echo "== done in ${SECONDS}s"
