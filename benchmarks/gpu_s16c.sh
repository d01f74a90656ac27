#!/usr/bin/env bash
# Session 16, call 3 (~5 minutes): the decode step after this session's kernel changes
# (PDL across the Triton chain, fused-MoE decode tilings, router + align tiles, the RoPE
# tables in one launch): GPU tests
# of the fast path with PDL on; bench forward at the decode gates with PDL on, off, on
# (alternating processes); the replay timeline at batch 1; the mHC pre's K2 variants.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/gpu_s16c.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-390}
source "$(dirname "$0")/device_env.sh"
start_call
t=$(cap 150); echo "== GPU tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m gpu tests/model/test_gpu_fastpath.py \
  tests/ops/test_fused_moe.py tests/ops/test_mhc.py tests/ops/test_gemv.py \
  tests/ops/test_sparse_attn.py tests/ops/test_norm_rope.py -p no:cacheprovider -x 2>&1 | tail -4 | tee "$R/pytest_gpu.log"
for pdl in 1 0 1; do
  t=$(cap 50); echo "== bench forward bf16, RACKSERVE_PDL=$pdl (${t}s)"
  ((t)) && RACKSERVE_PDL=$pdl forward_with "pass" "$R/forward_pdl${pdl}_$SECONDS.json" \
    --iters 20 --warmup 3 --batch decode:1@4096 --batch decode:64@4096 --batch decode:256@4096
done
t=$(cap 60); echo "== replay timeline (${t}s)"
((t)) && timeout "$t" python3 benchmarks/graph_gap.py --batch decode:1@4096 \
  --output "$R/graph_gap.json" > "$R/graph_gap.log" 2>&1
grep -E "timeline" "$R/graph_gap.log" | cut -c1-300
t=$(cap 60); echo "== mHC pre variants at one token (${t}s)"
((t)) && timeout "$t" python3 benchmarks/latency_kernels.py --parts hc --tokens 1 \
  --output "$R/latency_kernels.json" 2>&1 | tail -10
echo "== done in ${SECONDS}s"
