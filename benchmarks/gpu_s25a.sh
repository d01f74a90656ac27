#!/usr/bin/env bash
# Session 25, call 1 (~9.5 minutes; written in session 24, which had no device time left):
# the chunking-invariance GPU test with the decode MoE's rounded h (not rerun in session 24);
# the KV budget's reserve for the largest step and the CUDA graphs (runner/memory_profile.py,
# 8ef7435): its GPU test, then an engine sized by --gpu-memory-utilization (bench decode
# without --kv-cache-memory) logging the reserve next to what its graphs hold; then the decode
# MoE at T = 256 with 64-row blocks (each expert's pairs in one block, its weights read once)
# against 32, h rounded once; then the Gluon wgmma attention (prefill's, 2x the decode
# kernels at 8192 queries) for decode batches from 128 queries (ops.PREFILL_ATTENTION_MIN_TOKENS
# 512 -> 128: set when the wgmma kernel did not exist) in a bench forward A/B.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/gpu_s25a.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-585}
source "$(dirname "$0")/device_env.sh"
start_call
rs=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
t=$(cap 60); echo "== memory profile GPU test (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider -rf \
  --tb=short tests/runner/test_memory_profile.py > "$R/pytest_memory.log" 2>&1
grep -E "^E  |passed|failed" "$R/pytest_memory.log" | head -6
t=$(cap 110); echo "== fused MoE (one h layout since 9f136fc), chunking invariance (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider -rf \
  --tb=short tests/ops/test_fused_moe.py::test_v4_flash_sizes_on_gpu \
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
t=$(cap 120); echo "== MoE at T = 256, 32- and 64-row blocks, h rounded (${t}s)"
((t)) && timeout "$t" python3 benchmarks/moe_tiling_sweep.py --tokens 256 --block-m 32 64 \
  --tile-fastest 1 --output "$R/moe_block_m.json" 2>&1 | tail -30
forward_ab wgmma128 'import rackserve.ops as o; o.PREFILL_ATTENTION_MIN_TOKENS = 128' \
  decode_kernels 'pass' --batch decode:128@4096 --batch decode:256@4096 --batch decode:64@4096 \
  --iters 20 --warmup 3
ls "$R"; (cd "$OUT" && tar czf s25a.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
