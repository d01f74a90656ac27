#!/usr/bin/env bash
# Session 19, call 4 (~3 minutes): what call 3's step limit cut. The graph replay's bit
# equality at 256 requests with the new down-kernel grid, and the FP4 MoE's GPU tests with
# its new default.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s19d.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-300}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 150); echo "== GPU tests: graph replay at 256, FP4 MoE (${t}s)"
((t)) && timeout "$t" python3 -m pytest -v -m gpu tests/model/test_gpu_fastpath.py \
  tests/ops/test_fp4_moe.py -k "graph_replay or stacked or dot_scaled or asm" \
  -p no:cacheprovider -rf > "$R/pytest.log" 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed" "$R/pytest.log" | tail -20
(cd "$OUT" && tar czf s19d.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
