#!/usr/bin/env bash
# Session 15, call 6 (~2 minutes): issue 20's FP4 experts through the inline-PTX decoder by
# default (decode and middle-sized blocks): its GPU tests, then bench forward of the
# v4-flash preset (4 layers, 64 experts) with FP8 linears and FP4 experts at the decode
# gates (session 8: 1.607 / 5.675 / 8.174 ms at decode:1 / 64 / 256 @4096).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/gpu_s15f.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-200}
source "$(dirname "$0")/device_env.sh"
start_call
t=$(cap 50); echo "== GPU tests of the FP4 MoE (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m gpu tests/ops/test_fp4_moe.py -p no:cacheprovider \
  2>&1 | tail -2 | tee "$R/pytest_gpu.log"
t=$(cap 140); echo "== bench forward, FP8 linears + FP4 experts (${t}s)"
((t)) && forward_with "pass" "$R/forward_fp4.json" --quantization fp8 --expert-dtype fp4 \
  --iters 20 --warmup 3 --batch decode:1@4096 --batch decode:64@4096 --batch decode:256@4096
echo "== done in ${SECONDS}s"
