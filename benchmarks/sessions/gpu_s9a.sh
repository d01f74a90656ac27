#!/usr/bin/env bash
# Session 9's first device call (~8.5 minutes), issue 13's starting point: bench forward of
# the prefill cases (and decode, for regressions), the prefill profile, the prefill attention
# tiling sweep with the indexer and grouped-MoE timings (prefill_bench.py), Nsight Compute on
# the prefill attention kernel (default and one-program tilings, CSA rows at 8192 queries),
# the mHC kernels at 8192 tokens with prefill tilings, then the GPU tests of the kernels
# that failed in session 8's last call (names with -rf).
# Every file goes into $OUT/s9a.tgz, refreshed after each section.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s9a.sh      (BUDGET_S: total seconds)
set -uo pipefail
OUT=${OUT:-out/gpu}
R="$OUT/r"
mkdir -p "$R"
BUDGET_S=${BUDGET_S:-500}
source "$(dirname "$0")/../device_env.sh"
rs=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
FLASH=(--preset v4-flash --layers 4 --experts 64)
pack() { tar czf "$OUT/s9a.tgz" -C "$OUT" r; }
echo "commit ${RACKSERVE_COMMIT:-unknown}" | tee "$R/commit.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv | tee "$R/gpu.txt"

t=$(cap 100); echo "== bench forward (${t}s)"
((t)) && timeout "$t" "${rs[@]}" bench forward "${FLASH[@]}" --iters 10 --warmup 2 \
  --batch prefill:2048 --batch prefill:8192 --batch prefill:8192@65536 \
  --batch decode:1@4096 --batch decode:64@4096 --batch decode:256@4096 \
  --output "$R/forward.json" 2>&1 | grep -E "^(prefill|decode)|Error"
pack

t=$(cap 60); echo "== profile prefill:8192 (${t}s)"
((t)) && timeout "$t" python3 benchmarks/profile_forward.py --batch prefill:8192 --top 40 \
  --output "$R/profile_prefill.json" 2>&1 | grep -v -i warn | head -45
pack

t=$(cap 200); echo "== prefill_bench (${t}s)"
((t)) && timeout "$t" python3 benchmarks/prefill_bench.py --output "$R/prefill_bench.json" 2>&1 \
  | tee "$R/prefill_bench.txt" | grep -v -i warn | tail -70
pack

for v in default dv1_rows; do
  t=$(cap 45); echo "== ncu prefill attention csa 8192 $v (${t}s)"
  ((t)) && timeout "$t" ncu --clock-control none --kernel-name regex:prefill_attn \
    --launch-skip 1 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats \
    python3 benchmarks/prefill_bench.py --once "csa:8192:0:$v" > "$R/ncu_$v.txt" 2>&1
  grep -E "Duration|Throughput|Hit Rate|Occupancy|Registers|Stall|Warp Cycles|Bandwidth" \
    "$R/ncu_$v.txt" | head -30
done
pack

t=$(cap 60); echo "== mhc at 8192 tokens (${t}s)"
((t)) && timeout "$t" python3 -c "
import json, sys; sys.path.insert(0, 'benchmarks')
from mhc_bench import run
r = run(tokens=(8192,)); json.dump(r, open('$R/mhc_8192.json', 'w'), indent=1)
for x in r: print(x['op'], x['impl'], round(x['time_us'], 1), round(x['gb_per_s'], 1), x.get('max_abs_err'))
" 2>&1 | grep -v -i warn | tail -40
pack

t=$(cap 120); echo "== GPU tests of the kernels (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -p no:cacheprovider -n 2 -m "gpu or not gpu" -rf \
  tests/ops/test_indexer.py tests/ops/test_mhc.py tests/ops/test_moe_routed.py 2>&1 \
  | tee "$R/pytest_kernels.log" | grep -E "FAILED|passed|failed" | tail -12
pack
echo "== done in ${SECONDS}s"
