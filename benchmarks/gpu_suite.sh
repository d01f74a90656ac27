#!/usr/bin/env bash
# One device call: GPU tests, bench forward (fast and reference), bench decode and
# transformers' decode on the same checkpoint. Results land in $OUT (or ./out/gpu).
# Usage (repo root, on the GPU machine): bash benchmarks/gpu_suite.sh [quick]
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
rs() { python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))' "$@"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)' | tee -a "$OUT/env.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/env.txt"

echo "== GPU tests"
timeout 900 python3 -m pytest -q -m gpu -p no:cacheprovider tests/model/test_gpu.py \
  tests/model/test_gpu_fastpath.py tests/ops 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15

FLASH=(--preset v4-flash --layers 4 --experts 64)
echo "== bench forward (fast)"
rs bench forward "${FLASH[@]}" --impl fast --iters 20 --warmup 3 \
  --batch decode:1@4096 --batch decode:64@4096 --batch decode:64@512 --batch decode:256@4096 \
  --batch prefill:2048 --batch prefill:8192 --output "$OUT/forward_fast.json" 2>&1 | tail -8
echo "== bench forward (reference kernels, eager)"
rs bench forward "${FLASH[@]}" --impl reference --iters 5 --warmup 1 \
  --batch decode:1@4096 --batch decode:64@4096 --batch prefill:8192 \
  --output "$OUT/forward_reference.json" 2>&1 | tail -4
[[ "${1:-}" == quick ]] && exit 0

echo "== checkpoint for bench decode + transformers"
rs model create "${FLASH[@]}" --dtype bfloat16 --no-mtp --out /tmp/flash4 2>&1 | tail -1
for c in 1 64; do
  rs bench decode --model /tmp/flash4 --concurrency $c --context 512 --steps 30 --warmup 5 \
    --kv-cache-memory 8000000000 --output "$OUT/decode_$c.json" 2>&1 | tail -1
done
python3 benchmarks/hf_decode.py --model /tmp/flash4 --batch 1,64 --context 512 \
  --output "$OUT/hf_decode.json" 2>&1 | tail -2
python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
hf = {r["batch"]: r["step_ms"] for r in json.loads((out / "hf_decode.json").read_text())}
for c in (1, 64):
    d = json.loads((out / f"decode_{c}.json").read_text())
    print(f"decode x{c} @512: engine step {d['median_step_ms']:.2f} ms, transformers "
          f"{hf[c]:.2f} ms -> {hf[c] / d['median_step_ms']:.1f}x")
PY
