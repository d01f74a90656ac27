#!/usr/bin/env bash
# Session 13, call 3 (~5 minutes): the decode gates next to transformers in one call, now
# with --async-scheduling as the gates were measured in sessions 6 and 8 (call 1 ran the
# synchronous engine only: 14.1x at 64 requests).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s13c.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-420}
source "$(dirname "$0")/../device_env.sh"
start_call
decode_vs_transformers
tar czf "$OUT/s13c.tgz" -C "$OUT" r
echo "== done in ${SECONDS}s"
