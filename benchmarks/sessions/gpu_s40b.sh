#!/usr/bin/env bash
# Session 40, calls 2 and 3: call 1 measured decode:1 1.637 ms isolated through PinnedStaging against
# 1.442 with the old staging (back to back 1.410 / 1.411): the host time of the upload alone
# and of the graph step, both arms alternating (sessions/s40_upload_host.py).
# Usage: [SCRIPT=s40_stage_host] RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s40b.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-150}
source "$(dirname "$0")/../device_env.sh"
start_call
export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks/sessions
t=$(cap 120); echo "== upload and graph step host time (${t}s)"
((t)) && timeout "$t" python3 benchmarks/sessions/${SCRIPT:-s40_upload_host}.py | tee "$R/${SCRIPT:-s40_upload_host}.jsonl"
(cd "$OUT" && tar czf s40b.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
