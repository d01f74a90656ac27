#!/usr/bin/env bash
# Session 40, call 5: the lean staging's host time against its copy events off and the old
# staging (sessions/s40_stage_host.py), then, on an H200 only, the forward gates
# (gpu_gates.sh PARTS=forward; the H200 figures are still session 28's).
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s40c.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-220}
SCRIPT=s40_stage_host BUDGET_S=70 bash "$(dirname "$0")/gpu_s40b.sh"
left=$((BUDGET_S - SECONDS))
if ((left >= 100)) && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  BUDGET_S=$left PARTS="forward" bash "$(dirname "$0")/../gpu_gates.sh"
fi
echo "== done in ${SECONDS}s"
