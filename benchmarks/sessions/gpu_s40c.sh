#!/usr/bin/env bash
# Session 40, call 5 (not run: no machine; for session 41): the lean staging's host time
# against its copy events off and the old staging (sessions/s40_stage_host.py), its GPU tests,
# then, on an H200 only, the gates with what is left (gpu_gates.sh, PARTS="forward decode
# tests": the H200 figures are still session 28's). On an H100 it ends after ~60 s.
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s40c.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}
SCRIPT=s40_stage_host BUDGET_S=70 bash "$(dirname "$0")/gpu_s40b.sh"
source "$(dirname "$0")/../device_env.sh"
echo "== pytest: PinnedStaging and the captured sampling fed from it"
mkdir -p "$OUT/s40c"
timeout 60 "${pt[@]}" tests/runner/test_pinned_staging.py tests/runner/test_graph_sampling.py \
  > "$OUT/s40c/staging_tests.log" 2>&1
tail -1 "$OUT/s40c/staging_tests.log"
left=$((BUDGET_S - SECONDS))
if ((left >= 100)) && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  BUDGET_S=$left PARTS="forward decode tests" bash "$(dirname "$0")/../gpu_gates.sh"
fi
echo "== done in ${SECONDS}s"
