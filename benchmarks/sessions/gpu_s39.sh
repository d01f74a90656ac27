#!/usr/bin/env bash
# Prepared in session 38 for the next session's call. On an H200 with 450 s: every gate but
# the accuracy part first (gpu_gates.sh; the H200 figures are still session 28's), then the
# speculation runs below with what is left. Elsewhere, the speculation work of session 38
# that no GPU has run yet:
#   - the GPU tests of the speculation graphs (the drafts left on the device, fed into the
#     next verify's inputs; call 4 of session 38 cut them at 110 s on a cold Triton cache)
#     and of `model create --device cuda`;
#   - the MTP checkpoint drawn on the GPU (flash4mtp; on the CPU it took 70-90 s);
#   - bench decode at 32 requests, MTP K = 1 and K = 3, whose records now carry the
#     drafter's device time (median_propose_ms) and the host time left exposed
#     (median_step_minus_device_ms); session 38 call 3 (81babf2): K = 1 7.46 ms a step around
#     a 5.61 ms verify, K = 3 11.08 around 5.77;
#   - bench decode at 1 request: no speculation, MTP K = 1 and K = 3 (never measured).
# Session 39 added: StepBuffers and the feeds staged through device.PinnedStaging (its GPU
# tests, the captured-sampling tests, bench forward decode:1 and decode:64 for a regression).
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s39.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-540}
speculation() {
  local t
  t=$(cap 90); echo "== pytest: the steps' inputs through PinnedStaging (${t}s)"
  ((t)) && timeout "$t" "${pt[@]}" tests/runner/test_pinned_staging.py \
    tests/runner/test_graph_sampling.py > "$R/staging_tests.log" 2>&1
  tail -2 "$R/staging_tests.log"
  t=$(cap 60); echo "== bench forward decode:1, decode:64 (${t}s)"
  ((t)) && forward_with 'pass' "$R/forward_decode.json" --iters 20 --warmup 3 \
    --batch decode:1@4096 --batch decode:64@4096
  t=$(cap 170); echo "== pytest: speculation graphs, model create on the GPU (${t}s)"
  ((t)) && timeout "$t" "${pt[@]}" tests/spec_decode/test_spec_graphs_gpu.py \
    tests/model/test_create.py -k "gpu or device" > "$R/gpu_tests.log" 2>&1
  tail -2 "$R/gpu_tests.log"
  local start=$SECONDS
  flash4mtp 120
  echo "model create --device cuda: $((SECONDS - start)) s"
  MODEL=/tmp/flash4mtp
  for k in 1 3; do
    t=$(cap 70); echo "== bench decode, MTP K = $k x32 (${t}s)"
    ((t)) && timeout "$t" "${rs[@]}" bench decode --model "$MODEL" --concurrency 32 \
      --context 1024 --steps 20 --warmup 5 --kv-cache-memory 8000000000 \
      --speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": $k}" \
      --output "$R/decode_mtp_k${k}_x32.json" 2>&1 | grep -E "^decode|Error"
  done
  for k in 0 1 3; do
    local spec=()
    ((k)) && spec=(--speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": $k}")
    t=$(cap 50); echo "== bench decode, MTP K = $k x1 (${t}s)"
    ((t)) && timeout "$t" "${rs[@]}" bench decode --model "$MODEL" --concurrency 1 \
      --context 1024 --steps 30 --warmup 5 --kv-cache-memory 8000000000 "${spec[@]}" \
      --output "$R/decode_mtp_k${k}_x1.json" 2>&1 | grep -E "^decode|Error"
  done
}
if ((BUDGET_S >= 450)) && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  BUDGET_S=$((BUDGET_S - 200)) PARTS="forward decode tests" \
    bash "$(dirname "$0")/../gpu_gates.sh"
  source "$(dirname "$0")/../device_env.sh"
  R="$OUT/r2"; mkdir -p "$R"
  speculation
  (cd "$OUT" && tar czf s39.tgz r2 && rm -rf r2)
  exit 0
fi
source "$(dirname "$0")/../device_env.sh"
start_call
speculation
ls "$R"; (cd "$OUT" && tar czf s39.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
