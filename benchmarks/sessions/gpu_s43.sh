#!/usr/bin/env bash
# Session 43: the wgmma prefill attention's switches (WgmmaTiling: async_q, q by cp.async
# first; early_slots, a refill's slot indices loaded at the top of its iteration; staged_out,
# the output through shared memory to 16-byte stores; column_sums, the softmax denominator
# per score column, summed once; max_exchange, a tile's row max crossing the warpgroups with
# one barrier: with the column sums the tile loop's barriers go 6 -> 2; span_reduce, the
# prologue's span scan in one reduction; reuse_scores, QK's accumulator operand the last
# tile's scores: with the others no spills in the 64-row tiling). By priority, so that a
# smaller $BUDGET_S cuts the last steps: prefill_bench's attention alone at 8192 queries (the
# four barrier switches, those with async_q, all; 32- and 64-row tilings; each with its
# fraction outside the bf16 rule), bench forward prefill:8192 with the fastest tiling within
# the bf16 rule of either family as the HCA and CSA defaults (s43_best_switches.py) against
# the defaults (alternating, two passes), the GPU tests, the phases of the default against
# the barrier switches, then each switch alone in prefill_bench.
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s43.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}
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
t=$(cap 50); echo "== prefill_bench phases (${t}s)"
((t)) && timeout "$t" python3 benchmarks/prefill_bench.py --phases \
  --attention-only default,bn32_s4_p2_barriers --output "$R/phases.json" \
  2>&1 | tail -40
v=bn32_s4_p2_async_q,bn32_s4_p2_early_slots,bn32_s4_p2_staged_out,bn32_s4_p2_column_sums
v=$v,bn32_s4_p2_max_exchange,bn32_s4_p2_span_reduce,bn32_s4_p2_reuse_scores
t=$(cap 120); echo "== prefill_bench attention, 8192 queries: each switch alone (${t}s)"
((t)) && timeout "$t" python3 benchmarks/prefill_bench.py --attention-only "$v" \
  --cases 8192:0 --output "$R/attention_singles.json" 2>&1 | grep -v "^moe\|^idx" | tail -24
(cd "$OUT" && tar czf s43.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
