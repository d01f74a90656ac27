#!/usr/bin/env bash
# Session 17, call 3 (~7 minutes): the GPU tests of the new fused-MoE defaults (stacked h,
# 64-pair align segments) and of the fp32 logits, graph replay against eager; bench forward
# at every decode and prefill gate, the decode ones twice; the decode:256 replay kernel by
# kernel; the mHC post-pre after a fused MoE over K1's tiles (latency_kernels.py).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s17c.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-450}
source "$(dirname "$0")/../device_env.sh"
start_call
DECODE=(--iters 20 --warmup 3 --batch decode:1@4096 --batch decode:64@4096 --batch decode:256@4096)
t=$(cap 150); echo "== GPU tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m gpu tests/ops/test_fused_moe.py \
  tests/ops/test_gemv.py tests/model/test_gpu_fastpath.py tests/ops/test_norm_rope.py \
  -k "h_layouts or v4_flash_sizes or cuda_graph_replay or logits or graph_replay or rope_cos_sin" \
  -p no:cacheprovider -rf > "$R/pytest_gpu.log" 2>&1; tail -6 "$R/pytest_gpu.log"
t=$(cap 80); echo "== bench forward bf16, the gates (${t}s)"
((t)) && forward_with "pass" "$R/forward_bf16.json" --iters 20 --warmup 3 \
  --batch decode:1@4096 --batch decode:64@4096 --batch decode:256@4096 \
  --batch decode:64@65536 --batch prefill:2048 --batch prefill:8192
t=$(cap 50); echo "== bench forward bf16, decode again (${t}s)"
((t)) && forward_with "pass" "$R/forward_bf16_2.json" "${DECODE[@]}"
t=$(cap 60); echo "== replay timeline, decode:256 (${t}s)"
((t)) && timeout "$t" python3 benchmarks/graph_gap.py --batch decode:256@4096 \
  --output "$R/graph_gap.json" > /dev/null 2>&1; ls "$R"
t=$(cap 100); echo "== mHC post-pre variants (${t}s)"
((t)) && timeout "$t" python3 benchmarks/latency_kernels.py --parts post --tokens 256 64 \
  --output "$R/latency_kernels.json" > "$R/latency_kernels.txt" 2>&1; grep -c us "$R/latency_kernels.txt"
echo "== done in ${SECONDS}s"
