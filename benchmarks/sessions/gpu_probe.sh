#!/usr/bin/env bash
# Session-3 first call: where prefill time goes, the bf16 agreement question, the failing
# indexer GPU test, and bench forward at HEAD. Results in $OUT.
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
source "$(dirname "$0")/../device_env.sh"
RS=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
echo "== profile"
timeout 150 python3 benchmarks/profile_forward.py --batch prefill:2048 --batch prefill:8192 \
  --batch decode:1@4096 --batch decode:256@4096 --top 45 --output "$OUT/profile.json" 2>&1 \
  | grep -E "^==" 
echo "== bench forward"
timeout 90 "${RS[@]}" bench forward --preset v4-flash --layers 4 --experts 64 --iters 20 \
  --warmup 3 --batch decode:1@4096 --batch decode:64@4096 --batch decode:256@4096 \
  --batch prefill:2048 --batch prefill:8192 --output "$OUT/forward.json" 2>&1 | tail -7
echo "== indexer gpu test"
timeout 60 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/ops/test_indexer.py \
  -k "v4_flash_sizes" 2>&1 | tail -40 > "$OUT/indexer_test.log"; tail -5 "$OUT/indexer_test.log"
echo "== bf16 agreement"
timeout 200 python3 benchmarks/bf16_agreement.py --contexts 100 600 --steps 64 \
  --output "$OUT/bf16_agreement.json" 2>&1 | tail -4
