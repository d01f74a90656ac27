#!/usr/bin/env bash
# Session 22, call 6 (~2 minutes): the MoE kernels' GPU tests after their helpers were
# shared (align, counting sort, tiled MoE, fused MoE, routed MoE) and bench forward prefill.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s22f.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-200}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 100); echo "== MoE tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m "gpu or not gpu" tests/ops/test_prefill_moe.py \
  tests/ops/test_prefill_experts.py tests/ops/test_fused_moe.py tests/ops/test_moe_routed.py \
  -p no:cacheprovider -rf > "$R/pytest.log" 2>&1
tail -1 "$R/pytest.log"
forward_with 'pass' "$R/forward_prefill.json" --iters 10 --warmup 2 --batch prefill:2048 \
  --batch prefill:8192
ls "$R"; (cd "$OUT" && tar czf s22f.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
