#!/usr/bin/env bash
# Session 15, call 2 (~6 minutes): issue 12's launches per decoder layer. The split-K GEMV's
# one-launch reduce is now the default where the GEMV splits K (cuBLAS's split-K takes a
# second launch, splitKreduce_kernel: the launches over 20 per layer). Its GPU tests; the
# GEMV against cuBLAS at 1..64 tokens (graph time); launches per layer and bench forward with
# the GEMV below 16 tokens (the default), below 65, and off.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s15b.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-420}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 60); echo "== GPU tests of the GEMV (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m gpu tests/ops/test_gemv.py -p no:cacheprovider \
  2>&1 | tail -3 | tee "$R/pytest_gpu.log"
t=$(cap 70); echo "== GEMV against cuBLAS (${t}s)"
((t)) && timeout "$t" python3 benchmarks/gemv_bench.py --no-sweep --tokens 1,8,16,32,64 \
  --shapes x_proj_hca,x_proj_csa,wo_b --output "$R/gemv_bench.json" 2>&1 | grep -E "graph|Error"
# python3 /tmp/with_gemv.py LIMIT SCRIPT ARGS: SCRIPT run with the GEMV below LIMIT tokens
cat > /tmp/with_gemv.py <<'PY'
import os, runpy, sys
os.environ["RACKSERVE_GEMV"] = "1" if int(sys.argv[1]) > 0 else "0"
import rackserve.ops as ops
ops.GEMV_MAX_TOKENS = int(sys.argv[1])
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
PY
for limit in 16 65 0; do
  t=$(cap 60); echo "== launches per layer, GEMV below $limit tokens (${t}s)"
  ((t)) && timeout "$t" python3 /tmp/with_gemv.py $limit benchmarks/profile_forward.py --batch decode:1@4096 \
    --batch decode:64@4096 --batch decode:256@4096 --top 12 --output "$R/profile_$limit.json" \
    2>&1 | grep -E "^==|launch|Error"
done
for limit in 16 65 0 16; do
  t=$(cap 50); echo "== bench forward, GEMV below $limit tokens (${t}s)"
  ((t)) && timeout "$t" python3 /tmp/with_gemv.py $limit src/rackserve/cli.py bench forward --preset v4-flash \
    --layers 4 --experts 64 --iters 20 --warmup 3 --batch decode:1@4096 \
    --batch decode:64@4096 --batch decode:256@4096 --output "$R/forward_${limit}_$SECONDS.json" \
    2>&1 | grep -E "^decode|Error"
done
echo "== done in ${SECONDS}s"
