#!/usr/bin/env bash
# The gates in one device call: GPU correctness tests of the fast path, bench forward, and
# bench decode vs transformers at 64 requests on the same checkpoint. Results in $OUT.
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
source "$(dirname "$0")/../device_env.sh"
RS=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
echo "== fast-path gates"
timeout 200 python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/model/test_gpu_fastpath.py \
  2>&1 | tee "$OUT/pytest.log" | grep -E "relative|passed|failed|Error|assert" | tail -12
echo "== bench forward"
timeout 90 "${RS[@]}" bench forward --preset v4-flash --layers 4 --experts 64 --iters 20 \
  --warmup 3 --batch decode:1@4096 --batch decode:64@4096 --batch decode:256@4096 \
  --batch prefill:8192 --output "$OUT/forward.json" 2>&1 | tail -4
echo "== bench decode vs transformers"
timeout 60 "${RS[@]}" model create --preset v4-flash --layers 4 --experts 64 --dtype bfloat16 \
  --no-mtp --out /tmp/flash4 2>&1 | tail -1
timeout 60 "${RS[@]}" bench decode --model /tmp/flash4 --concurrency 64 --context 512 --steps 30 \
  --warmup 5 --kv-cache-memory 8000000000 --output "$OUT/decode_64.json" 2>&1 | tail -1
timeout 60 python3 benchmarks/hf_decode.py --model /tmp/flash4 --batch 64 --context 512 \
  --output "$OUT/hf_decode.json" 2>&1 | tail -1
