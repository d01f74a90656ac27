#!/usr/bin/env bash
# Prepared in session 41 for the next H200: the graph replay timelines, kernel by kernel
# (graph_gap.py; the H200's last was session 24's), of decode:1@4096 and of decode:64@512
# (bench decode's 64-request shape), then where the synchronous
# engine's 0.70 ms of host time a step goes at 1 request (session 41, call 5: bench decode's
# sync step 1.99 ms against a 1.28 ms forward; data/expert-parallel deployments run
# synchronously): bench decode --profile, its host phases per step.
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s42.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-300}
source "$(dirname "$0")/../device_env.sh"
start_call
replay_timelines 150 "$R/graph_gap.json" decode:1@4096 decode:64@512
flash4 170
t=$(cap 90); echo "== bench decode --profile, 1 request, sync (${t}s)"
((t)) && [[ -d /tmp/flash4 ]] && timeout "$t" "${rs[@]}" bench decode --model /tmp/flash4 \
  --concurrency 1 --context 512 --steps 30 --warmup 5 --kv-cache-memory 8000000000 \
  --no-async-scheduling --profile "$R/profile_sync_x1.txt" \
  --output "$R/decode_1_sync.json" 2>&1 | grep -E "^decode|Error"
[[ -f $R/profile_sync_x1.txt ]] && sed -n '/== device timeline/,$p' "$R/profile_sync_x1.txt" | head -14
(cd "$OUT" && tar czf s42.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
