#!/usr/bin/env bash
# The host KV pool's GPU path (issue 19) in one device call: pinned host buffers and
# side-stream copies both ways, byte-exact round trip and engine outputs equal to a cache
# that keeps everything (the gpu-marked tests of tests/kv/test_offload*.py).
# Results in $OUT. Usage: bash benchmarks/gpu_kvpool.sh
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
echo "== GPU tests: KV pool"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/kv/test_offload.py \
  tests/kv/test_offload_engine.py 2>&1 | tee "$OUT/kvpool_pytest.log" \
  | grep -E "passed|failed|FAILED|Error" | tail -12
