#!/usr/bin/env bash
# Session 38's fourth call (H100 or H200 alike). The speculation GPU tests at this commit
# (the proposal's device time now by a StepTimer, which the drafts' read-back waits on),
# then bench decode on v4-flash 4 layers 64 experts with its MTP layer (random weights:
# nothing accepted): at 32 requests MTP K = 1 with --profile (the drafter's device time now
# in the record, median_propose_ms, and the host time left exposed,
# median_step_minus_device_ms; call 3 at 81babf2: 7.46 ms a step around a 5.61 ms verify),
# then at 1 request no speculation, MTP K = 1 and K = 3 (latency: the step's host work
# against a short forward).
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s38d.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-400}
source "$(dirname "$0")/../device_env.sh"
start_call
MODEL=/tmp/flash4mtp
one_request() {  # bench decode at 1 request, context 1024: $1 name, $2 limit, $3 spec
  local name=$1 t
  t=$(cap "$2"); echo "== bench decode, $name x1 (${t}s)"
  ((t)) && [[ -d $MODEL ]] && timeout "$t" "${rs[@]}" bench decode --model "$MODEL" \
    --concurrency 1 --context 1024 --steps 30 --warmup 5 --kv-cache-memory 8000000000 \
    ${3:+--speculative-config "$3"} --output "$R/decode_${name}_x1.json" 2>&1 \
    | grep -E "^decode|Error"
}
t=$(cap 110); echo "== pytest: speculation graphs (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/spec_decode/test_spec_graphs_gpu.py \
  > "$OUT/gpu_tests.log" 2>&1
tail -2 "$OUT/gpu_tests.log"
t=$(cap 70); echo "== model create, MTP layer (${t}s)"
((t)) && timeout "$t" "${rs[@]}" model create --preset v4-flash --layers 4 --experts 64 \
  --dtype bfloat16 --out "$MODEL" 2>&1 | tail -1
decode_profile mtp_k1 90 '{"method": "mtp", "num_speculative_tokens": 1}'
one_request plain 50
one_request mtp_k1 50 '{"method": "mtp", "num_speculative_tokens": 1}'
one_request mtp_k3 50 '{"method": "mtp", "num_speculative_tokens": 3}'
ls "$R"; (cd "$OUT" && tar czf s38d.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
