#!/usr/bin/env bash
# Session 7's third device call (~9 minutes): the short speculative-decoding call after the
# whole-proposal graphs (MTP and draft model; gpu_spec_short.sh), then the GPU tests of
# the speculation graphs and of the quantized path after the fp8 `widen` and loader fixes.
# Every file goes into $OUT/s7c.tgz, refreshed after each section.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s7c.sh      (BUDGET_S: total seconds)
set -uo pipefail
OUT=${OUT:-out/gpu}
R="$OUT/r"
mkdir -p "$R"
BUDGET_S=${BUDGET_S:-570}
source "$(dirname "$0")/../device_env.sh"
pack() { tar czf "$OUT/s7c.tgz" -C "$OUT" r; }
echo "commit ${RACKSERVE_COMMIT:-unknown}" | tee "$R/commit.txt"

echo "== speculative decoding"
OUT="$R" BUDGET_S=330 bash "$(dirname "$0")/../gpu_spec_short.sh" 2>&1 | grep -E "^==|^decode|Error"
pack

t=$(cap 230); echo "== GPU tests: speculation graphs, quantized path (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -p no:cacheprovider -n 2 -rf \
  tests/spec_decode/test_spec_graphs_gpu.py tests/ops/test_kv_fp8.py tests/model/test_quant_gpu.py \
  -m "gpu or not gpu" 2>&1 | tee "$R/pytest_gpu.log" | grep -E "passed|failed|FAILED|Error" | tail -30
pack
echo "== done in ${SECONDS}s"
