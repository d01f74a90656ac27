#!/usr/bin/env bash
# Session 26, call 2 (~7.5 minutes; written in session 25, whose machine never started).
# - The CSA layer's indexer on a side stream beside the q projection
#   (ops.INDEXER_BESIDE_Q_MAX_TOKENS, Attention._indexer_beside_q; off until measured): the
#   decode graph with two branches replays bitwise as eager (1 and 256 requests), then bench
#   forward at decode:1 / 256 with it (256) against in series (None), alternating, two passes.
# - The KV budget's reserve (runner/memory_profile.py, session 24): its GPU test.
# - The decode MoE at T = 256 with 64-row blocks (each expert's pairs in one block, its
#   weights read once) against 32, h rounded once.
# Left for the gates' call (gpu_s26c.sh: it creates the checkpoint anyway): the
# chunking-invariance GPU test with the decode MoE's rounded h, and bench decode sized by
# --gpu-memory-utilization logging the reserve next to what the CUDA graphs hold.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s26b.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-450}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 100); echo "== indexer beside q: graph replay against eager (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/model/test_gpu_fastpath.py::test_graph_replay_is_bit_identical_to_eager \
  -k "True" > "$R/pytest_beside.log" 2>&1
grep -E "^E  |passed|failed" "$R/pytest_beside.log" | head -6
forward_ab beside 'import rackserve.ops as o; o.INDEXER_BESIDE_Q_MAX_TOKENS = 256' \
  in_series 'pass' --batch decode:1@4096 --batch decode:256@4096 --iters 20 --warmup 3
t=$(cap 60); echo "== memory profile GPU test (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/runner/test_memory_profile.py > "$R/pytest_memory.log" 2>&1
grep -E "^E  |passed|failed" "$R/pytest_memory.log" | head -6
t=$(cap 100); echo "== MoE at T = 256, 32- and 64-row blocks, h rounded (${t}s)"
((t)) && timeout "$t" python3 benchmarks/moe_tiling_sweep.py --tokens 256 --block-m 32 64 \
  --tile-fastest 1 --output "$R/moe_block_m.json" 2>&1 | tail -30
ls "$R"; (cd "$OUT" && tar czf s26b.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
