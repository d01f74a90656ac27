#!/usr/bin/env bash
# Session 9's last device call (~7.5 minutes): the GPU tests of the prefill attention and
# mHC kernels (named failures), bench forward with the fp16-PV one-program prefill attention
# (prefill and decode), its tilings at 8192 queries, then the chunked-prefill test and the
# fast path's model tests one process at a time (two processes ran out of memory in s9b).
# Every file goes into $OUT/s9c.tgz, refreshed after each section.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s9c.sh      (BUDGET_S: total seconds)
set -uo pipefail
OUT=${OUT:-out/gpu}
R="$OUT/r"
mkdir -p "$R"
BUDGET_S=${BUDGET_S:-450}
source "$(dirname "$0")/../device_env.sh"
rs=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
FLASH=(--preset v4-flash --layers 4 --experts 64)
pack() { tar czf "$OUT/s9c.tgz" -C "$OUT" r; }
echo "commit ${RACKSERVE_COMMIT:-unknown}" | tee "$R/commit.txt"

t=$(cap 100); echo "== GPU tests of the kernels (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -p no:cacheprovider -n 2 -m "gpu or not gpu" -rf \
  tests/ops/test_prefill_attn.py tests/ops/test_mhc.py 2>&1 \
  | tee "$R/pytest_kernels.log" | grep -E "^FAILED|passed|failed" | tail -16
pack

t=$(cap 80); echo "== bench forward (${t}s)"
((t)) && timeout "$t" "${rs[@]}" bench forward "${FLASH[@]}" --iters 10 --warmup 2 \
  --batch prefill:2048 --batch prefill:8192 --batch prefill:8192@65536 \
  --batch decode:1@4096 --batch decode:64@4096 --batch decode:256@4096 \
  --output "$R/forward.json" 2>&1 | grep -E "^(prefill|decode)|Error"
pack

t=$(cap 50); echo "== prefill attention at 8192 queries (${t}s)"
((t)) && timeout "$t" python3 -c "
import json, sys; sys.path.insert(0, 'benchmarks')
from prefill_bench import run_attention
r = run_attention(cases=((8192, 0),)); json.dump(r, open('$R/prefill_attn.json', 'w'), indent=1)
for x in r: print(x['layer'], x['cached'], x['impl'], round(x.get('time_us', -1), 1), round(100 * x.get('peak_fraction', 0), 1), x.get('error', ''))
" 2>&1 | grep -v -i warn | tail -16
pack

t=$(cap 90); echo "== chunked prefill GPU test (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -p no:cacheprovider -m gpu -rf \
  tests/model/test_chunking_gpu.py 2>&1 | tee "$R/pytest_chunking.log" \
  | grep -E "^FAILED|passed|failed|Error" | tail -6
pack

t=$(cap 220); echo "== fast-path model GPU tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -p no:cacheprovider -m gpu -rf -x \
  tests/model/test_gpu_fastpath.py -k "fp32_fast_path or graph_replay or no_less_accurate" \
  2>&1 | tee "$R/pytest_model.log" | grep -E "^FAILED|passed|failed|Error" | tail -8
pack
echo "== done in ${SECONDS}s"
