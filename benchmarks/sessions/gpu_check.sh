#!/usr/bin/env bash
# A mid-session check of merged kernel work in one device call: the GPU-marked tests, bench
# forward (default kernels, then the wide sparse-attention variant) and the launch profile.
# Results in $OUT. Usage: bash benchmarks/sessions/gpu_check.sh
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
source "$(dirname "$0")/../device_env.sh"
RS=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
FLASH=(--preset v4-flash --layers 4 --experts 64 --iters 20 --warmup 3)
echo "== bench forward"
timeout 120 "${RS[@]}" bench forward "${FLASH[@]}" --batch decode:1@4096 --batch decode:64@4096 \
  --batch decode:256@4096 --batch prefill:2048 --batch prefill:8192 \
  --output "$OUT/forward.json" 2>&1 | grep -E "^(decode|prefill)|Error|error" | tail -8
echo "== bench forward, wide sparse attention"
RACKSERVE_SPARSE_ATTN=wide timeout 80 "${RS[@]}" bench forward "${FLASH[@]}" \
  --batch decode:64@4096 --batch decode:256@4096 --output "$OUT/forward_wide.json" 2>&1 \
  | grep -E "^(decode|prefill)|Error|error" | tail -4
echo "== profile"
timeout 90 python3 benchmarks/profile_forward.py --batch decode:1@4096 --batch decode:64@4096 \
  --batch decode:256@4096 --batch prefill:8192 --top 30 --output "$OUT/profile.json" 2>&1 \
  | grep -E "^==|Error" | tail -8
echo "== GPU tests"
timeout 220 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/ops \
  tests/model/test_gpu_fastpath.py tests/model/test_chunking_gpu.py 2>&1 \
  | tee "$OUT/pytest.log" | grep -E "passed|failed|FAILED|Error" | tail -12
