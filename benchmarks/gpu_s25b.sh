#!/usr/bin/env bash
# Session 25, call 1 (gpu_s25a.sh's steps, most wanted first: failed machine starts left
# ~8 minutes of device time). Bench forward at decode:256 / 128, three sides alternating:
# the Gluon wgmma attention for decode batches from 128 queries
# (ops.PREFILL_ATTENTION_MIN_TOKENS 512 -> 128); hc_post_pre's expand in its own launch from
# 128 tokens (mhc.POST_APART_MIN_TOKENS 1024 -> 128: in session 24's decode:256 timeline the
# expand-fused K1 after attention took 27 us, the apart pair after the MoE 12 + 6); the
# defaults; K2 as a mixes launch and a collapse launch from 128 tokens
# (mhc.MIXES_APART_MIN_TOKENS 2048 -> 128: hc_finish took 12 us a launch at 256 tokens). Then the KV budget's reserve GPU test (runner/memory_profile.py); the decode MoE at
# T = 256 with 64-row blocks against 32; the chunking-invariance GPU test with the decode
# MoE's rounded h; an engine sized by --gpu-memory-utilization logging its reserve.
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<s> bash benchmarks/gpu_s25b.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-585}
source "$(dirname "$0")/device_env.sh"
start_call
rs=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
# four sides, alternating, two passes (decode:64 takes neither switch: not measured)
for pass in 1 2; do
  for side in wgmma128 postapart128 default mixesapart128; do
    case $side in
      wgmma128) code='import rackserve.ops as o; o.PREFILL_ATTENTION_MIN_TOKENS = 128' ;;
      postapart128) code='mhc.POST_APART_MIN_TOKENS = 128' ;;
      mixesapart128) code='mhc.MIXES_APART_MIN_TOKENS = 128' ;;
      default) code='pass' ;;
    esac
    t=$(cap 60); echo "== bench forward, $side, pass $pass (${t}s)"
    ((t)) && timeout "$t" bash -c "$(declare -f forward_with); forward_with \"\$@\"" _ "$code" \
      "$R/forward_${side}_$pass.json" --batch decode:256@4096 --batch decode:128@4096 \
      --iters 20 --warmup 3
  done
done
t=$(cap 60); echo "== memory profile GPU test (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider -rf \
  --tb=short tests/runner/test_memory_profile.py > "$R/pytest_memory.log" 2>&1
grep -E "^E  |passed|failed" "$R/pytest_memory.log" | head -6
t=$(cap 100); echo "== MoE at T = 256, 32- and 64-row blocks, h rounded (${t}s)"
((t)) && timeout "$t" python3 benchmarks/moe_tiling_sweep.py --tokens 256 --block-m 32 64 \
  --tile-fastest 1 --output "$R/moe_block_m.json" 2>&1 | tail -30
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
ls "$R"; (cd "$OUT" && tar czf s25b.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
