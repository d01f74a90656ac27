#!/usr/bin/env bash
# Session 12's last device call (~6 minutes): 1. mhc_bench at 2048 tokens with 128-token K1
# tiles (timed at 8192 only); 2. bench forward with the final defaults (split K2 from 2048
# tokens, 64 a mixes program; 128-token K1 tiles from 4096; fp16 PV off) against session
# 11's; 3. bench decode at 1 and 64 requests next to transformers on the same checkpoint.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s12d.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-380}
source "$(dirname "$0")/../device_env.sh"
start_call
rs=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
FLASH=(--preset v4-flash --layers 4 --experts 64)
pack() { tar czf "$OUT/s12d.tgz" -C "$OUT" r; }
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)' | tee "$R/env.txt"
t=$(cap 30); echo "== mhc_bench 2048 (${t}s)"
((t)) && timeout "$t" python3 benchmarks/mhc_bench.py --tokens 2048 --output "$R/mhc_bench.json" \
  --ops hc_pre hc_post_pre --variants gemm_t128 one_k2 2>&1 | grep -E "hc_pre |hc_post_pre|Error"
for v in "as_now|pass" \
         "s11|mhc.MIXES_APART_MIN_TOKENS = None; mhc.K1_WIDE_TILE_MIN_TOKENS = 10**9"; do
  name=${v%%|*}; code=${v#*|}
  t=$(cap 55); echo "== forward $name (${t}s)"
  ((t)) && timeout "$t" bash -c "$(declare -f forward_with); forward_with '$code' \
    $R/forward_$name.json --iters 10 --warmup 2 --batch prefill:2048 --batch prefill:8192 \
    --batch decode:64@4096"
  pack
done
t=$(cap 170); echo "== model create, bench decode (${t}s)"  # 60 s cut the create short (call 4)
((t)) && timeout "$t" "${rs[@]}" model create "${FLASH[@]}" --dtype bfloat16 --no-mtp \
  --out /tmp/flash4 2>&1 | tail -1
for c in 1 64; do
  t=$(cap 45)
  ((t)) && [[ -d /tmp/flash4 ]] && timeout "$t" "${rs[@]}" bench decode --model /tmp/flash4 \
    --concurrency $c --context 512 --steps 30 --warmup 5 --kv-cache-memory 8000000000 \
    --output "$R/decode_$c.json" 2>&1 | tail -1
done
pack
t=$(cap 120); echo "== transformers (${t}s)"
((t)) && [[ -d /tmp/flash4 ]] && timeout "$t" python3 benchmarks/hf_decode.py \
  --model /tmp/flash4 --batch 1,64 --context 512 --output "$R/hf_decode.json" 2>&1 | tail -2
python3 benchmarks/hf_ratio.py "$R" 1 64
pack
echo "== done in ${SECONDS}s"
