#!/usr/bin/env bash
# Session 22, call 4 (~5 minutes): programmatic dependent launch ($RACKSERVE_PDL, i.e.
# common.PDL_ON) on / off for the eager prefill forward and the graph decode steps
# (alternating), and bench decode at 256 requests (issue 14: step minus forward <= 0.3 ms).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s22d.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-330}
source "$(dirname "$0")/../device_env.sh"
start_call
forward_ab nopdl 'pass' pdl 'import rackserve.ops.triton.common as c; c.PDL_ON = True' \
  --iters 10 --warmup 2 --batch prefill:2048 --batch prefill:8192 --batch decode:1@4096 \
  --batch decode:256@4096
rs=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
t=$(cap 170); echo "== model create (${t}s)"
((t)) && timeout "$t" "${rs[@]}" model create --preset v4-flash --layers 4 --experts 64 \
  --dtype bfloat16 --no-mtp --out /tmp/flash4 2>&1 | tail -1
for mode in sync async; do
  flag=(); [[ $mode == async ]] && flag=(--async-scheduling)
  t=$(cap 60); echo "== bench decode, 256 requests, $mode (${t}s)"
  ((t)) && timeout "$t" "${rs[@]}" bench decode --model /tmp/flash4 --concurrency 256 \
    --context 512 --steps 30 --warmup 5 --kv-cache-memory 16000000000 "${flag[@]}" \
    --output "$R/decode_256_$mode.json" 2>&1 | tail -1
done
ls "$R"; (cd "$OUT" && tar czf s22d.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
