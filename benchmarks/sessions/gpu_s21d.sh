#!/usr/bin/env bash
# Session 21, call 8 (~4 minutes): the radix top-k (ops/triton/topk.py, merged from the
# topk branch) on the GPU: its GPU tests, the selection alone at S = 8192, E = 2048 / 8192
# (indexer_bench.run_select cut to those shapes), bench forward prefill with the radix
# default against the bitonic levels (one pass each).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s21d.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-290}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 70); echo "== GPU tests: radix top-k (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m gpu tests/ops/test_indexer_topk.py \
  -p no:cacheprovider -rf > "$R/pytest.log" 2>&1
tail -3 "$R/pytest.log"
t=$(cap 90); echo "== selection alone (${t}s)"
((t)) && timeout "$t" python3 -c "import json, sys, indexer_bench as b
b.SELECT_QUERIES, b.SELECT_ENTRIES = (8192,), (2048, 8192)
records = b.run_select()
json.dump(records, open(sys.argv[1], 'w'), indent=1)
for r in records:
    print(r['rows'], r['entries'], r['impl'], round(r['time_us'], 1), r['equal_to_reference'])
" "$R/indexer_select.json"
# default_tiling (ops/triton/indexer_tiling.py) as the decode op and the selection bind it
BITONIC='import rackserve.ops.triton.indexer as ix, rackserve.ops.triton.select_topk as st
for m in (ix, st):
    override(m, "default_tiling", select_algorithm="bitonic", triton_select_max_entries=2048)'
for side in radix bitonic; do
  code=pass; [[ $side == bitonic ]] && code=$BITONIC
  echo "== bench forward, $side"
  forward_with "$code" "$R/forward_$side.json" --iters 8 --warmup 2 --batch prefill:8192 \
    --batch prefill:8192@24576
done
ls "$R"; (cd "$OUT" && tar czf s21d.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
