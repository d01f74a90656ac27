#!/usr/bin/env bash
# Prepared in session 12 for the next device call (~8 minutes): every headline figure next
# to transformers in one call. 1. bench forward at the M2-M4 gate batches (decode:1 / 64 /
# 256 @4096, prefill:2048, prefill:8192) with the session-12 defaults; 2. bench decode at 1
# and 64 requests and transformers' decode step on the same checkpoint (hf_ratio.py).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s13a.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-540}
source "$(dirname "$0")/../device_env.sh"
start_call
pack() { tar czf "$OUT/s13a.tgz" -C "$OUT" r; }
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)' | tee "$R/env.txt"
t=$(cap 100); echo "== bench forward (${t}s)"
((t)) && timeout "$t" bash -c "$(declare -f forward_with); forward_with pass $R/forward.json \
  --iters 10 --warmup 2 --batch decode:1@4096 --batch decode:64@4096 --batch decode:256@4096 \
  --batch prefill:2048 --batch prefill:8192"
pack
decode_vs_transformers
pack
echo "== done in ${SECONDS}s"
