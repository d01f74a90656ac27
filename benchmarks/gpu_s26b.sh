#!/usr/bin/env bash
# Session 26, call 2 (~7 minutes; written in session 25, whose machine never started): what
# session 24 wrote without a device. The KV budget's reserve (runner/memory_profile.py): its
# GPU test, then an engine sized by --gpu-memory-utilization (bench decode without
# --kv-cache-memory) logging the reserve next to what its CUDA graphs hold; the decode MoE at
# T = 256 with 64-row blocks (each expert's pairs in one block, its weights read once)
# against 32, h rounded once; the fused MoE's V4-Flash tests and the chunking-invariance GPU
# test with the decode MoE's rounded h (not rerun since 9f136fc).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/gpu_s26b.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-420}
source "$(dirname "$0")/device_env.sh"
start_call
rs=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
pt=(python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider -rf --tb=short)
t=$(cap 60); echo "== memory profile GPU test (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/runner/test_memory_profile.py > "$R/pytest_memory.log" 2>&1
grep -E "^E  |passed|failed" "$R/pytest_memory.log" | head -6
t=$(cap 100); echo "== MoE at T = 256, 32- and 64-row blocks, h rounded (${t}s)"
((t)) && timeout "$t" python3 benchmarks/moe_tiling_sweep.py --tokens 256 --block-m 32 64 \
  --tile-fastest 1 --output "$R/moe_block_m.json" 2>&1 | tail -30
t=$(cap 110); echo "== fused MoE (one h layout since 9f136fc), chunking invariance (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/ops/test_fused_moe.py::test_v4_flash_sizes_on_gpu \
  tests/model/test_chunking_gpu.py > "$R/pytest_chunking.log" 2>&1
grep -E "^E  |passed|failed" "$R/pytest_chunking.log" | head -6
t=$(cap 100); echo "== model create (${t}s)"
((t)) && timeout "$t" "${rs[@]}" model create --preset v4-flash --layers 4 --experts 64 \
  --dtype bfloat16 --no-mtp --out /tmp/flash4 2>&1 | tail -1
t=$(cap 90); echo "== bench decode sized by --gpu-memory-utilization (${t}s)"
((t)) && [[ -d /tmp/flash4 ]] && timeout "$t" "${rs[@]}" bench decode --model /tmp/flash4 \
  --concurrency 64 --context 512 --steps 20 --warmup 5 --output "$R/decode_64_budget.json" \
  > "$R/decode_64_budget.log" 2>&1
grep -E "memory:|CUDA graphs|KV cache|decode x|Error" "$R/decode_64_budget.log" | head -8
ls "$R"; (cd "$OUT" && tar czf s26b.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
