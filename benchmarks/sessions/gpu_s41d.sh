#!/usr/bin/env bash
# Session 41, call 6: decode:1@4096's graph replay timeline, kernel by kernel (graph_gap.py),
# at the commit whose gates call 5 ran (the H200's last timeline was session 24's).
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s41d.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-200}
source "$(dirname "$0")/../device_env.sh"
start_call
replay_timelines 150 "$R/graph_gap.json" decode:1@4096
(cd "$OUT" && tar czf s41d.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
