#!/usr/bin/env bash
# Session 19, call 2 (~9 minutes): the fused MoE down kernel's grid with the n-tiles fastest
# (a block's h rows re-read from L2, not DRAM: ncu in call 1 read 1.37 GB of DRAM for 1.09 GB
# of weights at 256 tokens) against the default order, alone and in bench forward A/B; the
# Sinkhorn's one division per row (hc_finish in the replay timelines); the host's time
# around a decode graph step and inside an eager prefill forward.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s19b.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-540}
source "$(dirname "$0")/../device_env.sh"
start_call
FAST='import rackserve.ops.triton.fused_moe as fm
override(fm, "default_tiling", down_tile_fastest=True)'
t=$(cap 120); echo "== GPU tests: fused MoE, FP4 MoE, mHC (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m gpu tests/ops/test_fused_moe.py \
  tests/ops/test_mhc.py -p no:cacheprovider -rf > "$R/pytest.log" 2>&1
tail -4 "$R/pytest.log"
t=$(cap 150); echo "== down kernel: grid orders (${t}s)"
((t)) && timeout "$t" python3 benchmarks/moe_tiling_sweep.py --tokens 64 256 --kernels down \
  --stack-h 1 --tile-fastest 0 1 --jobs 14 --output "$R/moe_order.json" 2>&1 | tail -24
forward_ab base "pass" fast "$FAST" --iters 20 --warmup 3 --batch decode:1@4096 \
  --batch decode:64@4096 --batch decode:256@4096
t=$(cap 90); echo "== host: decode graph steps, eager prefill (${t}s)"
((t)) && timeout "$t" python3 benchmarks/host_probe.py --decode decode:1@4096 \
  --decode decode:256@4096 --prefill prefill:2048 --output "$R/host_probe.json" 2>&1 \
  | head -60
for b in 1 256; do
  t=$(cap 50); echo "== replay timeline, decode:$b (${t}s)"
  ((t)) && timeout "$t" python3 benchmarks/graph_gap.py --batch decode:$b@4096 \
    --output "$R/graph_gap_$b.json" > /dev/null 2>&1
done
ls "$R"; (cd "$OUT" && tar czf s19b.tgz r && rm -rf r)  # at most 8 files come back
echo "== done in ${SECONDS}s"
