#!/usr/bin/env bash
# Session 32: a captured step's metadata kernels beside the first layer's mHC
# (cuda_graph.METADATA_BESIDE) against in line: the GPU tests (the graphs bitwise equal, the
# comb-beside K2 in its COMB_ONLY form), bench forward alternating at decode:1, 64, 256 and
# prefill:2048 (a prefill graph), the decode:1 replay timeline.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s32a.sh     (BUDGET_S: seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-240}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 70); echo "== pytest metadata_beside + comb_beside (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/runner/test_cuda_graph.py tests/ops/test_mhc.py \
  -k "metadata_beside or comb_beside" > "$R/pytest.log" 2>&1; tail -3 "$R/pytest.log"
forward_ab inline 'import rackserve.runner.cuda_graph as cg; cg.METADATA_BESIDE = False' \
  beside 'pass' --batch decode:1@4096 --batch decode:64@4096 --batch decode:256@4096 \
  --batch prefill:2048 --iters 30 --warmup 5
replay_timelines 50 "$R/graph_gap.json" decode:1@4096
ls "$R"; (cd "$OUT" && tar czf s32a.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
