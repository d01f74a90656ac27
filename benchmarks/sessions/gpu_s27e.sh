#!/usr/bin/env bash
# Session 27, call 3 (~8 minutes): the wgmma prefill attention's 64-row tiles for queries
# of many rows (prefill_attn_wgmma.default_tiling: CSA's 128 + 512; call 1 timed CSA at
# 8192 queries 3,199 -> 2,863 us), and the graphs' memory measured by a profile capture
# (memory_profile.graph_capture_bytes; call 2's engine kept 0.49 GiB for graphs that held
# 0.71). GPU tests of both; the attention alone at 2048, 8192 and 8192 after 65536 cached;
# bench forward A/B (the 64-row tiles off: WIDE_MIN_ROWS past any width) at the prefill gates
# and decode:256 (its CSA layer takes the wgmma kernel from 128 tokens); then bench decode
# sized by --gpu-memory-utilization: the reserve it logs against the graphs' memory.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s27e.sh     (BUDGET_S: total seconds)
# Ran in session 27 (benchmarks/results/2026-12-06-s27.md); the persistent down kernel and
# moe_down_persistent.py were removed after it (a5bf4bd): run it at the commit it names.
set -uo pipefail
BUDGET_S=${BUDGET_S:-500}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 120); echo "== GPU tests: the memory profile, the wgmma attention (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/runner/test_memory_profile.py \
  tests/ops/test_prefill_attn_wgmma.py > "$R/pytest.log" 2>&1
grep -E "^E  |passed|failed" "$R/pytest.log" | head -6
t=$(cap 90); echo "== prefill attention, 32- and 64-row tiles (${t}s)"
((t)) && timeout "$t" python3 benchmarks/prefill_bench.py --attention-only bn32_s4_p2,bn64_s2_p1 \
  --cases 2048:0,8192:0,8192:65536 --output "$R/prefill_attention.json" 2>&1 \
  | grep -E "wgmma|Error" | head -20
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$R/gpu.txt"
# the persistent down kernel: no gain on the H100 (call 1), whose down kernel already streams
# at 89% of its HBM; on the H200 it streamed at 71% (session 24)
t=$(cap 60); echo "== the expert kernels alone (${t}s)"
((t)) && timeout "$t" python3 benchmarks/moe_down_persistent.py --tokens 1 64 256 \
  --output "$R/moe_down.json" 2>&1 | tail -16
forward_ab narrow 'import rackserve.ops.triton.prefill_attn_wgmma as w; w.WIDE_MIN_ROWS = 10**9' \
  wide 'pass' --batch prefill:2048 --batch prefill:8192 --batch prefill:8192@65536 \
  --batch decode:256@4096 --iters 10 --warmup 2
flash4 100
decode_sized_by_utilization 90
ls "$R"; (cd "$OUT" && tar czf s27e.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
