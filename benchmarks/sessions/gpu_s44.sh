#!/usr/bin/env bash
# Session 44: the wgmma prefill attention with every WgmmaTiling switch on by default
# (session 43's H100 call: 18% off both layers' attention at 8192 queries). By priority: the
# GPU tests (the raw-q test now compares like tilings), every gate's bench forward with the
# new defaults, the attention at 8192 queries with all switches but one (which switch to
# drop), then 32- against 64-row tiles at 2048 queries and after 65,536 cached tokens (which
# tiling the HCA layer takes).
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s44.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-480}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 90); echo "== GPU tests: the wgmma prefill attention (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/ops/test_prefill_attn_wgmma.py -k "not compiles" \
  > "$R/wgmma_tests.log" 2>&1
tail -3 "$R/wgmma_tests.log"
forward_gates
v=bn32_s4_p2_all,bn64_s2_p1_all
for s in async_q early_slots staged_out column_sums max_exchange span_reduce reuse_scores; do
  v=$v,bn64_s2_p1_all_no_$s
done
t=$(cap 150); echo "== prefill_bench attention, 8192 queries: all but one (${t}s)"
((t)) && timeout "$t" python3 benchmarks/prefill_bench.py --attention-only "$v" \
  --cases 8192:0 --output "$R/attention.json" 2>&1 | grep -v "^moe\|^idx" | tail -24
t=$(cap 110); echo "== prefill_bench attention, 2048 queries and 8192 after 65536 (${t}s)"
((t)) && timeout "$t" python3 benchmarks/prefill_bench.py \
  --attention-only bn32_s4_p2_all,bn64_s2_p1_all,bn32_s4_p2_all_no_early_slots \
  --cases 2048:0,8192:65536 --output "$R/attention_cases.json" 2>&1 \
  | grep -v "^moe\|^idx" | tail -24
(cd "$OUT" && tar czf s44.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
