#!/usr/bin/env bash
# Session 15, call 5 (~7 minutes): issue 17's TTFT on the 43-layer checkpoint with seven
# repeats (session 14's call 4 had three: the prefill engine's TTFT moved by ~10 ms between
# runs), now that the prefill engine sends t1's answer before its KV export (9d19afb).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s15e.sh     (BUDGET_S: total seconds)
set -uo pipefail
LENGTHS=${LENGTHS:-1024,4096} REPEATS=${REPEATS:-7} BUDGET_S=${BUDGET_S:-560} \
  bash "$(dirname "$0")/gpu_s14a.sh"
