#!/usr/bin/env bash
# Session 41, call 5: the staging's fence after the replay against after the copy at
# decode:1 (sessions/s41_fence_ab.py), bench forward's decode:1 / 64 (the new default), the
# GPU tests of the staging, graphs and speculative graphs; on an H200, gpu_s41.sh with what
# is left.
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s41c.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 90); echo "== the fence after the replay against after the copy (${t}s)"
((t)) && PYTHONPATH=$PYTHONPATH:$PWD/benchmarks/sessions timeout "$t" \
  python3 benchmarks/sessions/s41_fence_ab.py | tee "$R/fence_ab.jsonl"
echo "== bench forward decode:1 / 64"
forward_with pass "$R/forward_decode.json" --batch decode:1@4096 --batch decode:64@4096 \
  --iters 30 --warmup 5
t=$(cap 200); echo "== pytest: staging, graphs, speculative graphs (${t}s)"
((t)) && timeout "$t" "${pt[@]}" -m gpu tests/runner/test_pinned_staging.py \
  tests/runner/test_cuda_graph.py tests/runner/test_graph_sampling.py \
  tests/spec_decode/test_spec_graphs_gpu.py > "$R/gpu_tests.log" 2>&1
grep -E "FAILED|ERROR|passed|failed" "$R/gpu_tests.log" | tail -6
(cd "$OUT" && tar czf s41c.tgz r && rm -rf r)
left=$((BUDGET_S - SECONDS))
if ((left >= 150)) && grep -q H200 <(nvidia-smi --query-gpu=name --format=csv,noheader); then
  BUDGET_S=$left bash "$(dirname "$0")/gpu_s41.sh"
fi
echo "== done in ${SECONDS}s"
