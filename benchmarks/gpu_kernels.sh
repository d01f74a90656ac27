#!/usr/bin/env bash
# One device call for kernel work: every op test on the GPU (interpreter tests run there
# too), bench forward, a profile and every kernel microbenchmark. Results in $OUT.
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
RS=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
echo "== op + model GPU tests"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/ops \
  tests/model/test_gpu_fastpath.py 2>&1 | tee "$OUT/pytest.log" | tail -12
echo "== bench forward (fast)"
timeout 240 "${RS[@]}" bench forward --preset v4-flash --layers 4 --experts 64 --iters 20 --warmup 3 \
  --batch decode:1@4096 --batch decode:64@4096 --batch decode:256@4096 --batch decode:64@512 \
  --batch prefill:2048 --batch prefill:8192 --output "$OUT/forward.json" 2>&1 | tail -6
echo "== profile"
timeout 120 python3 benchmarks/profile_forward.py --batch decode:1@4096 --batch decode:64@4096 \
  --top 14 --output "$OUT/profile.json" 2>&1 | grep -v -i warn | tail -32
[[ "${1:-}" == nobench ]] && exit 0
echo "== kernels"
timeout 300 python3 benchmarks/all_kernels.py --output "$OUT/kernels.json" > "$OUT/kernels.txt" 2>&1
grep -v "tiling\|variant" "$OUT/kernels.txt" | tail -40
