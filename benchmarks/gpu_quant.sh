#!/usr/bin/env bash
# One device call for issue 20 (FP8 linears, FP4 experts): the quantized kernels' tests on
# the GPU (interpreter tests run there too, plus the `gpu` ones), bench forward of the
# v4-flash preset (4 layers, 64 experts) bf16 vs FP8 + FP4 experts, the kernels'
# microbenchmarks and the weight memory. JSON under $OUT. Fits one 600 s device call.
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1
RS=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
BATCHES=(--batch decode:1@4096 --batch decode:8@4096 --batch decode:64@4096
  --batch decode:256@4096 --batch prefill:2048)
echo "== quantized kernel + model GPU tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" \
  tests/ops/test_fp8_gemm.py tests/ops/test_fp4_moe.py tests/model/test_quant_gpu.py \
  2>&1 | tee "$OUT/pytest_quant.log" | tail -12
echo "== bench forward bf16"
timeout 110 "${RS[@]}" bench forward --preset v4-flash --layers 4 --experts 64 --iters 20 \
  --warmup 3 "${BATCHES[@]}" --output "$OUT/forward_bf16.json" 2>&1 | tail -6
echo "== bench forward fp8 + fp4 experts"
timeout 130 "${RS[@]}" bench forward --preset v4-flash --layers 4 --experts 64 --iters 20 \
  --warmup 3 --quantization fp8 --expert-dtype fp4 "${BATCHES[@]}" \
  --output "$OUT/forward_fp8_fp4.json" 2>&1 | tail -6
echo "== kernels (fp8 GEMM, fp4 MoE vs bf16) and weight memory"
timeout 190 python3 benchmarks/quant_bench.py --output "$OUT/quant_bench.json" 2>&1 | tail -80
