#!/usr/bin/env bash
# DEP on nvidia-h200-x2 in one device call (issue 16's GPU section): DEP2 over NCCL greedy
# tokens vs one GPU, dispatch/combine latency and bandwidth vs tokens per rank (128..8192),
# v4-flash decode at 64 requests per GPU DEP1 vs DEP2 with the step split, EPLB under skewed
# routing (balancedness before/after, slowest step while weights move vs the median), and the
# whole V4-Flash in FP8/FP4 built with its experts split over the two GPUs (issue 20's memory:
# bytes allocated per GPU against the count from the parameters; 148.6 GiB on one device).
# Results: $OUT/dep.json (written after every part) and $OUT/gpu_dep.log; ~6-8 minutes.
#   run: bash benchmarks/gpu_dep.sh            (2 GPUs)
#   CPU smoke (gloo, tiny sizes, ~2 min): OUT=/tmp/dep bash benchmarks/gpu_dep.sh --smoke
set -uo pipefail
OUT=${OUT:-out/gpu_dep}
mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the lent machines
PY=${PYTHON:-python3}
if [[ " $* " != *" --smoke "* ]]; then
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
fi
timeout 480 "$PY" benchmarks/gpu_dep.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_dep.log" \
  | grep -vE "^KV cache:|UserWarning|warnings.warn"
rc=${PIPESTATUS[0]}
echo "gpu_dep exit $rc; results in $OUT/dep.json"
exit "$rc"
