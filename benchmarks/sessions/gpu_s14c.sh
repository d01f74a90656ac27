#!/usr/bin/env bash
# Session 14, call 3 (~4 minutes), issue 13: bench forward with the prefill attention kernel
# (bf16 p, 64-row tiles) from 512 queries, the new default, against the split-KV decode
# kernel at every size (the default of sessions 9-13), alternating; then the GPU tests that
# hold the new default to the bf16 rule (V4-Flash sizes) and to chunking invariance.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s14c.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-330}
source "$(dirname "$0")/../device_env.sh"
start_call
forward() {  # $1: PREFILL_ATTENTION_MIN_TOKENS (None: the decode kernel), $2: output name
  timeout "$(cap 70)" python3 -c "import sys, rackserve.ops as o
o.PREFILL_ATTENTION_MIN_TOKENS = eval(sys.argv[1])
from rackserve.cli import main; sys.exit(main(sys.argv[2:]))" "$1" bench forward \
    --preset v4-flash --layers 4 --experts 64 --iters 10 --warmup 2 --batch prefill:2048 \
    --batch prefill:8192 --batch prefill:8192@65536 --batch decode:64@4096 \
    --output "$R/$2.json" 2>&1 | grep -E "^prefill|^decode|Error"
}
echo "== forward, prefill kernel from 512 queries (default)"; forward 512 forward_prefill_a
echo "== forward, decode kernel at every size"; forward None forward_decode_a
echo "== forward, prefill kernel from 512 queries (default)"; forward 512 forward_prefill_b
t=$(cap 150); echo "== GPU tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -p no:cacheprovider -m gpu -rf \
  tests/ops/test_prefill_attn.py tests/model/test_chunking_gpu.py 2>&1 \
  | tee "$R/pytest_gpu.log" | grep -E "^FAILED|passed|failed" | tail -8
grep -E "^E  " "$R/pytest_gpu.log" | head -8
echo "== done in ${SECONDS}s"
