#!/usr/bin/env bash
# Session 37's second call (~450 s of budget). On an H200: the forward and decode gates
# (gpu_gates.sh, PARTS="forward decode": the gate figures are still session 28's). Elsewhere
# (an H100 ran every forward gate in call 1): where a speculative step leaves the device
# idle, bench decode --profile with its per-step device timeline (kernel_timeline.py) of MTP
# K = 3 and K = 1 against no speculation at 32 requests, v4-flash 4 layers 64 experts with
# its MTP layer (call 1: K = 3 steps 13.78 ms around a 6.14 ms verify forward).
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s37.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-420}
if ((BUDGET_S >= 380)) && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  PARTS="forward decode" exec bash "$(dirname "$0")/../gpu_gates.sh"
fi
source "$(dirname "$0")/../device_env.sh"
start_call
MODEL=/tmp/flash4mtp
t=$(cap 90); echo "== model create, MTP layer (${t}s)"
((t)) && timeout "$t" "${rs[@]}" model create --preset v4-flash --layers 4 --experts 64 \
  --dtype bfloat16 --out "$MODEL" 2>&1 | tail -1
decode_profile mtp_k3 75 '{"method": "mtp", "num_speculative_tokens": 3}'
decode_profile plain 75
decode_profile mtp_k1 75 '{"method": "mtp", "num_speculative_tokens": 1}'
ls "$R"; (cd "$OUT" && tar czf s37.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
