#!/usr/bin/env bash
# Session 43: the wgmma prefill attention's three switches (WgmmaTiling.async_q: q by cp.async
# first; early_slots: a refill's slot indices loaded at the top of its iteration; staged_out:
# the output through shared memory to 16-byte stores). Their GPU tests, then prefill_bench's
# attention alone at 8192 queries (each switch alone and all, on the 32- and 64-row tilings),
# the phases of the default against all switches, and bench forward prefill:8192 with
# the default tiling's switches all on against off (alternating, two passes).
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s43.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-380}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 100); echo "== GPU tests: the wgmma prefill attention (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/ops/test_prefill_attn_wgmma.py -k "not compiles" \
  > "$R/wgmma_tests.log" 2>&1
tail -3 "$R/wgmma_tests.log"
v=bn32_s4_p2,bn32_s4_p2_async_q,bn32_s4_p2_early_slots,bn32_s4_p2_staged_out,bn32_s4_p2_all
v=$v,bn64_s2_p1,bn64_s2_p1_all
t=$(cap 110); echo "== prefill_bench attention, 8192 queries (${t}s)"
((t)) && timeout "$t" python3 benchmarks/prefill_bench.py --attention-only "$v" \
  --cases 8192:0 --output "$R/attention.json" 2>&1 | grep -v "^moe\|^idx" | tail -20
t=$(cap 70); echo "== prefill_bench phases (${t}s)"
((t)) && timeout "$t" python3 benchmarks/prefill_bench.py --phases \
  --attention-only default,bn32_s4_p2_all,bn64_s2_p1_all --output "$R/phases.json" 2>&1 | tail -40
on='import rackserve.ops.triton.prefill_attn_wgmma as w
override(w, "default_tiling", async_q=True, early_slots=True, staged_out=True)'
forward_ab switches_on "$on" switches_off 'pass' --iters 10 --warmup 2 \
  --batch prefill:8192
(cd "$OUT" && tar czf s43.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
