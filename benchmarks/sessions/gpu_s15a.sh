#!/usr/bin/env bash
# Session 15, call 1 (~5 minutes): issue 13's prefill attention. On sm_90 the kernel's loop
# waits for each gathered tile at the top of the tile (SASS: DEPBAR.LE SB0, 0x0; Triton's
# pipeliner keeps one tile of an indirect load in flight), so a tile's gather latency is not
# hidden. Here the prefetching loop (rows of tile i + 1 loaded into registers while tile i
# computes) against the pipelined one, at 8192 queries, with the bf16-rule outliers; the GPU
# tests of both; ncu of each on the CSA layer (why the rest of the time goes).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s15a.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-400}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 90); echo "== GPU tests of the prefill attention kernel (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m gpu tests/ops/test_prefill_attn.py -p no:cacheprovider \
  2>&1 | tail -3 | tee "$R/pytest_gpu.log"
t=$(cap 150); echo "== prefill attention at 8192 queries (${t}s)"
((t)) && timeout "$t" python3 benchmarks/prefill_bench.py --output "$R/prefill_attn.json" \
  --attention-only prefetch_bn16,prefetch_bn32,prefetch_bn64,rows_bn32_stages3 2>&1 | tail -16
for v in default prefetch_bn32; do
  t=$(cap 45); echo "== ncu: CSA layer, $v (${t}s)"
  ((t)) && timeout "$t" ncu --clock-control none --kernel-name regex:prefill_attn \
    --launch-skip 1 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
    --section LaunchStats python3 benchmarks/prefill_bench.py --once "csa:8192:0:$v" \
    > "$R/ncu_csa_$v.txt" 2>&1
  grep -E "Duration|Throughput|Hit Rate|Registers|Stall|Warp Cycles Per|Issued Ipc|Pipe|Shared Memory Config|Achieved Occ" \
    "$R/ncu_csa_$v.txt" | head -24
done
echo "== done in ${SECONDS}s"
