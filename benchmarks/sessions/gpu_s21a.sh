#!/usr/bin/env bash
# Session 21, calls 1-2 (~6 minutes): the Gluon wgmma prefill attention (prefill_attn_wgmma.py)
# on the GPU: its tests (V4-Flash sizes, masks with holes, against the Triton kernel), then
# prefill_bench at S=8192 (HCA and CSA) against the Triton prefill and decode kernels with
# the bf16-rule check, bench forward prefill with either attention; TEACHER=1: issue 12's
# teacher-forced gate with the tie-aware argmax agreement (calls 1-2).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s21a.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 150); echo "== wgmma attention tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m "gpu or not gpu" tests/ops/test_prefill_attn_wgmma.py \
  -p no:cacheprovider -rf -x > "$R/pytest_wgmma.log" 2>&1
tail -15 "$R/pytest_wgmma.log"
t=$(cap 180); echo "== prefill_bench attention S=8192 (${t}s)"
((t)) && timeout "$t" python3 benchmarks/prefill_bench.py --attention-only bn32_s4,bn32_s4_p2 \
  --output "$R/prefill_attn.json" 2>&1 | tail -20
PREFILL=(--iters 8 --warmup 2 --batch prefill:2048 --batch prefill:8192 --batch prefill:8192@65536)
echo "== bench forward prefill, wgmma attention"
forward_with 'import rackserve.ops.triton.prefill_attn as pa; pa.WGMMA = True' \
  "$R/forward_wgmma.json" "${PREFILL[@]}"
echo "== bench forward prefill, Triton attention"
forward_with 'pass' "$R/forward_triton.json" "${PREFILL[@]}"
if [[ ${TEACHER:-0} == 1 ]]; then
  t=$(cap 150); echo "== teacher-forced gate (${t}s)"
  ((t)) && timeout "$t" python3 -m pytest -q -s -m gpu tests/model/test_gpu_fastpath.py \
    -k teacher_forced -p no:cacheprovider -rf > "$R/pytest_teacher.log" 2>&1
  grep -E "context|passed|failed" "$R/pytest_teacher.log" | tail -6
fi
ls "$R"; (cd "$OUT" && tar czf s21a.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
