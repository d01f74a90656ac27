#!/usr/bin/env bash
# The decode MoE's shared expert on a side stream beside the router, the route + align and
# the routed experts (ops.SHARED_BESIDE_ROUTER_MAX_TOKENS, session 28; at T = 1 the router's
# logits and the route + align program are ~15 us a layer of latency-bound work while HBM
# idles): its GPU tests (the kernels' bitwise test on the GPU, graph replay against eager),
# then bench forward A/B at the decode gates, two passes.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s28c.sh     (BUDGET_S: total seconds)
# (From 76e1c8e the defaults take it from 2 to 128 tokens; the A/B sets 1-256, as call 3 ran.)
set -uo pipefail
BUDGET_S=${BUDGET_S:-300}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 90); echo "== GPU tests (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/ops/test_moe_routed.py \
  "tests/model/test_gpu_fastpath.py::test_graph_replay_is_bit_identical_to_eager" \
  -k "beside or shared" > "$R/pytest.log" 2>&1
grep -E "^E  |^FAILED|passed|failed" "$R/pytest.log" | head -6
forward_ab default 'pass' shared_beside 'import rackserve.ops as o; o.SHARED_BESIDE_ROUTER_MIN_TOKENS = 1; o.SHARED_BESIDE_ROUTER_MAX_TOKENS = 256' \
  --batch decode:1@4096 --batch decode:4@4096 --batch decode:64@4096 --batch decode:256@4096 \
  --iters 30 --warmup 5
ls "$R"; (cd "$OUT" && tar czf s28c.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
