#!/usr/bin/env bash
# Session 24, call 2: the graph tests verify_s23 cut off (its -k matched the whole of
# test_gpu_fastpath.py through "gpu" in the module name), the failing mixed prefill-graph
# case with its traceback, then where decode:1 and decode:256 spend their replay
# (graph_gap.py, kernel by kernel) to pick this session's lever.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s24a.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-330}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 90); echo "== prefill-graph test (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/model/test_gpu_fastpath.py -k prefill_graph \
  > "$R/pytest_prefill_graph.log" 2>&1
grep -E "^E |Error|assert|passed|failed" "$R/pytest_prefill_graph.log" | head -20
t=$(cap 150); echo "== graph sampling, spec graphs, ring tables (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/runner/test_graph_sampling.py \
  tests/spec_decode/test_spec_graphs_gpu.py "tests/runner/test_ring_tables.py" \
  -k "captured or gpu or cuda" > "$R/pytest_graphs.log" 2>&1
grep -E "^E |passed|failed" "$R/pytest_graphs.log" | head -20
t=$(cap 100); echo "== graph_gap (${t}s)"
((t)) && timeout "$t" python3 benchmarks/graph_gap.py --batch decode:1@4096 \
  --batch decode:256@4096 --output "$R/graph_gap.json" 2>&1 | tail -30
ls "$R"; (cd "$OUT" && tar czf s24a.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
