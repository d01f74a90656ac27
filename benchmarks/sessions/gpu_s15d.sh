#!/usr/bin/env bash
# Session 15, call 4 (~3 minutes): issue 20's FP4 MoE with the inline-PTX nibble decoder
# (two weights per bf16x2 instruction pair) against the default, its GPU tests, and bench
# forward with FP4 experts; issue 13's prefill attention at two programs per SM (the output
# columns in two one-warpgroup programs, 16-row tiles: 112 KB of shared memory each).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s15d.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-300}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 60); echo "== GPU tests of the FP4 MoE (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m gpu tests/ops/test_fp4_moe.py -p no:cacheprovider \
  2>&1 | tail -3 | tee "$R/pytest_gpu.log"
t=$(cap 90); echo "== FP4 MoE at V4-Flash sizes (${t}s)"
((t)) && timeout "$t" python3 benchmarks/fp4_moe_sweep.py --tokens 1 64 256 \
  --variants asm asm_bn64 asm_bk256 --output "$R/fp4_moe_sweep.json" 2>&1 | grep -E "^T=|Error"
t=$(cap 70); echo "== prefill attention at 8192 queries, two programs per SM (${t}s)"
((t)) && timeout "$t" python3 benchmarks/prefill_bench.py --output "$R/prefill_attn.json" \
  --attention-only dv2_w4_bn16,dv2_w4_bn16_stages3 2>&1 | tail -8
echo "== done in ${SECONDS}s"
