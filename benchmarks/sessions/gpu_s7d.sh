#!/usr/bin/env bash
# Session 7's last device call (~6 minutes): the GPU tests of the speculation graphs and of
# the quantized path after the fixes from call 3 (fixed KV budget under -n 2; the fp8
# reference saturating on CUDA; the bf16 rule of the quantized kernel test), then the
# quantized kernels against tokens (quant_bench.py: FP8 GEMM, FP4 fused MoE vs bf16).
# Every file goes into $OUT/s7d.tgz, refreshed after each section.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s7d.sh      (BUDGET_S: total seconds)
set -uo pipefail
OUT=${OUT:-out/gpu}
R="$OUT/r"
mkdir -p "$R"
BUDGET_S=${BUDGET_S:-380}
source "$(dirname "$0")/../device_env.sh"
pack() { tar czf "$OUT/s7d.tgz" -C "$OUT" r; }
echo "commit ${RACKSERVE_COMMIT:-unknown}" | tee "$R/commit.txt"

t=$(cap 170); echo "== GPU tests: speculation graphs, quantized path (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -p no:cacheprovider -n 2 -rf -s \
  tests/spec_decode/test_spec_graphs_gpu.py tests/ops/test_kv_fp8.py tests/model/test_quant_gpu.py \
  -m "gpu or not gpu" 2>&1 | tee "$R/pytest_gpu.log" \
  | grep -E "passed|failed|FAILED|Error|bf16 vs fp32" | tail -30
pack

t=$(cap 200); echo "== quantized kernels vs tokens (${t}s)"
((t)) && timeout "$t" python3 benchmarks/quant_bench.py --output "$R/quant_bench.json" 2>&1 \
  | tail -60
pack
echo "== done in ${SECONDS}s"
