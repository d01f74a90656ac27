#!/usr/bin/env bash
# Session 22, call 2 (~5 minutes): the Triton prefill MoE (ops/triton/prefill_experts.py:
# gather and SwiGLU inside the gate-up GEMM over expert-aligned blocks) on the GPU: its
# tests, its GEMMs alone over six tilings against F.grouped_mm (moe_stages_bench.py), and
# bench forward prefill with grouped_moe.TILED on / off, alternating.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s22b.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-330}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 90); echo "== tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q tests/ops/test_prefill_experts.py tests/ops/test_grouped_moe.py \
  -p no:cacheprovider -rf > "$R/pytest.log" 2>&1
tail -1 "$R/pytest.log"
t=$(cap 120); echo "== MoE stages and tilings (${t}s)"
((t)) && timeout "$t" python3 benchmarks/moe_stages_bench.py --tokens 2048 8192 \
  --output "$R/moe_stages.json" | grep -v "kmajor\|dense"
forward_ab grouped 'pass' tiled 'import rackserve.ops.grouped_moe as gm; gm.TILED = True' \
  --iters 10 --warmup 2 --batch prefill:2048 --batch prefill:8192
ls "$R"; (cd "$OUT" && tar czf s22b.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
