#!/usr/bin/env bash
# Session 18, call 2 (~7 minutes): deeper software pipelining of the sparse-attention row
# gathers. At 2-4 stages Triton 3.6 issues a tile's gathers after the previous tile's dots
# and waits for them at the top of the next iteration (sm_90 TTGIR: async_wait num = 0), so
# no gather overlaps a dot; from 5 stages the wait leaves later tiles in flight. The decode
# "wide" kernel (S = 64, 256) and the prefill kernel (8192 queries) over stages and tile
# rows, then bench forward with 5 stages in both against the defaults, alternating, twice.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s18b.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-450}
source "$(dirname "$0")/../device_env.sh"
start_call
STAGES5='import rackserve.ops.triton.prefill_attn as pa
override(attn, "wide_tiling", num_stages=5)
override(pa, "default_tiling", num_stages=5)'
GATES=(--iters 20 --warmup 3 --batch decode:64@4096 --batch decode:256@4096
  --batch prefill:2048 --batch prefill:8192)
t=$(cap 100); echo "== decode attention: stages (${t}s)"
((t)) && timeout "$t" python3 benchmarks/sparse_attention_bench.py --queries 64 256 \
  --variants wide wide_st5 wide_st6 wide_bn16_st5 wide_bn16_st7 \
  --output "$R/attn_sweep.json" 2>&1 | grep -v reference | tail -26
t=$(cap 100); echo "== prefill attention: stages (${t}s)"
((t)) && timeout "$t" python3 benchmarks/prefill_bench.py --output "$R/prefill_sweep.json" \
  --attention-only rows_stages5,rows_stages6,rows_bn16_stages5,rows_bn16_stages7 2>&1 | tail -14
forward_ab default "pass" stages5 "$STAGES5" "${GATES[@]}"
echo "== done in ${SECONDS}s"
