#!/usr/bin/env bash
# Session 23, call 4 (~8 minutes): CUDA graphs for prefill / mixed steps of up to 2048 tokens
# (runner/cuda_graph.py PrefillGraphs): their GPU test against the eager step, bench forward
# prefill from the graph against --enforce-eager, every gate, and the decode step against
# transformers on the same checkpoint.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s23d.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-540}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 120); echo "== graph tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider -rf \
  tests/model/test_gpu_fastpath.py -k "prefill_graph or bit_identical" > "$R/pytest_graphs.log" 2>&1
tail -3 "$R/pytest_graphs.log"
for pass in 1 2; do
  t=$(cap 60); echo "== bench forward prefill, graph, pass $pass (${t}s)"
  ((t)) && forward_with 'pass' "$R/forward_graph_$pass.json" --iters 20 --warmup 3 \
    --batch prefill:512 --batch prefill:2048 --batch mixed:1024@4096+64@4096
  t=$(cap 60); echo "== bench forward prefill, eager, pass $pass (${t}s)"
  ((t)) && forward_with 'pass' "$R/forward_eager_$pass.json" --iters 20 --warmup 3 \
    --enforce-eager --batch prefill:512 --batch prefill:2048 --batch mixed:1024@4096+64@4096
done
echo "== bench forward, every gate"
forward_with 'pass' "$R/forward_gates.json" --iters 20 --warmup 3 --batch decode:1@4096 \
  --batch decode:64@4096 --batch decode:256@4096 --batch decode:64@65536 \
  --batch prefill:2048 --batch prefill:8192 --batch prefill:8192@65536
decode_vs_transformers
ls "$R"; (cd "$OUT" && tar czf s23d.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
