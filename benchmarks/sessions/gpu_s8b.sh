#!/usr/bin/env bash
# Session 8's second device call (~9.5 minutes), issue 20, after the 16-byte packed loads:
# the dot_scaled variant's GPU test, the FP4 fused MoE sweep at V4-Flash sizes, then
# gpu_quant.sh's quant_bench (FP8 GEMM, FP4 MoE vs tokens), bench forward with FP8 linears
# and FP4 experts, and the same forward in bf16.
# Every file goes into $OUT/s8b.tgz, refreshed after each section.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s8b.sh      (BUDGET_S: total seconds)
set -uo pipefail
OUT=${OUT:-out/gpu}
R="$OUT/r"
mkdir -p "$R"
BUDGET_S=${BUDGET_S:-570}
source "$(dirname "$0")/../device_env.sh"
pack() { tar czf "$OUT/s8b.tgz" -C "$OUT" r; }
echo "commit ${RACKSERVE_COMMIT:-unknown}" | tee "$R/commit.txt"

t=$(cap 60); echo "== dot_scaled FP4 MoE vs the reference (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -p no:cacheprovider -m gpu -rf -k dot_scaled \
  tests/ops/test_fp4_moe.py 2>&1 | tee "$R/pytest_dot_scaled.log" | tail -5
pack

t=$(cap 150); echo "== FP4 MoE sweep (${t}s)"
((t)) && timeout "$t" python3 benchmarks/fp4_moe_sweep.py --output "$R/fp4_sweep.json" 2>&1 \
  | tail -50
pack

t=$(cap 400); echo "== quantized kernels vs tokens, bench forward FP8 + FP4, bf16 (${t}s)"
((t)) && OUT="$R/quant" SECTIONS="quant_bench forward_fp4 forward_bf16" timeout "$t" \
  bash benchmarks/gpu_quant.sh 2>&1 | grep -vE "^\{" | tail -40
pack
echo "== done in ${SECONDS}s"
