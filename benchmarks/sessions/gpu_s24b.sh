#!/usr/bin/env bash
# Session 24, call 3: the prefill-graph test against its padded eager step (bitwise) and the
# unpadded one (row-wise); the decode MoE with h rounded once to bf16 (fused_moe.Tiling.round_h)
# against the stacked hi / lo h: the down kernel alone at T = 1, 64, 256, then bench forward
# A/B in alternating processes at decode:1 / 64 / 256.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s24b.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-480}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 80); echo "== prefill-graph test (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider -rf \
  --tb=short tests/model/test_gpu_fastpath.py -k prefill_graph > "$R/pytest_prefill_graph.log" 2>&1
grep -E "^E  |passed|failed" "$R/pytest_prefill_graph.log" | head -8
t=$(cap 170); echo "== down kernel sweep, stacked / rounded h (${t}s)"
((t)) && timeout "$t" python3 benchmarks/moe_tiling_sweep.py --tokens 1 64 256 --kernels down \
  --h-layout stacked rounded --tile-fastest 1 --output "$R/moe_down_sweep.json" 2>&1 | tail -40
forward_ab rounded 'import rackserve.ops.triton.fused_moe as fm; override(fm, "default_tiling", round_h=True)' \
  stacked 'pass' --batch decode:1@4096 --batch decode:64@4096 --batch decode:256@4096 \
  --iters 20 --warmup 3
ls "$R"; (cd "$OUT" && tar czf s24b.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
