#!/usr/bin/env bash
# Session 24, call 4 (~9 minutes): the decode MoE with h rounded once (fused_moe.Tiling.round_h,
# now the default for 16-bit weights, 128 x 128 down tiles): its GPU tests at V4-Flash sizes,
# the bf16 accuracy gates of the whole model (teacher-forced against the bf16 reference, and
# no less accurate than it against fp32), every gate, and the decode step against
# transformers on the same checkpoint.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s24c.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-580}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 60); echo "== fused MoE GPU tests (${t}s)"
f=tests/ops/test_fused_moe.py
((t)) && timeout "$t" "${pt[@]}" $f::test_v4_flash_sizes_on_gpu $f::test_v4_flash_sizes_on_gpu_h_layouts \
  $f::test_rounded_h_is_finer_than_the_bf16_reference tests/ops/test_moe_routed.py::test_moe_routed_bf16 \
  > "$R/pytest_moe.log" 2>&1
grep -E "^E  |passed|failed" "$R/pytest_moe.log" | head -8
gates
decode_vs_transformers
ls "$R"; (cd "$OUT" && tar czf s24c.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
