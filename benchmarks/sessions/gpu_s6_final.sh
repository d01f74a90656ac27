#!/usr/bin/env bash
# Session 6's last device call (~8.5 minutes): the forward gates after the per-expert MoE
# align (decode 1/8/64/128/256 at 4096, 64 at 512 and 65536; prefill 2048 and 8192), the
# one-launch mHC at batch 1 (RACKSERVE_MHC_FUSED=1: forward and launch count), launches
# per layer at 64 and 256, then the GPU-marked tests (2 workers: 8 ran out of memory).
# Every file goes into $OUT/final.tgz, refreshed after each section.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s6_final.sh      (BUDGET_S: total seconds)
set -uo pipefail
OUT=${OUT:-out/gpu}
R="$OUT/r"
mkdir -p "$R"
BUDGET_S=${BUDGET_S:-500}
source "$(dirname "$0")/../device_env.sh"
rs=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
FLASH=(--preset v4-flash --layers 4 --experts 64)
pack() { tar czf "$OUT/final.tgz" -C "$OUT" r; }
echo "commit ${RACKSERVE_COMMIT:-unknown}" | tee "$R/commit.txt"

t=$(cap 150); echo "== bench forward (${t}s)"
((t)) && timeout "$t" "${rs[@]}" bench forward "${FLASH[@]}" --iters 20 --warmup 3 \
  --batch decode:1@4096 --batch decode:8@4096 --batch decode:64@4096 --batch decode:128@4096 \
  --batch decode:256@4096 --batch decode:64@512 --batch decode:64@65536 --batch prefill:2048 \
  --batch prefill:8192 --output "$R/forward.json" 2>&1 | grep -E "^decode|^prefill|Error"
pack

t=$(cap 50); echo "== one-launch mHC at batch 1 (${t}s)"
((t)) && RACKSERVE_MHC_FUSED=1 timeout "$t" "${rs[@]}" bench forward "${FLASH[@]}" --iters 20 \
  --warmup 3 --batch decode:1@4096 --output "$R/forward_mhc_fused.json" 2>&1 | grep -E "^decode|Error"
t=$(cap 40)
((t)) && RACKSERVE_MHC_FUSED=1 timeout "$t" python3 benchmarks/profile_forward.py \
  --batch decode:1@4096 --top 30 --output "$R/profile_mhc_fused.json" 2>&1 | grep -E "^==|Error"
pack

t=$(cap 60); echo "== launches per layer (${t}s)"
((t)) && timeout "$t" python3 benchmarks/profile_forward.py --batch decode:64@4096 \
  --batch decode:256@4096 --top 30 --output "$R/profile.json" 2>&1 | grep -E "^==|Error"
pack

t=$(cap 260); echo "== GPU-marked tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -p no:cacheprovider -n 2 -m gpu -rf tests/ops \
  tests/model/test_gpu_fastpath.py 2>&1 | tee "$R/pytest_gpu.log" \
  | grep -E "passed|failed|FAILED|Error|context .*median|fast vs fp32" | tail -20
pack
echo "== done in ${SECONDS}s"
