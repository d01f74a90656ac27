#!/usr/bin/env bash
# Session 27, call 2 (~5 minutes): where decode:256 and decode:1 spend their replay with
# session 26's defaults (graph_gap.py, kernel by kernel: the next lever for decode:256's
# last few percent), then the engine sized by --gpu-memory-utilization, whose graphs held
# 1.03 GiB against a 0.46 GiB reserve before 6b771d0 (warm-ups on one stream, their cache
# emptied; session 26's budget ran out during the capture that would have measured it).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s27b.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-330}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 100); echo "== graph_gap (${t}s)"
((t)) && timeout "$t" python3 benchmarks/graph_gap.py --batch decode:1@4096 \
  --batch decode:256@4096 --output "$R/graph_gap.json" 2>&1 | tail -30
flash4 100
decode_sized_by_utilization 90
ls "$R"; (cd "$OUT" && tar czf s27b.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
