#!/usr/bin/env bash
# Session 16, call 3 (~10 minutes): GPU tests of the fast path with PDL on; bench forward
# (bf16) at the decode and prefill gates; bench decode at 1 and 64 requests next to
# transformers' decode step; launches per layer; the decode gates with PDL off.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s16e.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-590}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 100); echo "== GPU tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m gpu tests/model/test_gpu_fastpath.py \
  tests/ops/test_fused_moe.py tests/ops/test_norm_rope.py tests/ops/test_sparse_attn.py \
  -p no:cacheprovider -x 2>&1 \
  | tail -4 | tee "$R/pytest_gpu.log"
t=$(cap 80); echo "== bench forward bf16, PDL on (${t}s)"
((t)) && forward_with "pass" "$R/forward_bf16.json" --iters 20 --warmup 3 \
  --batch decode:1@4096 --batch decode:64@4096 --batch decode:256@4096 \
  --batch decode:64@65536 --batch prefill:2048 --batch prefill:8192
decode_vs_transformers
t=$(cap 45); echo "== launches per layer (${t}s)"
((t)) && timeout "$t" python3 benchmarks/profile_forward.py --batch decode:1@4096 \
  --batch decode:64@4096 --batch decode:256@4096 --output "$R/profile.json" 2>&1 | grep "^=="
t=$(cap 40); echo "== bench forward bf16, RACKSERVE_PDL=0 (${t}s)"
((t)) && RACKSERVE_PDL=0 forward_with "pass" "$R/forward_bf16_pdl0.json" --iters 20 \
  --warmup 3 --batch decode:1@4096 --batch decode:64@4096 --batch decode:256@4096
echo "== done in ${SECONDS}s"
