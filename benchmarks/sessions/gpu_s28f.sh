#!/usr/bin/env bash
# Issue 13's correctness gates and the session's GPU tests at the session's last commit:
# chunking invariance (whole, 512- and 97-token chunks), fp32 fast path against the
# reference kernels (1e-3, the same greedy tokens), prefix hits on ring tables, the wgmma
# attention's masks (the 64-row tiles), graph replay against eager (defaults, and the shared
# expert beside the router at 1 and 64 requests), the fused MoE and the routed MoE.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s28f.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-400}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 200); echo "== gates' tests (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/model/test_chunking_gpu.py \
  "tests/model/test_gpu_fastpath.py::test_fp32_fast_path_matches_reference_kernels" \
  "tests/model/test_gpu_fastpath.py::test_graph_replay_is_bit_identical_to_eager" \
  -k "not indexer" > "$R/pytest_gates.log" 2>&1
grep -E "^E  |^FAILED|passed|failed" "$R/pytest_gates.log" | head -8
t=$(cap 150); echo "== kernels' and ring tables' GPU tests (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/ops/test_prefill_attn_wgmma.py \
  tests/ops/test_fused_moe.py tests/ops/test_moe_routed.py tests/runner/test_ring_tables.py \
  > "$R/pytest_kernels.log" 2>&1
grep -E "^E  |^FAILED|passed|failed" "$R/pytest_kernels.log" | head -8
ls "$R"; (cd "$OUT" && tar czf s28f.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
