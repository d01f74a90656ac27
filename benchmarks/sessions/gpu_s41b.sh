#!/usr/bin/env bash
# Session 41, call 2: the decode:1 graph step's stage line by line, the device idle and busy
# (sessions/s41_stage_lines.py), PinnedStaging's tests on the GPU; then, on an H200 only, gpu_s41.sh with what is left.
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s41b.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 90); echo "== the stage, line by line (${t}s)"
((t)) && PYTHONPATH=$PYTHONPATH:$PWD/benchmarks/sessions timeout "$t" \
  python3 benchmarks/sessions/s41_stage_lines.py | tee "$R/stage_lines.jsonl"
t=$(cap 60); echo "== pytest: PinnedStaging on the GPU (${t}s)"
((t)) && timeout "$t" "${pt[@]}" -v tests/runner/test_pinned_staging.py > "$R/staging_tests.log" 2>&1
grep -cE "PASSED" "$R/staging_tests.log"; grep -E "FAILED|ERROR|passed|failed" "$R/staging_tests.log" | tail -3
(cd "$OUT" && tar czf s41b.tgz r && rm -rf r)
left=$((BUDGET_S - SECONDS))
if ((left >= 150)) && grep -q H200 <(nvidia-smi --query-gpu=name --format=csv,noheader); then
  BUDGET_S=$left bash "$(dirname "$0")/gpu_s41.sh"
fi
echo "== done in ${SECONDS}s"
