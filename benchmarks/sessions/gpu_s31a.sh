#!/usr/bin/env bash
# Prepared in session 30 (results/2026-12-06-s30.md), for a card on which the gates have not
# been timed at this commit (an H200 above all: session 30 ran on H100s only):
#   - the GEMV at one program per SM (gemv.PROGRAMS_PER_SM = 1: about half the splits)
#     against two (the default), bench forward at decode:1, 4 and 8, alternating;
#   - the graph-replay timelines at decode:1, 64 and 256 (graph_gap: kernel by kernel, where
#     the step's time goes on this card).
# Then run benchmarks/gpu_gates.sh in a call of its own.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s31a.sh     (BUDGET_S: seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-330}
source "$(dirname "$0")/../device_env.sh"
start_call
forward_ab gemv_2 'pass' gemv_1 'import rackserve.ops.triton.gemv as g; g.PROGRAMS_PER_SM = 1' \
  --batch decode:1@4096 --batch decode:4@4096 --batch decode:8@4096 --iters 30 --warmup 5
t=$(cap 120); echo "== graph_gap decode:1, 64, 256 (${t}s)"
((t)) && timeout "$t" python3 -c "import runpy, sys
sys.path.insert(0, 'benchmarks')  # graph_gap imports bench_timing
sys.argv = ['graph_gap.py'] + sys.argv[1:]
runpy.run_path('benchmarks/graph_gap.py', run_name='__main__')" --batch decode:1@4096 \
  --batch decode:64@4096 --batch decode:256@4096 --output "$R/graph_gap.json" 2>&1 | tail -3
ls "$R"; (cd "$OUT" && tar czf s31a.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
