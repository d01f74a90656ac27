#!/usr/bin/env bash
# Session 10's prepared call (~5.5 minutes): two mHC changes at prefill sizes, off by
# default until this call times them: the finish as two launches (Tiling.mixes_block_t) and
# K1's bf16x3 dots (gemm_precision). The mHC GPU tests (both against the reference), then
# mhc_bench at 64, 2048 and 8192 tokens (its "mixes*" and "bf16x3" variants against the
# default), then bench forward of the prefill cases and decode:64 three times: as now, with
# K2 split from 1024 tokens, and with both (module constants set in-process).
# Every file goes into $OUT/s10a.tgz, refreshed after each section.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s10a.sh     (BUDGET_S: total seconds)
set -uo pipefail
OUT=${OUT:-out/gpu}
R="$OUT/r"
mkdir -p "$R"
BUDGET_S=${BUDGET_S:-330}
source "$(dirname "$0")/../device_env.sh"
pack() { tar czf "$OUT/s10a.tgz" -C "$OUT" r; }
echo "commit ${RACKSERVE_COMMIT:-unknown}" | tee "$R/commit.txt"
forward() {  # $1: MIXES_APART_MIN_TOKENS ("none": off), $2: BF16_DOT_PRECISION, $3: name
  python3 -c "import sys, rackserve.ops.triton.mhc as m
m.MIXES_APART_MIN_TOKENS = None if sys.argv[1] == 'none' else int(sys.argv[1])
m.BF16_DOT_PRECISION = sys.argv[2]
from rackserve.cli import main; sys.exit(main(sys.argv[3:]))" "$1" "$2" bench forward \
    --preset v4-flash --layers 4 --experts 64 --iters 10 --warmup 2 --batch prefill:2048 \
    --batch prefill:8192 --batch prefill:8192@65536 --batch decode:64@4096 \
    --output "$R/$3.json" 2>&1 | grep -E "^prefill|^decode|Error"
}

t=$(cap 70); echo "== mHC GPU tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -v -p no:cacheprovider -m "gpu or not gpu" -rf \
  tests/ops/test_mhc.py -k "mixes_apart or bf16x3 or v4_flash or graph" > "$R/pytest_mhc.log" 2>&1
grep -E "PASSED|FAILED|ERROR" "$R/pytest_mhc.log" | awk '{print $2}' | sort | uniq -c
grep -E "^E  " "$R/pytest_mhc.log" | head -6
pack
t=$(cap 70); echo "== mhc_bench 64, 2048, 8192 tokens (${t}s)"
((t)) && timeout "$t" python3 benchmarks/mhc_bench.py --tokens 64 2048 8192 \
  --output "$R/mhc_bench.json" 2>&1 | grep -E "hc_pre|hc_post_pre|Error" | head -40
pack
for v in "none tf32x3 forward_as_now" "1024 tf32x3 forward_mixes_apart" \
         "1024 bf16x3 forward_mixes_apart_bf16x3"; do
  set -- $v
  t=$(cap 55); echo "== forward, MIXES_APART_MIN_TOKENS=$1 BF16_DOT_PRECISION=$2 (${t}s)"
  ((t)) && timeout "$t" bash -c "$(declare -f forward); R=$R; forward $1 $2 $3"
  pack
done
echo "== done in ${SECONDS}s"
