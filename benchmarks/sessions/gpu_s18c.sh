#!/usr/bin/env bash
# Session 18, call 3 (~9 minutes): the wide decode attention's new default (16-row tiles,
# 5 stages: two programs per SM, gathers in flight during the dots). Its GPU tests; the
# sweep around it; the prefill kernel against it at 8192 queries; bench forward at every
# gate against the old default (32-row tiles, 3 stages), alternating, twice; the decode:256
# replay kernel by kernel.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s18c.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-520}
source "$(dirname "$0")/../device_env.sh"
start_call
OLD='override(attn, "wide_tiling", block_n=32, num_stages=3)'
GATES=(--iters 20 --warmup 3 --batch decode:1@4096 --batch decode:64@4096
  --batch decode:256@4096 --batch decode:64@65536 --batch prefill:2048 --batch prefill:8192)
t=$(cap 120); echo "== GPU tests: sparse attention (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m gpu tests/ops/test_sparse_attn.py \
  -p no:cacheprovider -rf > /tmp/pytest_attn.log 2>&1; tail -5 /tmp/pytest_attn.log
t=$(cap 90); echo "== decode attention around the default (${t}s)"
((t)) && timeout "$t" python3 benchmarks/sparse_attention_bench.py --queries 64 256 \
  --variants wide wide_bn32_st3 wide_st6 wide_splits*2 wide_splits*4 wide_fp16_pv \
  --output "$R/attn_sweep.json" 2>&1 | grep -v reference | tail -28
t=$(cap 60); echo "== prefill attention: the prefill kernel against the wide one (${t}s)"
((t)) && timeout "$t" python3 benchmarks/prefill_bench.py --output "$R/prefill_vs_wide.json" \
  --attention-only none 2>&1 | tail -4
forward_ab new "pass" old "$OLD" "${GATES[@]}"
t=$(cap 60); echo "== replay timeline, decode:256 (${t}s)"
((t)) && timeout "$t" python3 benchmarks/graph_gap.py --batch decode:256@4096 \
  --output "$R/graph_gap.json" > /dev/null 2>&1; ls "$R"
echo "== done in ${SECONDS}s"
