#!/usr/bin/env bash
# The shared expert beside the router at its default range (ops.SHARED_BESIDE_ROUTER_MIN /
# MAX_TOKENS: 2-128 tokens, from gpu_s28c.sh's A/B) against off, alternating, two passes,
# at the decode sizes it covers and the two gate sizes outside it (1, 256); then bench
# decode at 64 requests (async) against transformers' step from call 4 (72.14 ms).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s28d.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-300}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 60); echo "== graph replay tests (${t}s)"
((t)) && timeout "$t" "${pt[@]}" \
  "tests/model/test_gpu_fastpath.py::test_graph_replay_is_bit_identical_to_eager" \
  -k "shared or None" > "$R/pytest.log" 2>&1
grep -E "^E  |^FAILED|passed|failed" "$R/pytest.log" | head -6
forward_ab beside 'pass' off 'import rackserve.ops as o; o.SHARED_BESIDE_ROUTER_MAX_TOKENS = None' \
  --batch decode:1@4096 --batch decode:4@4096 --batch decode:16@4096 --batch decode:64@4096 \
  --batch decode:128@4096 --batch decode:256@4096 --iters 30 --warmup 5
flash4 120
t=$(cap 60); echo "== bench decode, 64 requests, async (${t}s)"
((t)) && [[ -d /tmp/flash4 ]] && timeout "$t" "${rs[@]}" bench decode --model /tmp/flash4 \
  --concurrency 64 --context 512 --steps 30 --warmup 5 --kv-cache-memory 8000000000 \
  --output "$R/decode_64_async.json" 2>&1 | tail -1
ls "$R"; (cd "$OUT" && tar czf s28d.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
