#!/usr/bin/env bash
# Session 19, call 1 (~9 minutes): the fused MoE's tensor-descriptor (TMA) kernels against
# the pointer kernels (GPU tests, the tile sweep at 1 / 64 / 256 tokens, bench forward A/B
# at the decode gates); whether eager prefill waits on the host (eager vs a captured graph
# of the same forward, and its kernels by time); Nsight Compute on decode:256's largest
# kernels; the decode:1 replay kernel by kernel.
# A record of the call made at 81f329c: its TMA kernels and the sweep's --tma went in
# f128f72 (no gain), so at later commits the TMA parts fail.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s19a.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-540}
source "$(dirname "$0")/../device_env.sh"
start_call
TMA='import rackserve.ops.triton.fused_moe as fm
override(fm, "default_tiling", tma=True, gate_up_block_k=64)'
DECODE=(--iters 20 --warmup 3 --batch decode:1@4096 --batch decode:64@4096
  --batch decode:256@4096)
t=$(cap 100); echo "== GPU tests: fused MoE, TMA and graph replay (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m gpu tests/ops/test_fused_moe.py \
  -k "tma or graph_replay" -p no:cacheprovider -rf > "$R/pytest_moe.log" 2>&1
tail -4 "$R/pytest_moe.log"
t=$(cap 200); echo "== fused MoE tiles: TMA kernels against the default (${t}s)"
((t)) && timeout "$t" python3 benchmarks/moe_tiling_sweep.py --tokens 1 64 256 --stack-h 1 \
  --tma 1 --jobs 14 --output "$R/moe_tma.json" 2>&1 | tail -40
forward_ab ptr "pass" tma "$TMA" "${DECODE[@]}"
t=$(cap 90); echo "== prefill: eager, host enqueue, graph replay (${t}s)"
((t)) && timeout "$t" python3 benchmarks/prefill_graph_probe.py --batch prefill:2048 \
  --batch prefill:8192 --output "$R/prefill_probe.json" 2>&1 | tail -3
t=$(cap 60); echo "== prefill kernels by time (${t}s)"
((t)) && timeout "$t" python3 benchmarks/profile_forward.py --batch prefill:2048 \
  --batch prefill:8192 --top 25 --output "$R/profile_prefill.json" 2>&1 | grep -v "^ *0\.0" \
  | head -60
t=$(cap 120); echo "== ncu: decode:256's largest kernels (${t}s)"
KERNELS="moe_down_kernel|moe_gate_up_kernel|prenorm_gemm_kernel|hc_finish_kernel|sparse_attn_wide"
((t)) && timeout "$t" ncu --clock-control none --nvtx --nvtx-include "profiled/" \
  -k "regex:$KERNELS" --launch-count 7 --section SpeedOfLight --section MemoryWorkloadAnalysis \
  --section Occupancy --section WarpStateStats --section LaunchStats --csv --page details \
  python3 benchmarks/ncu_step.py --batch decode:256@4096 > "$R/ncu_decode256.csv" 2> /tmp/ncu.err
tail -2 /tmp/ncu.err; wc -l "$R/ncu_decode256.csv"
t=$(cap 45); echo "== replay timeline, decode:1 (${t}s)"
((t)) && timeout "$t" python3 benchmarks/graph_gap.py --batch decode:1@4096 \
  --output "$R/graph_gap.json" > /dev/null 2>&1
ls "$R"; (cd "$OUT" && tar czf s19a.tgz r && rm -rf r)  # at most 8 files come back
echo "== done in ${SECONDS}s"
