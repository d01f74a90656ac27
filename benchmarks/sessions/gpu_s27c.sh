#!/usr/bin/env bash
# Session 27, call 3 (~6 minutes; written in session 26): the persistent down kernel
# (fused_moe.Tiling.down_programs, opt-in). On the H200 the down kernel streams at 3.41 TB/s
# against gate-up's 3.97 (decode:256 timeline, session 24: 320 against 549 us a layer for
# half the bytes); each of its programs streams a quarter of a gate-up program's bytes (16
# k-steps at I = 2048), so a pipeline fill an item weighs 4x more. Its GPU tests (bitwise
# the one-program-an-item kernel), the op alone at T = 1, 64, 256 (moe_down_persistent.py),
# then bench forward A/B at decode:64 and decode:256 with two programs an SM.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s27c.sh     (BUDGET_S: total seconds)
# Ran in session 27 (benchmarks/results/2026-12-06-s27.md); the persistent down kernel and
# moe_down_persistent.py were removed after it (a5bf4bd): run it at the commit it names.
set -uo pipefail
BUDGET_S=${BUDGET_S:-360}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 90); echo "== fused MoE GPU tests, the grid orders and the persistent down (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/ops/test_fused_moe.py -k "grid_orders or persistent" \
  > "$R/pytest_moe.log" 2>&1
grep -E "^E  |passed|failed" "$R/pytest_moe.log" | head -4
t=$(cap 90); echo "== the expert kernels alone (${t}s)"
((t)) && timeout "$t" python3 benchmarks/moe_down_persistent.py --tokens 1 64 256 \
  --output "$R/moe_down.json" 2>&1 | tail -16
forward_ab default 'pass' persistent 'import torch, rackserve.ops.triton.fused_moe as fm
override(fm, "default_tiling", down_programs=2 * torch.cuda.get_device_properties(0).multi_processor_count)' \
  --batch decode:64@4096 --batch decode:256@4096 --iters 20 --warmup 3
ls "$R"; (cd "$OUT" && tar czf s27c.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
