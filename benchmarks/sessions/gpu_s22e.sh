#!/usr/bin/env bash
# Session 22, call 5 (~8 minutes): the grouped MoE's counting sort (prefill_moe.moe_sort_pairs)
# on the GPU: the MoE tests, the sort alone against the argsort chain, bench forward prefill
# with the counting sort against the argsort reference (alternating); then every gate and
# the decode step against transformers on the same checkpoint.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s22e.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 90); echo "== MoE tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q tests/ops/test_prefill_moe.py tests/ops/test_grouped_moe.py \
  tests/ops/test_prefill_experts.py -p no:cacheprovider -rf > "$R/pytest.log" 2>&1
tail -1 "$R/pytest.log"
t=$(cap 60); echo "== MoE stages (${t}s)"
((t)) && timeout "$t" python3 -c "import json, sys, moe_stages_bench as b
b.TILINGS = []
json.dump(b.run((2048, 8192)), open(sys.argv[1], 'w'), indent=1)" "$R/moe_stages.json" \
  | grep -E "metadata|sort|gather|grouped"
forward_ab counting 'pass' argsort 'import rackserve.ops.grouped_moe as gm, rackserve.ops.reference as ref
gm._moe_sort_pairs = ref.moe_sort_pairs' --iters 10 --warmup 2 --batch prefill:2048 --batch prefill:8192
echo "== bench forward, every gate"
forward_with 'pass' "$R/forward_gates.json" --iters 20 --warmup 3 --batch decode:1@4096 \
  --batch decode:64@4096 --batch decode:256@4096 --batch decode:64@65536 \
  --batch prefill:2048 --batch prefill:8192 --batch prefill:8192@65536
decode_vs_transformers
ls "$R"; (cd "$OUT" && tar czf s22e.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
