#!/usr/bin/env bash
# Session 29, call 1 (written in session 28, whose device budget ran out): why the shared
# expert beside the router made decode:1 30-40 us slower on the H200 while decode:4 gained
# 5% (results/2026-12-06-s28.md, section 3): beside from 1 token with the shared launch on
# half-width tiles against the defaults (bench forward, alternating), the graph replay kernel by kernel
# (graph_gap.py) at decode:1 and decode:4, defaults (beside from 2 tokens) against beside
# from 1 token; then the split-K GEMV against cuBLAS at 1 and 4 tokens over every
# projection shape with its tiling sweep (the x projections streamed at 2.1-2.7 TB/s in
# session 16's decode:1 profile, where the MoE reaches 4.0).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s29a.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-540}
source "$(dirname "$0")/../device_env.sh"
start_call
# the shared launch alone at T = 1 has 64 gate-up and 32 down programs: with half-width
# tiles (gate-up 16, down 64 columns) it has twice as many
wide='import dataclasses, rackserve.ops as o, rackserve.ops.triton.fused_moe as fm
o.SHARED_BESIDE_ROUTER_MIN_TOKENS = 1
run_shared = fm.run_shared
fm.run_shared = lambda x, w13, w2, limit, tiling, *a: run_shared(x, w13, w2, limit,
    dataclasses.replace(tiling, gate_up_block_n=16, down_block_n=64), *a)'
forward_ab default 'pass' beside_wide "$wide" --batch decode:1@4096 --batch decode:4@4096 \
  --iters 30 --warmup 5
for side in default beside_from_1; do
  t=$(cap 110); echo "== graph_gap, $side (${t}s)"
  code='pass'
  [[ $side == beside_from_1 ]] && code='import rackserve.ops as o; o.SHARED_BESIDE_ROUTER_MIN_TOKENS = 1'
  ((t)) && timeout "$t" python3 -c "import runpy, sys
exec(sys.argv[1])
sys.path.insert(0, 'benchmarks')  # graph_gap imports bench_timing
sys.argv = ['graph_gap.py'] + sys.argv[2:]
runpy.run_path('benchmarks/graph_gap.py', run_name='__main__')" "$code" \
    --batch decode:1@4096 --batch decode:4@4096 --output "$R/graph_gap_$side.json" 2>&1 | tail -4
done
t=$(cap 150); echo "== gemv_bench at 1 and 4 tokens, with the sweep (${t}s)"
((t)) && timeout "$t" python3 benchmarks/gemv_bench.py --tokens 1,4 \
  --output "$R/gemv_bench.json" 2>&1 | tail -4
# the mHC at 64 and 256 tokens over its launch variants: at decode:256 its 9 K1 + 9 K2 + 4
# post launches took 283 us a step (H200, session 20 timeline: 11-15 us each against ~2 us
# of bytes), the lever for decode:256's last 2% (added in session 29)
t=$(cap 90); echo "== latency_kernels, mHC at 64 and 256 tokens (${t}s)"
((t)) && timeout "$t" python3 benchmarks/latency_kernels.py --tokens 64 256 --parts hc post \
  --output "$R/latency_kernels.json" 2>&1 | tail -30
ls "$R"; (cd "$OUT" && tar czf s29a.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
