#!/usr/bin/env bash
# Session 31: the comb-beside GPU test; the split-K GEMV's split count and the mHC's comb
# beside, four arms alternating (bench forward at decode:1, 8 and 64); then the forward
# gates at HEAD's defaults; the graph-replay timelines at decode:1, 64 and 256 (graph_gap:
# where the step's time goes on this card):
#   ceil2   the default: splits = ceil(2 programs a SM / column blocks) (x_proj HCA 7 splits,
#           280 programs: 16 past the 264 that fit at once; CSA 325; wo_b 320)
#   floor2  splits = floor(2 a SM / column blocks): one wave at most (240, 260, 256)
#   ceil1   PROGRAMS_PER_SM = 1 with the ceil (160, 195, 192)
#   beside  the defaults with mhc.COMB_BESIDE_MAX_TOKENS = 64: a block's post and comb (the
#           Sinkhorn chain) in a launch of their own on the side stream of the graph
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s31b.sh     (BUDGET_S: seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-330}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 60); echo "== pytest comb_beside (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/ops/test_mhc.py -k comb_beside 2>&1 | tail -3
floor2='import dataclasses, rackserve.ops.triton.gemv as g
base = g.default_tiling
def floor_tiling(n, k, device):
    t = base(n, k, device)
    if device.type != "cuda":
        return t
    blocks = -(-n // t.block_n)
    splits = max(1, min(2 * g._num_sms(device) // blocks, k // 512, -(-k // t.block_k)))
    return dataclasses.replace(t, splits=splits)
g.default_tiling = floor_tiling'
ceil1='import rackserve.ops.triton.gemv as g; g.PROGRAMS_PER_SM = 1'
beside='mhc.COMB_BESIDE_MAX_TOKENS = 64'
args=(--batch decode:1@4096 --batch decode:8@4096 --batch decode:64@4096 --iters 30 --warmup 5)
for pass in 1 2; do
  for arm in ceil2 floor2 ceil1 beside; do
    case $arm in
      ceil2) code='pass' ;; floor2) code=$floor2 ;; ceil1) code=$ceil1 ;; beside) code=$beside ;;
    esac
    t=$(cap 60); echo "== bench forward, $arm, pass $pass (${t}s)"
    ((t)) && forward_with "$code" "$R/forward_${arm}_$pass.json" "${args[@]}"
  done
done
t=$(cap 120); ((t > 100)) && forward_gates  # every gate's batch at HEAD's defaults
t=$(cap 120); echo "== graph_gap decode:1, 64, 256 (${t}s)"
((t)) && timeout "$t" python3 -c "import runpy, sys
sys.path.insert(0, 'benchmarks')  # graph_gap imports bench_timing
sys.argv = ['graph_gap.py'] + sys.argv[1:]
runpy.run_path('benchmarks/graph_gap.py', run_name='__main__')" --batch decode:1@4096 \
  --batch decode:64@4096 --batch decode:256@4096 --output "$R/graph_gap.json" 2>&1 | tail -3
ls "$R"; (cd "$OUT" && tar czf s31b.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
