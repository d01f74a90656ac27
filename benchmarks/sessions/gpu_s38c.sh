#!/usr/bin/env bash
# Session 38's third call. On an H200 with 450 s: every gate but the accuracy part first
# (gpu_gates.sh; the H200 figures are still session 28's), then the speculation profiles
# with what is left. Elsewhere: the GPU tests of the drafts left on the device (the
# proposal graphs staged behind the verify, their drafts fed into the next verify's input
# ids and read back behind it: test_spec_graphs_gpu.py, greedy and seeded) and of the
# pinned staging, then bench decode --profile at 32 requests (context 1024, v4-flash 4
# layers 64 experts with its MTP layer) of no speculation, MTP K = 3 and K = 1, with each
# step's idle time split by host phase. Before (H100): call 1 (0691ed7) K = 3 12.76 ms,
# K = 1 9.64 ms (2.4 ms idle a step), plain 5.31; call 2 (423bdde) 12.87, 9.56, 5.29.
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s38c.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-480}
profiles() {
  MODEL=/tmp/flash4mtp
  local t
  t=$(cap 90); echo "== model create, MTP layer (${t}s)"
  ((t)) && timeout "$t" "${rs[@]}" model create --preset v4-flash --layers 4 --experts 64 \
    --dtype bfloat16 --out "$MODEL" 2>&1 | tail -1
  decode_profile plain 120
  decode_profile mtp_k3 90 '{"method": "mtp", "num_speculative_tokens": 3}'
  decode_profile mtp_k1 90 '{"method": "mtp", "num_speculative_tokens": 1}'
}
if ((BUDGET_S >= 450)) && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  BUDGET_S=$((BUDGET_S - 150)) PARTS="forward decode tests" \
    bash "$(dirname "$0")/../gpu_gates.sh"
  source "$(dirname "$0")/../device_env.sh"
  R="$OUT/r2"; mkdir -p "$R"
  profiles
  (cd "$OUT" && tar czf s38c.tgz r2 && rm -rf r2)
  exit 0
fi
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 150); echo "== pytest: speculation graphs on the device route, pinned staging (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/spec_decode/test_spec_graphs_gpu.py \
  tests/runner/test_pinned_staging.py > "$OUT/gpu_tests.log" 2>&1
tail -2 "$OUT/gpu_tests.log"
profiles
ls "$R"; (cd "$OUT" && tar czf s38c.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
