#!/usr/bin/env bash
# Session 8's last device call (~4.5 minutes), issue 12's launch count: the GPU tests of the
# kernels that changed (mHC posts summing the MoE's slots, the indexer's selecting top-k,
# the deferred MoE sum), launches per layer (profiler) and bench forward at decode 1 / 64 /
# 256, then the fast path's GPU model tests with what is left.
# Every file goes into $OUT/s8e.tgz, refreshed after each section.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s8e.sh      (BUDGET_S: total seconds)
set -uo pipefail
OUT=${OUT:-out/gpu}
R="$OUT/r"
mkdir -p "$R"
BUDGET_S=${BUDGET_S:-260}
source "$(dirname "$0")/../device_env.sh"
rs=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
FLASH=(--preset v4-flash --layers 4 --experts 64)
pack() { tar czf "$OUT/s8e.tgz" -C "$OUT" r; }
echo "commit ${RACKSERVE_COMMIT:-unknown}" | tee "$R/commit.txt"

t=$(cap 75); echo "== GPU tests of the changed kernels (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -p no:cacheprovider -n 2 -m "gpu or not gpu" -rf \
  tests/ops/test_mhc.py tests/ops/test_indexer.py tests/ops/test_moe_routed.py 2>&1 \
  | tee "$R/pytest_kernels.log" | tail -4
pack

t=$(cap 60); echo "== launches per layer (${t}s)"
((t)) && timeout "$t" python3 benchmarks/profile_forward.py --batch decode:1@4096 \
  --batch decode:64@4096 --batch decode:256@4096 --top 30 --output "$R/profile.json" 2>&1 \
  | grep -E "^==|launch|layer|Error" | head -20
pack

t=$(cap 60); echo "== bench forward (${t}s)"
((t)) && timeout "$t" "${rs[@]}" bench forward "${FLASH[@]}" --iters 20 --warmup 3 \
  --batch decode:1@4096 --batch decode:64@4096 --batch decode:256@4096 \
  --output "$R/forward.json" 2>&1 | grep -E "^decode|Error"
pack

t=$(cap 200); echo "== fast-path model GPU tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -p no:cacheprovider -n 2 -m gpu -rf \
  tests/model/test_gpu_fastpath.py 2>&1 | tee "$R/pytest_model.log" \
  | grep -E "passed|failed|FAILED|Error|median|agreement" | tail -12
pack
echo "== done in ${SECONDS}s"
