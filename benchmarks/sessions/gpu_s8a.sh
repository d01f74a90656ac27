#!/usr/bin/env bash
# Session 8's first device call (~9 minutes), issue 20: the FP4 fused MoE sweep at V4-Flash
# sizes (tilings, the fp16-bits decoder, the prefetch, tl.dot_scaled), the dot_scaled
# variant's GPU test against the reference, then gpu_quant.sh's second half (bench forward
# with --kv-cache-dtype fp8; the fp8-KV kernels and the model's logit error).
# Every file goes into $OUT/s8a.tgz, refreshed after each section.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s8a.sh      (BUDGET_S: total seconds)
set -uo pipefail
OUT=${OUT:-out/gpu}
R="$OUT/r"
mkdir -p "$R"
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/../device_env.sh"
pack() { tar czf "$OUT/s8a.tgz" -C "$OUT" r; }
echo "commit ${RACKSERVE_COMMIT:-unknown}" | tee "$R/commit.txt"

t=$(cap 60); echo "== dot_scaled FP4 MoE vs the reference (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -p no:cacheprovider -m gpu -rf -k dot_scaled \
  tests/ops/test_fp4_moe.py 2>&1 | tee "$R/pytest_dot_scaled.log" | tail -5
pack

t=$(cap 230); echo "== FP4 MoE sweep (${t}s)"
((t)) && timeout "$t" python3 benchmarks/fp4_moe_sweep.py --output "$R/fp4_sweep.json" 2>&1 \
  | tail -50
pack

t=$(cap 250); echo "== fp8 KV: forward and kernels (${t}s)"
((t)) && OUT="$R/quant" SECTIONS="kv_forward kv_bench" timeout "$t" \
  bash benchmarks/gpu_quant.sh 2>&1 | tail -40
pack
echo "== done in ${SECONDS}s"
