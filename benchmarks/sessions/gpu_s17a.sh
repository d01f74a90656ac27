#!/usr/bin/env bash
# Session 17, call 1 (~10 minutes): the GPU tests of session 16's kernels (fused MoE, norm /
# RoPE tables, sparse attention, the fast-path model tests but the teacher-forced argmax
# gate); bench forward at the decode gates (afa7119: decode:256's regression), then A/B with
# the fused MoE's stacked h (fused_moe.Tiling.stack_h) and with the mHC's K2 as two launches
# from 64 tokens (mhc.MIXES_APART_MIN_TOKENS), and with the lm_head's logits cast after the
# GEMM as before (ops.reference.logits); the decode:256 replay kernel by kernel.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s17a.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-580}
source "$(dirname "$0")/../device_env.sh"
start_call
STACK_H='import dataclasses, rackserve.ops.triton.fused_moe as fm
_default = fm.default_tiling
fm.default_tiling = lambda *a, **k: dataclasses.replace(_default(*a, **k), stack_h=True)'
DECODE=(--iters 20 --warmup 3 --batch decode:1@4096 --batch decode:64@4096 --batch decode:256@4096)
t=$(cap 150); echo "== GPU tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m gpu tests/ops/test_fused_moe.py \
  tests/ops/test_norm_rope.py tests/ops/test_sparse_attn.py tests/ops/test_gemv.py \
  tests/model/test_gpu_fastpath.py -k "not teacher_forced" -p no:cacheprovider 2>&1 | tail -15 | tee "$R/pytest_gpu.log"
t=$(cap 50); echo "== bench forward bf16 (${t}s)"
((t)) && forward_with "pass" "$R/forward_bf16.json" "${DECODE[@]}"
t=$(cap 50); echo "== bench forward bf16, stacked h (${t}s)"
((t)) && forward_with "$STACK_H" "$R/forward_stack_h.json" "${DECODE[@]}"
t=$(cap 50); echo "== bench forward bf16, K2 as two launches from 64 tokens (${t}s)"
((t)) && forward_with "mhc.MIXES_APART_MIN_TOKENS = 64" "$R/forward_mixes64.json" "${DECODE[@]}"
t=$(cap 50); echo "== bench forward bf16, both (${t}s)"
((t)) && forward_with "$STACK_H
mhc.MIXES_APART_MIN_TOKENS = 64" "$R/forward_both.json" "${DECODE[@]}"
t=$(cap 50); echo "== bench forward bf16, logits cast after the GEMM (${t}s)"
((t)) && forward_with "import rackserve.ops as o; o._logits_fp32 = o.reference.logits" \
  "$R/forward_cast_logits.json" "${DECODE[@]}"
t=$(cap 70); echo "== replay timeline, decode:256 (${t}s)"
((t)) && timeout "$t" python3 benchmarks/graph_gap.py --batch decode:256@4096 \
  --output "$R/graph_gap.json" > "$R/graph_gap.log" 2>&1; grep -E "timeline|replay_ms" "$R/graph_gap.log" | cut -c1-300
t=$(cap 50); echo "== bench forward bf16 again (${t}s)"
((t)) && forward_with "pass" "$R/forward_bf16_2.json" "${DECODE[@]}"
echo "== done in ${SECONDS}s"
