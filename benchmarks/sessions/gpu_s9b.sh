#!/usr/bin/env bash
# Session 9's second device call (~8 minutes), issue 13 after the one-program prefill
# attention and the mHC's expansion apart at many tokens: bench forward (prefill and decode),
# the prefill profile, the mHC kernels at 8192 tokens, the prefill attention at 8192 queries
# against its old default, then the GPU tests of those kernels, the chunked-prefill test
# and the fast path's model tests with what is left.
# Every file goes into $OUT/s9b.tgz, refreshed after each section.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s9b.sh      (BUDGET_S: total seconds)
set -uo pipefail
OUT=${OUT:-out/gpu}
R="$OUT/r"
mkdir -p "$R"
BUDGET_S=${BUDGET_S:-480}
source "$(dirname "$0")/../device_env.sh"
rs=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
FLASH=(--preset v4-flash --layers 4 --experts 64)
pack() { tar czf "$OUT/s9b.tgz" -C "$OUT" r; }
echo "commit ${RACKSERVE_COMMIT:-unknown}" | tee "$R/commit.txt"

t=$(cap 100); echo "== bench forward (${t}s)"
((t)) && timeout "$t" "${rs[@]}" bench forward "${FLASH[@]}" --iters 10 --warmup 2 \
  --batch prefill:2048 --batch prefill:8192 --batch prefill:8192@65536 \
  --batch decode:1@4096 --batch decode:64@4096 --batch decode:256@4096 \
  --output "$R/forward.json" 2>&1 | grep -E "^(prefill|decode)|Error"
pack

t=$(cap 50); echo "== profile prefill:8192 (${t}s)"
((t)) && timeout "$t" python3 benchmarks/profile_forward.py --batch prefill:8192 --top 30 \
  --output "$R/profile_prefill.json" 2>&1 | grep -v -i warn | head -34
pack

t=$(cap 60); echo "== mhc at 8192 tokens (${t}s)"
((t)) && timeout "$t" python3 -c "
import json, sys; sys.path.insert(0, 'benchmarks')
from mhc_bench import run
r = run(tokens=(8192,)); json.dump(r, open('$R/mhc_8192.json', 'w'), indent=1)
for x in r: print(x['op'], x['impl'], round(x['time_us'], 1), round(x['gb_per_s'], 1), x.get('max_abs_err'))
" 2>&1 | grep -v -i warn | tail -40
pack

t=$(cap 70); echo "== prefill attention at 8192 queries (${t}s)"
((t)) && timeout "$t" python3 -c "
import json, sys; sys.path.insert(0, 'benchmarks')
from prefill_bench import run_attention
r = run_attention(cases=((8192, 0), (8192, 65536))); json.dump(r, open('$R/prefill_attn.json', 'w'), indent=1)
for x in r: print(x['layer'], x['cached'], x['impl'], round(x.get('time_us', -1), 1), round(100 * x.get('peak_fraction', 0), 1), x.get('error', ''))
" 2>&1 | grep -v -i warn | tail -20
pack

t=$(cap 110); echo "== GPU tests of the kernels and chunked prefill (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -p no:cacheprovider -n 2 -m "gpu or not gpu" -rf \
  tests/ops/test_prefill_attn.py tests/ops/test_mhc.py tests/model/test_chunking_gpu.py 2>&1 \
  | tee "$R/pytest_kernels.log" | grep -E "FAILED|passed|failed" | tail -12
pack

t=$(cap 200); echo "== fast-path model GPU tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -p no:cacheprovider -n 2 -m gpu -rf \
  tests/model/test_gpu_fastpath.py 2>&1 | tee "$R/pytest_model.log" \
  | grep -E "passed|failed|FAILED|Error|median|agreement" | tail -12
pack
echo "== done in ${SECONDS}s"
