#!/usr/bin/env bash
# Session 29, call 3 (written in session 29, which had no device time left): issue 13's
# prefill:8192 (45.4 ms on the H200, 41.4 needed). Where its GPU time goes at this commit
# (profile_forward.py, the last profile was session 27's on an H100), then bench forward
# A/Bs at the prefill gates, alternating, two passes each:
#   - the grouped MoE's shared expert apart on the side stream (grouped_moe.SHARED_APART =
#     "beside"; dense cuBLAS GEMMs over x beside the routed experts' sort, permute, grouped
#     GEMMs and SwiGLU) and in series, against folded in as one more group (the default);
#   - hc_post_pre with the expand in K1's prologue at prefill sizes
#     (mhc.POST_APART_MIN_TOKENS past any size: one read of the streams fewer; last timed
#     in session 12, when K1 took 673 us at 8192 tokens against ~100 us now) against the
#     expand apart (the default from 128).
# Their GPU tests first, and the wgmma attention's phases (prefill_bench.py --phases).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s29c.sh     (BUDGET_S: seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 90); echo "== grouped MoE and mHC prefill tests (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/ops/test_grouped_moe.py tests/ops/test_prefill_moe.py \
  tests/ops/test_mhc.py::test_fused_prologue_at_prefill_sizes_on_gpu > "$R/pytest.log" 2>&1
grep -E "^E  |^FAILED|passed|failed" "$R/pytest.log" | head -6
t=$(cap 90); echo "== profile prefill:8192 (${t}s)"
((t)) && timeout "$t" python3 benchmarks/profile_forward.py --batch prefill:8192 --top 30 \
  --output "$R/profile_prefill.json" 2>&1 | grep -E "^==|Error" | head -5
# the wgmma attention's time a query split by what it does (q norm + RoPE on load, the
# output's inverse RoPE, rows against the fixed cost): where HCA's ~40% fixed cost goes
t=$(cap 60); echo "== wgmma attention phases (${t}s)"
((t)) && timeout "$t" python3 benchmarks/prefill_bench.py --phases \
  --output "$R/attention_phases.json" 2>&1 | tail -12
flags=(--batch prefill:2048 --batch prefill:8192 --iters 10 --warmup 2)
forward_ab folded 'pass' shared_beside \
  'import rackserve.ops.grouped_moe as g; g.SHARED_APART = "beside"' "${flags[@]}"
t=$(cap 60); echo "== bench forward, shared_series (${t}s)"
((t)) && forward_with 'import rackserve.ops.grouped_moe as g; g.SHARED_APART = "series"' \
  "$R/forward_shared_series.json" "${flags[@]}"
forward_ab post_apart 'pass' post_in_k1 'mhc.POST_APART_MIN_TOKENS = 1 << 30' "${flags[@]}"
ls "$R"; (cd "$OUT" && tar czf s29c.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
