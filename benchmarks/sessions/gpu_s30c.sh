#!/usr/bin/env bash
# (Tiling.comb_apart measured no gain here and was removed after this call: results/2026-12-06-s30.md.)
# Session 30, call 8: two decode latency changes.
#   - mHC K2 with post and comb (the Sinkhorn chain) in a second program of each token block
#     (mhc.COMB_APART_MAX_TOKENS = 256) against one program (None, the default), bench
#     forward at decode:1, 64 and 256, alternating;
#   - the router's expert counts by relaxed atomics and its picks stored once (in both arms:
#     graph_gap at decode:1 shows _route_align_kernel against call 5's 42.7 us for 4 layers).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s30c.sh     (BUDGET_S: seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-300}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 45); echo "== mHC comb apart, route, routed MoE tests (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/ops/test_mhc.py -k "comb_apart or gpu" \
  tests/ops/test_route.py tests/ops/test_moe_routed.py > "$R/pytest.log" 2>&1
grep -E "^E  |^FAILED|passed|failed" "$R/pytest.log" | head -6
forward_ab one_program 'mhc.COMB_APART_MAX_TOKENS = None' comb_apart \
  'mhc.COMB_APART_MAX_TOKENS = 256' --batch decode:1@4096 --batch decode:64@4096 \
  --batch decode:256@4096 --iters 20 --warmup 3
t=$(cap 70); echo "== graph_gap decode:1 (${t}s)"
((t)) && timeout "$t" python3 -c "import runpy, sys
sys.path.insert(0, 'benchmarks')  # graph_gap imports bench_timing
sys.argv = ['graph_gap.py'] + sys.argv[1:]
runpy.run_path('benchmarks/graph_gap.py', run_name='__main__')" \
  --batch decode:1@4096 --output "$R/graph_gap.json" 2>&1 | tail -3
ls "$R"; (cd "$OUT" && tar czf s30c.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
