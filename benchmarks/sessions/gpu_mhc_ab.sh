#!/usr/bin/env bash
# The one-launch mHC (RACKSERVE_MHC_FUSED=1) against the two-launch default at batch 1-4,
# alternating processes (run-to-run spread at decode:1 was ~7% this session), then the
# GPU tests that make it a candidate default: mHC ops, graph replay and the fp32 fast path
# with it on; last, the accuracy test that ran out of memory beside another worker.
# Results in $OUT/mhc_ab.tgz.   Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_mhc_ab.sh
set -uo pipefail
OUT=${OUT:-out/gpu}
R="$OUT/r"
mkdir -p "$R"
source "$(dirname "$0")/../device_env.sh"
rs=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
FLASH=(--preset v4-flash --layers 4 --experts 64)
B=(--batch decode:1@4096 --batch decode:2@4096 --batch decode:4@4096)
pack() { tar czf "$OUT/mhc_ab.tgz" -C "$OUT" r; }
echo "commit ${RACKSERVE_COMMIT:-unknown}" | tee "$R/commit.txt"
for round in 1 2; do
  for f in 0 1; do
    echo "== round $round RACKSERVE_MHC_FUSED=$f"
    RACKSERVE_MHC_FUSED=$f timeout 45 "${rs[@]}" bench forward "${FLASH[@]}" --iters 30 \
      --warmup 5 "${B[@]}" --output "$R/forward_f${f}_r$round.json" 2>&1 | grep -E "^decode|Error"
  done
done
pack
echo "== GPU tests with the one-launch mHC"
RACKSERVE_MHC_FUSED=1 timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -rf \
  tests/ops/test_mhc.py tests/model/test_gpu_fastpath.py -k "mhc or graph_replay or fp32_fast_path" \
  2>&1 | tee "$R/pytest_fused.log" | grep -E "passed|failed|FAILED|Error" | tail -8
pack
echo "== accuracy against fp32 (alone)"
timeout 90 python3 -m pytest -q -s -p no:cacheprovider -m gpu -rf tests/model/test_gpu_fastpath.py \
  -k no_less_accurate 2>&1 | tee "$R/pytest_accuracy.log" | grep -E "passed|failed|fast vs fp32|Error" | tail -5
pack
echo "== done in ${SECONDS}s"
