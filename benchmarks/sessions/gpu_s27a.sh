#!/usr/bin/env bash
# Session 27, call 1 (~9.5 minutes; written in session 26, whose five calls all ran on an
# H100): issue 13 and 14's gates on whatever card comes (they are set on an H200; the card
# is in every record), with session 26's defaults (hc_post_pre's expand apart and the wgmma
# attention from 128 tokens): the bf16 accuracy gates (the no-less-accurate one needs more
# than the H100's 80 GB), every gate in bench forward, the decode step against transformers,
# step minus forward at 256 requests (async).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s27a.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-585}
source "$(dirname "$0")/../device_env.sh"
start_call
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$R/gpu.txt"
gates
decode_vs_transformers
t=$(cap 45); echo "== bench decode, 256 requests, async: step minus forward (${t}s)"
((t)) && [[ -d /tmp/flash4 ]] && timeout "$t" "${rs[@]}" bench decode --model /tmp/flash4 \
  --concurrency 256 --context 512 --steps 30 --warmup 5 --kv-cache-memory 8000000000 \
  --async-scheduling --output "$R/decode_256_async.json" 2>&1 | tail -1
ls "$R"; (cd "$OUT" && tar czf s27a.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
