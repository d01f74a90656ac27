#!/usr/bin/env bash
# Session 23, call 5 (~6 minutes): the merged tree (sampling inside the decode graphs, the
# prefill graphs on one _StepGraphs base): the graph and sampling GPU tests, whether a GEMV
# runs faster on weights prefetched into L2 (l2_prefetch_probe), every gate, and the decode
# step (sampling in the graphs) against transformers on the same checkpoint.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s23e.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-540}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 170); echo "== graph and sampling tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider -rf \
  tests/runner/test_graph_sampling.py tests/runner/test_ring_tables.py \
  tests/model/test_gpu_fastpath.py -k "sampl or ring or prefill_graph or bit_identical" \
  > "$R/pytest_graphs.log" 2>&1
tail -3 "$R/pytest_graphs.log"
t=$(cap 40); echo "== L2 prefetch probe (${t}s)"
((t)) && timeout "$t" python3 benchmarks/l2_prefetch_probe.py --n 8192 --k 4096 \
  --mb 0 16 32 48 --output "$R/l2_prefetch.json"
echo "== bench forward, every gate"
forward_with 'pass' "$R/forward_gates.json" --iters 20 --warmup 3 --batch decode:1@4096 \
  --batch decode:64@4096 --batch decode:256@4096 --batch decode:64@65536 \
  --batch prefill:2048 --batch prefill:8192 --batch prefill:8192@65536
decode_vs_transformers
ls "$R"; (cd "$OUT" && tar czf s23e.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
