#!/usr/bin/env bash
# Prepared in session 17 for the next one (~9 minutes): what session 17 changed and could
# not measure. The GPU tests of the FP4 stacked h and of the fp32 logits, then issue 12's
# teacher-forced gate (the lm_head now writes fp32 logits); the FP4 fused MoE with stacked h
# against the inline-PTX default (fp4_moe_sweep.py) and bench forward FP8 + FP4 with it on;
# bench decode against transformers (issue 14's ratios after the stacked bf16 h).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s18a.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-580}
source "$(dirname "$0")/../device_env.sh"
start_call
FP4_STACK='import rackserve.ops.triton.fused_moe_fp4 as f4
override(f4, "default_tiling", stack_h=True)'
t=$(cap 100); echo "== GPU tests: FP4 stacked h, fp32 logits (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m gpu tests/ops/test_fp4_moe.py tests/ops/test_gemv.py \
  -k "stacked or logits" -p no:cacheprovider -rf > "$R/pytest_gpu.log" 2>&1; tail -4 "$R/pytest_gpu.log"
t=$(cap 120); echo "== teacher-forced gate (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m gpu tests/model/test_gpu_fastpath.py -k teacher_forced \
  -p no:cacheprovider -rf -s > "$R/pytest_teacher.log" 2>&1; tail -8 "$R/pytest_teacher.log"
t=$(cap 90); echo "== FP4 MoE, stacked h (${t}s)"
((t)) && timeout "$t" python3 benchmarks/fp4_moe_sweep.py --tokens 1 64 256 \
  --variants asm asm_stack asm_stack_bn64 --output "$R/fp4_moe_sweep.json" 2>&1 | tail -12
t=$(cap 60); echo "== bench forward FP8 + FP4, stacked h (${t}s)"
((t)) && forward_with "$FP4_STACK" "$R/forward_fp4_stack.json" --quantization fp8 \
  --expert-dtype fp4 --iters 20 --warmup 3 --batch decode:1@4096 --batch decode:8@4096 \
  --batch decode:64@4096 --batch decode:256@4096
decode_vs_transformers
echo "== done in ${SECONDS}s"
