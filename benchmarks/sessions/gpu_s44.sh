#!/usr/bin/env bash
# Session 44: the wgmma prefill attention with session 43's switches as its only path. By
# priority (session 45: hc_post_pre's expand-fused K1 tilings first, the tests after the MoE
# passes' tilings): its GPU tests (the raw-q test now compares like tilings) and the MoE elementwise
# kernels' ones; the MoE elementwise kernels' tilings (prefill_bench.py --moe-only); the
# attention of 32- against 64-row tiles at 8192 queries, 2048, and 8192 after 65,536 cached
# (which tiling the HCA layer takes: 64-row tiles won at 8192 queries in call 1); the q
# norm's head blocks (sessions/s44_q_heads.py); every gate's bench forward; the gates'
# summary. Session 45 added hc_post_pre's expand-fused K1 tilings (mhc_bench).
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s44.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-470}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 100); echo "== mhc_bench: hc_post_pre with the expand in K1, bf16x3, tilings without spills (${t}s)"
((t)) && timeout "$t" python3 benchmarks/mhc_bench.py --tokens 64 8192 256 2048 --ops hc_post_pre \
  --variants fused_t16_d32_w4 fused_t32_d16_w4 stream_t32_d32_w4_s1 \
  fused_t32_d16_w4_tf32x3 apart_expand fused_t64_d16_w8 fused_t64_d32_w8 fused_t128_d16_w8 \
  stream_t64_d32_w8 stream_t64_d32_w8_s1 stream_t64_d64_w8_s1 stream_t128_d32_w8_s1 \
  --output "$R/mhc_fused.json" 2>&1 | grep -v "^$" | tail -50
if grep -q -- "--moe-only" benchmarks/prefill_bench.py; then
  t=$(cap 120); echo "== prefill_bench: the MoE passes' tilings (${t}s)"
  ((t)) && timeout "$t" python3 benchmarks/prefill_bench.py --moe-only \
    --output "$R/moe.json" 2>&1 | tail -40
fi
t=$(cap 150); echo "== GPU tests: the wgmma prefill attention, the MoE passes, mHC's expand-fused K1 (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/ops/test_prefill_attn_wgmma.py tests/ops/test_prefill_moe.py \
  tests/ops/test_mhc.py -k "(not compile and not test_mhc) or prefill_sizes" \
  > "$R/gpu_tests.log" 2>&1
tail -3 "$R/gpu_tests.log"
t=$(cap 100); echo "== prefill_bench attention: 32- against 64-row tiles (${t}s)"
((t)) && timeout "$t" python3 benchmarks/prefill_bench.py --attention-only bn32_s4_p2,bn64_s2_p1 \
  --cases 8192:0,2048:0,8192:65536 --output "$R/attention.json" 2>&1 \
  | grep -v "^moe\|^idx" | tail -24
t=$(cap 60); echo "== the q norm's head blocks: 16, 32, 64 (${t}s)"
((t)) && timeout "$t" python3 benchmarks/sessions/s44_q_heads.py | tee "$R/q_heads.jsonl"
((BUDGET_S - SECONDS > 150)) && forward_gates  # uncut: only with time for it
echo "== the gates"
python3 benchmarks/gates.py "$R" --output "$R/gates.json"
(cd "$OUT" && tar czf s44.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
