#!/usr/bin/env bash
# Session 34's one call, when machines are scarce: on an H200 every gate (gpu_gates.sh: the
# gates are set on that card; below 450 s of budget the forward gates, then gpu_s34b.sh);
# on any other card the A/B of session 33's untimed changes
# and the prepared arms (gpu_s34a.sh; gpu_s34b.sh, its short cut, below 450 s of budget),
# which any card answers.
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s34.sh
set -uo pipefail
here=$(dirname "$0")
budget=${BUDGET_S:-560}
if nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -q H200; then
  if ((budget >= 450)); then
    exec bash "$here/../gpu_gates.sh"
  fi
  # short: the forward gates, then the short A/B with what is left
  BUDGET_S=150 PARTS="forward" bash "$here/../gpu_gates.sh"
  BUDGET_S=$((budget - SECONDS - 10)) exec bash "$here/gpu_s34b.sh"
fi
if ((budget < 450)); then
  exec bash "$here/gpu_s34b.sh"
fi
exec bash "$here/gpu_s34a.sh"
