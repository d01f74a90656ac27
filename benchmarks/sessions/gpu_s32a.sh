#!/usr/bin/env bash
# Session 32: a captured step's metadata kernels beside the first layer's mHC
# (cuda_graph.METADATA_BESIDE, on by default) against in line, and the L2 prefetch beside the
# latency-bound chains on a stream of its own (ops.L2_PREFETCH_MAX_TOKENS = 16, opt-in): the
# GPU tests (graphs bitwise equal; the comb-beside K2 in its COMB_ONLY form), bench forward
# alternating the three, two passes; the decode:1 replay timelines of the last two.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s32a.sh     (BUDGET_S: seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-300}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 80); echo "== pytest metadata_beside, comb_beside, l2 prefetch (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/runner/test_cuda_graph.py tests/ops/test_mhc.py \
  tests/ops/test_l2_prefetch.py -k "metadata_beside or comb_beside or eager_or_replayed" \
  > "$R/pytest.log" 2>&1; tail -3 "$R/pytest.log"
inline='import rackserve.runner.cuda_graph as cg; cg.METADATA_BESIDE = False'
prefetch='import rackserve.ops as ops; ops.L2_PREFETCH_MAX_TOKENS = 16'
for pass in 1 2; do
  for arm in inline beside prefetch; do
    case $arm in inline) code=$inline ;; beside) code='pass' ;; prefetch) code=$prefetch ;; esac
    t=$(cap 60); echo "== bench forward, $arm, pass $pass (${t}s)"
    ((t)) && forward_with "$code" "$R/forward_${arm}_$pass.json" --batch decode:1@4096 \
      --batch decode:8@4096 \
      --batch decode:64@4096 --batch decode:256@4096 --batch prefill:2048 --iters 30 --warmup 5
  done
done
replay_timelines 45 "$R/graph_gap.json" decode:1@4096
t=$(cap 45); echo "== graph_gap with the prefetch (${t}s)"
((t)) && timeout "$t" python3 -c "import runpy, sys
import rackserve.ops as ops; ops.L2_PREFETCH_MAX_TOKENS = 16
sys.path.insert(0, 'benchmarks')
sys.argv = ['graph_gap.py', '--batch', 'decode:1@4096', '--output', '$R/graph_gap_prefetch.json']
runpy.run_path('benchmarks/graph_gap.py', run_name='__main__')" 2>&1 | tail -3
ls "$R"; (cd "$OUT" && tar czf s32a.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
