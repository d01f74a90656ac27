#!/usr/bin/env bash
# Session 9's short last call (~3 minutes): the mHC kernels' GPU tests (named failures),
# then bench forward of the prefill cases twice: the prefill attention kernel from 512
# queries (the default) and the decode kernel at every size (PREFILL_ATTENTION_MIN_TOKENS
# raised in-process), to pick the attention's threshold from measurement.
# Every file goes into $OUT/s9d.tgz, refreshed after each section.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s9d.sh      (BUDGET_S: total seconds)
set -uo pipefail
OUT=${OUT:-out/gpu}
R="$OUT/r"
mkdir -p "$R"
BUDGET_S=${BUDGET_S:-190}
source "$(dirname "$0")/../device_env.sh"
pack() { tar czf "$OUT/s9d.tgz" -C "$OUT" r; }
echo "commit ${RACKSERVE_COMMIT:-unknown}" | tee "$R/commit.txt"
forward() {  # $1: PREFILL_ATTENTION_MIN_TOKENS, $2: output name
  python3 -c "import sys, rackserve.ops as o; o.PREFILL_ATTENTION_MIN_TOKENS = int(sys.argv[1])
from rackserve.cli import main; sys.exit(main(sys.argv[2:]))" "$1" bench forward \
    --preset v4-flash --layers 4 --experts 64 --iters 10 --warmup 2 --batch prefill:2048 \
    --batch prefill:8192 --batch prefill:8192@65536 --output "$R/$2.json" 2>&1 \
    | grep -E "^prefill|Error"
}

t=$(cap 75); echo "== mHC GPU tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -p no:cacheprovider -n 2 -m "gpu or not gpu" -rf \
  tests/ops/test_mhc.py 2>&1 | tee "$R/pytest_mhc.log" | grep -E "^FAILED|passed|failed" | tail -8
grep -E "^E  " "$R/pytest_mhc.log" | head -6
pack
t=$(cap 50); echo "== forward, prefill attention kernel from 512 queries (${t}s)"
((t)) && timeout "$t" bash -c "$(declare -f forward); R=$R; forward 512 forward_prefill_kernel"
pack
t=$(cap 50); echo "== forward, decode attention kernel at every size (${t}s)"
((t)) && timeout "$t" bash -c "$(declare -f forward); R=$R; forward 1073741824 forward_decode_kernel"
pack
echo "== done in ${SECONDS}s"
