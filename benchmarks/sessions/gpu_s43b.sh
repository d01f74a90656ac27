#!/usr/bin/env bash
# Session 43, a short call: gpu_s43.sh's steps by priority. prefill_bench's attention at
# 8192 queries for the switch groups (each with its fraction outside the bf16 rule), bench
# forward prefill:8192 with the fastest tilings as the defaults against the defaults, then
# the GPU tests, with what is left.
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s43b.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-330}
source "$(dirname "$0")/../device_env.sh"
start_call
v=bn32_s4_p2,bn32_s4_p2_barriers,bn32_s4_p2_aq_barriers,bn32_s4_p2_all
v=$v,bn64_s2_p1,bn64_s2_p1_barriers,bn64_s2_p1_aq_barriers,bn64_s2_p1_all
t=$(cap 150); echo "== prefill_bench attention, 8192 queries: the groups (${t}s)"
((t)) && timeout "$t" python3 benchmarks/prefill_bench.py --attention-only "$v" \
  --cases 8192:0 --output "$R/attention.json" 2>&1 | grep -v "^moe\|^idx" | tail -24
best=$(PYTHONPATH=$PYTHONPATH:$PWD/benchmarks python3 benchmarks/sessions/s43_best_switches.py \
  "$R/attention.json")
echo "$best" | tee "$R/best_switches.py"
forward_ab fastest "$best" defaults 'pass' --iters 10 --warmup 2 --batch prefill:8192
t=$(cap 100); echo "== GPU tests: the wgmma prefill attention (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/ops/test_prefill_attn_wgmma.py -k "not compiles" \
  > "$R/wgmma_tests.log" 2>&1
tail -3 "$R/wgmma_tests.log"
(cd "$OUT" && tar czf s43b.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
