#!/usr/bin/env bash
# Session 17, call 1 (~10 minutes): the GPU tests of session 16's kernels (fused MoE, norm /
# RoPE tables, sparse attention, the fast-path model tests but the teacher-forced argmax
# gate); bench forward at the decode gates (afa7119: decode:256's regression); the decode:256
# replay kernel by kernel (graph_gap.py); the fused MoE's kernels alone at T = 256 with 16-
# and 32-row blocks (moe_tiling_sweep.py); the mHC pre and post-pre variants at 64 and 256
# tokens (latency_kernels.py).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/gpu_s17a.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-580}
source "$(dirname "$0")/device_env.sh"
start_call
t=$(cap 150); echo "== GPU tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m gpu tests/ops/test_fused_moe.py \
  tests/ops/test_norm_rope.py tests/ops/test_sparse_attn.py tests/model/test_gpu_fastpath.py \
  -k "not teacher_forced" -p no:cacheprovider 2>&1 | tail -15 | tee "$R/pytest_gpu.log"
t=$(cap 50); echo "== bench forward bf16 (${t}s)"
((t)) && forward_with "pass" "$R/forward_bf16.json" --iters 20 --warmup 3 \
  --batch decode:1@4096 --batch decode:64@4096 --batch decode:256@4096
t=$(cap 70); echo "== replay timeline, decode:256 (${t}s)"
((t)) && timeout "$t" python3 benchmarks/graph_gap.py --batch decode:256@4096 \
  --output "$R/graph_gap.json" > "$R/graph_gap.log" 2>&1; grep -E "timeline|replay_ms" "$R/graph_gap.log" | cut -c1-300
t=$(cap 150); echo "== mHC pre and post-pre variants (${t}s)"
((t)) && timeout "$t" python3 benchmarks/latency_kernels.py --parts hc post --tokens 64 256 \
  --output "$R/latency_kernels.json" > "$R/latency_kernels.txt" 2>&1; grep -c us "$R/latency_kernels.txt"
t=$(cap 150); echo "== MoE tiling sweep, T = 256 (${t}s)"
((t)) && timeout "$t" python3 benchmarks/moe_tiling_sweep.py --tokens 256 --block-m 32 16 --stack-h 0 1 \
  --kernels down --jobs 15 --output "$R/moe_tiling.json" 2>&1 | grep -v Warning | tail -30
echo "== done in ${SECONDS}s"
