#!/usr/bin/env bash
# Session 16, call 1 (~5 minutes): whether PDL works inside a CUDA graph here and what it
# saves per kernel boundary (pdl_probe.py); the decode replay's timeline at batch 1 and 64
# (graph_gap.py: kernel by kernel, gaps); bench forward bf16 at the decode gates; issue 20's
# FP4 experts through the inline-PTX decoder (GPU tests, bench forward FP8 + FP4).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s16a.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-420}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 60); echo "== PDL probe (${t}s)"
((t)) && timeout "$t" python3 benchmarks/pdl_probe.py --output "$R/pdl_probe.json" 2>&1 | tail -40
t=$(cap 120); echo "== replay timeline (${t}s)"
((t)) && timeout "$t" python3 benchmarks/graph_gap.py --batch decode:1@4096 --batch decode:64@4096 \
  --output "$R/graph_gap.json" > "$R/graph_gap.log" 2>&1; grep -E "timeline|replay_ms" "$R/graph_gap.log" | cut -c1-300
t=$(cap 80); echo "== bench forward bf16 (${t}s)"
((t)) && forward_with "pass" "$R/forward_bf16.json" \
  --iters 20 --warmup 3 --batch decode:1@4096 --batch decode:64@4096 --batch decode:256@4096
t=$(cap 50); echo "== GPU tests of the FP4 MoE (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m gpu tests/ops/test_fp4_moe.py -p no:cacheprovider \
  2>&1 | tail -2 | tee "$R/pytest_gpu.log"
t=$(cap 140); echo "== bench forward, FP8 linears + FP4 experts (${t}s)"
((t)) && forward_with "pass" "$R/forward_fp4.json" --quantization fp8 --expert-dtype fp4 \
  --iters 20 --warmup 3 --batch decode:1@4096 --batch decode:64@4096 --batch decode:256@4096
echo "== done in ${SECONDS}s"
