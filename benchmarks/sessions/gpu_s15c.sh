#!/usr/bin/env bash
# Session 15, call 3 (~5 minutes): issue 13's prefill attention with its per-tile overhead
# cut (sm_90 SASS of the 64-row loop: 1,946 -> 1,485 instructions a thread, spill
# instructions in the loop 137 -> 56): a query whose valid rows are one run loads no flags,
# rows load unmasked (rows outside the run read a valid row of their list, scored -inf),
# the window and the compressed entries in separate tiles, PV's bf16 p summed as converted.
# GPU tests (V4 sizes, chunking); attention at 8192 queries (call 1 measured the previous
# kernel: HCA 1,878, CSA 4,518 us); bench forward at the prefill gates and decode:64.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s15c.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-400}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 120); echo "== GPU tests: prefill attention, chunking (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m gpu tests/ops/test_prefill_attn.py \
  tests/model/test_chunking.py tests/ops/test_kv_fp8.py -p no:cacheprovider 2>&1 | tail -3 | tee "$R/pytest_gpu.log"
t=$(cap 120); echo "== prefill attention at 8192 queries (${t}s)"
((t)) && timeout "$t" python3 benchmarks/prefill_bench.py --output "$R/prefill_attn.json" \
  --attention-only rows_bn32,rows_bn32_stages3 2>&1 | tail -8
t=$(cap 150); echo "== bench forward (${t}s)"
((t)) && forward_with "pass" "$R/forward.json" --iters 10 --warmup 2 --batch prefill:2048 \
  --batch prefill:8192 --batch prefill:8192@65536 --batch decode:64@4096
echo "== done in ${SECONDS}s"
