#!/usr/bin/env bash
# Session 30, call 5: issue 14's "split-K Triton GEMV for batches below 16 (lm_head
# included)": the lm_head's logits from the GEMV writing its fp32 accumulator
# (ops.LOGITS_GEMV_MAX_TOKENS, new default) against cuBLAS (None), bench forward at 1, 4 and 8
# tokens, alternating; gemv_bench (call 4) had the GEMV at 345 against 378 us at one token.
# Then prefill:2048 / 8192 at the new default (the grouped MoE's shared expert beside the
# routed experts from 4096 tokens) and the GEMV / logits / grouped-MoE GPU tests.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s30a.sh     (BUDGET_S: seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-330}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 60); echo "== GEMV, logits and grouped MoE GPU tests (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/ops/test_gemv.py tests/ops/test_grouped_moe.py \
  > "$R/pytest.log" 2>&1
grep -E "^E  |^FAILED|passed|failed" "$R/pytest.log" | head -6
forward_ab cublas_head 'import rackserve.ops as o; o.LOGITS_GEMV_MAX_TOKENS = None' \
  gemv_head 'pass' --batch decode:1@4096 --batch decode:4@4096 --batch decode:8@4096 \
  --iters 30 --warmup 5
t=$(cap 60); echo "== bench forward, prefill at the defaults (${t}s)"
((t)) && forward_with 'pass' "$R/forward_prefill.json" --batch prefill:2048 \
  --batch prefill:8192 --iters 10 --warmup 2
ls "$R"; (cd "$OUT" && tar czf s30a.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
