#!/usr/bin/env bash
# One device call for issue 20 (FP8 linears, FP4 experts, FP8 KV cache): the quantized
# kernels' tests on the GPU (interpreter tests run there too, plus the `gpu` ones), bench
# forward of the v4-flash preset (4 layers, 64 experts) bf16 vs FP8 + FP4 experts vs bf16
# with --kv-cache-dtype fp8 (decode), the fp8-KV kernels' bytes / time and logit error, the
# quantized kernels' microbenchmarks and the weight memory. JSON under $OUT.
#
#   bash benchmarks/gpu_quant.sh                      # GPU: every section
#   SECTIONS="kv_forward kv_bench" bash ...           # a subset (to split over two calls)
#   SMOKE=1 bash benchmarks/gpu_quant.sh              # CPU: every step at tiny sizes (minutes)
#
# Sections: tests, forward_bf16, forward_fp4, kv_forward, kv_bench, quant_bench. Their
# timeouts (ceilings) add up to 790 s: under a 600 s call limit, run it as two calls, e.g.
# SECTIONS="tests forward_bf16 forward_fp4" then SECTIONS="kv_forward kv_bench quant_bench".
set -uo pipefail
OUT=${OUT:-out/gpu}
SMOKE=${SMOKE:-0}
SECTIONS=${SECTIONS:-tests forward_bf16 forward_fp4 kv_forward kv_bench quant_bench}
mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
PY=${PYTHON:-python3}
RS=("$PY" -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
if [ "$SMOKE" = 1 ]; then  # CPU: the reference ops / the Triton interpreter, tiny sizes
  export TRITON_INTERPRET=1
  MODEL=(--preset tiny --device cpu --dtype float32 --iters 1 --warmup 0)
  BATCHES=(--batch decode:2@64 --batch prefill:32)
  DECODE=(--batch decode:2@64)
  TESTS=(tests/ops/test_kv_fp8.py tests/moe/test_ep_fp4.py)
  KV_BENCH=(--smoke)
  LONG=4  # the interpreter on a shared CPU: every timeout x4
else
  MODEL=(--preset v4-flash --layers 4 --experts 64 --iters 20 --warmup 3)
  BATCHES=(--batch decode:1@4096 --batch decode:8@4096 --batch decode:64@4096
    --batch decode:256@4096 --batch prefill:2048)
  DECODE=(--batch decode:1@4096 --batch decode:8@4096 --batch decode:64@4096
    --batch decode:256@4096)
  TESTS=(tests/ops/test_fp8_gemm.py tests/ops/test_fp4_moe.py tests/model/test_quant_gpu.py
    tests/ops/test_kv_fp8.py)
  KV_BENCH=()
  LONG=1
fi
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
if want tests; then
  echo "== quantized kernel + model tests"
  timeout $((150 * LONG)) "$PY" -m pytest -q -p no:cacheprovider -m "gpu or not gpu" \
    "${TESTS[@]}" 2>&1 | tee "$OUT/pytest_quant.log" | tail -12
fi
if want forward_bf16; then
  echo "== bench forward bf16"
  timeout $((110 * LONG)) "${RS[@]}" bench forward "${MODEL[@]}" "${BATCHES[@]}" \
    --output "$OUT/forward_bf16.json" 2>&1 | tail -6
fi
if want forward_fp4; then
  echo "== bench forward fp8 + fp4 experts"
  timeout $((130 * LONG)) "${RS[@]}" bench forward "${MODEL[@]}" --quantization fp8 \
    --expert-dtype fp4 "${BATCHES[@]}" --output "$OUT/forward_fp8_fp4.json" 2>&1 | tail -6
fi
if want kv_forward; then
  echo "== bench forward bf16, --kv-cache-dtype fp8 (decode; compare forward_bf16.json)"
  timeout $((90 * LONG)) "${RS[@]}" bench forward "${MODEL[@]}" --kv-cache-dtype fp8 \
    "${DECODE[@]}" --output "$OUT/forward_bf16_kvfp8.json" 2>&1 | tail -5
fi
if want kv_bench; then
  echo "== fp8 KV: attention / indexer kernels vs bf16 caches, logit error of the model"
  timeout $((120 * LONG)) "$PY" benchmarks/kv_fp8_bench.py "${KV_BENCH[@]}" \
    --output "$OUT/kv_fp8_bench.json" 2>&1 | tail -24
fi
if want quant_bench; then
  if [ "$SMOKE" = 1 ]; then
    echo "== quant_bench: needs CUDA (do_bench, device memory): skipped in SMOKE"
  else
    echo "== kernels (fp8 GEMM, fp4 MoE vs bf16) and weight memory"
    timeout $((190 * LONG)) "$PY" benchmarks/quant_bench.py --output "$OUT/quant_bench.json" \
      2>&1 | tail -80
  fi
fi
