#!/usr/bin/env bash
# Session 27, call 2 (~5 minutes): where decode:256 and decode:1 spend their replay with
# session 26's defaults (graph_gap.py, kernel by kernel: the next lever for decode:256's
# last few percent), then the engine sized by --gpu-memory-utilization, whose graphs held
# 1.03 GiB against a 0.46 GiB reserve before 6b771d0 (warm-ups on one stream, their cache
# emptied; session 26's budget ran out during the capture that would have measured it).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/gpu_s27b.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-330}
source "$(dirname "$0")/device_env.sh"
start_call
rs=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
t=$(cap 100); echo "== graph_gap (${t}s)"
((t)) && timeout "$t" python3 benchmarks/graph_gap.py --batch decode:1@4096 \
  --batch decode:256@4096 --output "$R/graph_gap.json" 2>&1 | tail -30
t=$(cap 100); echo "== model create (${t}s)"
[[ -d /tmp/flash4 ]] || { ((t)) && timeout "$t" "${rs[@]}" model create --preset v4-flash \
  --layers 4 --experts 64 --dtype bfloat16 --no-mtp --out /tmp/flash4 2>&1 | tail -1; }
t=$(cap 90); echo "== bench decode sized by --gpu-memory-utilization (${t}s)"
((t)) && [[ -d /tmp/flash4 ]] && timeout "$t" "${rs[@]}" bench decode --model /tmp/flash4 \
  --concurrency 64 --context 512 --steps 20 --warmup 5 --output "$R/decode_64_budget.json" \
  > "$R/decode_64_budget.log" 2>&1
grep -E "memory:|CUDA graphs|KV cache|decode x|Error" "$R/decode_64_budget.log" | head -8
ls "$R"; (cd "$OUT" && tar czf s27b.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
