#!/usr/bin/env bash
# Prepared in session 37 for the next session's call. On an H200 with 450 s: every gate
# (gpu_gates.sh; the gate figures are still session 28's). Elsewhere: where a speculative
# step's time goes, bench decode --profile (the device timeline and host phases of each
# step, kernel_timeline.py and engine/step_phases.py) of no speculation (first: it pays the
# Triton compile), MTP K = 3 and K = 1 at 32 requests, v4-flash 4 layers 64 experts with
# its MTP layer (session 37 call 1: K = 3 steps 13.78 ms around a 6.14 ms verify forward;
# call 2: K = 1 9.49 ms around 5.95, 2.3 ms of each step with no kernel running); then
# bench forward's gate cases if 150 s are left. Both: the speculation graphs' GPU test (the
# verify graphs now take the metadata kernels, GraphMetadata) into $OUT/spec_gpu.log.
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s38.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-540}
spec_gpu_tests() {  # the verify graphs' metadata kernels (session 37): graphs equal eager
  local t=$1
  echo "== pytest: speculation graphs, verify metadata (${t}s)"
  timeout "$t" "${pt[@]}" tests/spec_decode/test_spec_graphs_gpu.py \
    tests/runner/test_graph_launches.py -k "gpu or verify_step" > "$OUT/spec_gpu.log" 2>&1
  tail -2 "$OUT/spec_gpu.log"
}
if ((BUDGET_S >= 450)) && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  BUDGET_S=$((BUDGET_S - 100)) bash "$(dirname "$0")/../gpu_gates.sh"
  source "$(dirname "$0")/../device_env.sh"
  spec_gpu_tests 90
  exit 0
fi
source "$(dirname "$0")/../device_env.sh"
start_call
spec_gpu_tests 120
MODEL=/tmp/flash4mtp
t=$(cap 90); echo "== model create, MTP layer (${t}s)"
((t)) && timeout "$t" "${rs[@]}" model create --preset v4-flash --layers 4 --experts 64 \
  --dtype bfloat16 --out "$MODEL" 2>&1 | tail -1
decode_profile plain 120
decode_profile mtp_k3 90 '{"method": "mtp", "num_speculative_tokens": 3}'
decode_profile mtp_k1 90 '{"method": "mtp", "num_speculative_tokens": 1}'
(( BUDGET_S - SECONDS > 150 )) && forward_gates
ls "$R"; (cd "$OUT" && tar czf s38.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
