#!/usr/bin/env bash
# Sliding-window block tables as rings (issue 14) on the GPU, in one device call: the ring
# tests on CUDA (ring vs linear tables: bitwise logits), bench forward with CUDA graphs at
# long context (the ring indexing runs inside the graph), the GPU fast-path tests that go
# through the runner's device tables, and the table memory note.
# Results in $OUT. Usage: bash benchmarks/gpu_ring.sh
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
rs=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
FLASH=(--preset v4-flash --layers 4 --experts 64 --iters 20 --warmup 3)
echo "== table memory (host arithmetic)"
python3 benchmarks/ring_tables.py | tee "$OUT/ring_tables.txt"
echo "== bench forward, CUDA graphs over ring tables"
timeout 150 "${rs[@]}" bench forward "${FLASH[@]}" --batch decode:1@4096 --batch decode:64@4096 \
  --batch decode:256@4096 --batch decode:64@65536 --batch prefill:8192@65536 \
  --output "$OUT/forward_ring.json" 2>&1 | grep -E "^(decode|prefill)|Error|error" | tail -8
echo "== GPU tests through the runner's device tables"
timeout 300 python3 -m pytest -q -x -p no:cacheprovider -m "gpu or not slow" \
  tests/runner/test_ring_tables.py tests/runner/test_cuda_graph.py \
  tests/model/test_gpu_fastpath.py 2>&1 | tee "$OUT/pytest.log" \
  | grep -E "passed|failed|FAILED|Error" | tail -12
