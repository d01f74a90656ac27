#!/usr/bin/env bash
# Session 34's one call, when machines are scarce: on an H200 every gate (gpu_gates.sh: the
# gates are set on that card); on any other card the A/B of session 33's untimed changes
# and the prepared arms (gpu_s34a.sh), which any card answers.
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s34.sh
set -uo pipefail
here=$(dirname "$0")
if nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H200; then
  exec bash "$here/../gpu_gates.sh"
fi
exec bash "$here/gpu_s34a.sh"
