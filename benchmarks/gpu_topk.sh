#!/usr/bin/env bash
# The radix top-k (ops/triton/topk.py) on the GPU, one call (~9 minutes): its GPU tests and
# the indexer's; the selection alone at prefill sizes (indexer_bench.py --select-only:
# bitonic levels vs radix and its digit / warp variants, us and GB/s of keys, ids checked
# against torch.topk); bench forward A/B of prefills whose rows take the radix default
# (E = 2048 at prefill:8192, 4096 at @8192, 8192 at @24576) against the bitonic levels.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/gpu_topk.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/device_env.sh"
start_call
t=$(cap 100); echo "== GPU tests: radix top-k, indexer (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m gpu tests/ops/test_indexer_topk.py \
  tests/ops/test_indexer.py -p no:cacheprovider -rf > "$R/pytest.log" 2>&1
tail -3 "$R/pytest.log"
t=$(cap 220); echo "== indexer_bench --select-only (${t}s)"
((t)) && timeout "$t" python3 benchmarks/indexer_bench.py --select-only \
  --output "$R/indexer_select.json" > "$R/indexer_select.log" 2>&1
grep -E " (bitonic|radix|torch.topk) " "$R/indexer_select.log"
# default_tiling (ops/triton/indexer_tiling.py) as the decode op and the selection bind it
BITONIC='import rackserve.ops.triton.indexer as ix, rackserve.ops.triton.select_topk as st
for m in (ix, st):
    override(m, "default_tiling", select_algorithm="bitonic", triton_select_max_entries=2048)'
forward_ab radix "pass" bitonic "$BITONIC" --iters 10 --warmup 2 --batch prefill:8192 \
  --batch prefill:8192@8192 --batch prefill:8192@24576
ls "$R"; (cd "$OUT" && tar czf topk.tgz r && rm -rf r)  # at most 8 files come back
echo "== done in ${SECONDS}s"
