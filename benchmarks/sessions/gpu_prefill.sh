#!/usr/bin/env bash
# Prefill and mixed steps in one device call (GPU fast path M3): bench forward, the prefill
# profile and the GPU-marked tests. Results in $OUT. Usage: bash benchmarks/sessions/gpu_prefill.sh
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
source "$(dirname "$0")/../device_env.sh"
RS=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
echo "== bench forward (prefill, mixed)"
timeout 150 "${RS[@]}" bench forward --preset v4-flash --layers 4 --experts 64 --iters 10 \
  --warmup 2 --batch prefill:2048 --batch prefill:8192 --batch prefill:8192@65536 \
  --batch mixed:2048@8192+64@4096 --output "$OUT/forward_prefill.json" 2>&1 \
  | grep -E "^(prefill|mixed)|Error"
echo "== profile prefill:8192"
timeout 80 python3 benchmarks/profile_forward.py --batch prefill:8192 --top 25 \
  --output "$OUT/profile_prefill.json" 2>&1 | grep -v -i warn | head -30
echo "== GPU tests"
timeout 230 python3 -m pytest -q -p no:cacheprovider -m gpu "${@:-tests/ops}" \
  tests/model/test_gpu_fastpath.py tests/model/test_chunking_gpu.py 2>&1 \
  | tee "$OUT/pytest.log" | grep -E "passed|failed|FAILED" | tail -12
