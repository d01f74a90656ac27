#!/usr/bin/env bash
# Session 45, for an H200 (the gates' card; its last gate run was session 41's): every gate
# of issues 13 and 14 (the bf16 accuracy gates and bench forward), bench decode against
# transformers on the same checkpoint in the same call, then the decode:1@4096 graph replay
# timeline (the H200's last one is session 24's).
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s45.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/../device_env.sh"
start_call
forward_gates
decode_vs_transformers
replay_timelines 90 "$R/graph_gap.json" decode:1@4096
accuracy_gates
echo "== the gates"
python3 benchmarks/gates.py "$R" --output "$R/gates.json"
(cd "$OUT" && tar czf s45.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
