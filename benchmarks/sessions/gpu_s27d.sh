#!/usr/bin/env bash
# Session 27, call 4 (~3 minutes; written in session 26): the wgmma prefill attention with
# 64-row tiles (prefill_bench.wgmma_variants' bn64_s2_p1) at 8192 queries, HCA and CSA,
# against the default 32-row tiles. Per tile, each warpgroup's QK reads all of q (64 KB)
# from shared memory for a wgmma N of 16: about 0.9 us of shared-memory reads a 32-row tile
# against session 21's fitted 2.1 us a tile; 64-row tiles halve q's reads a row.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s27d.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-200}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 150); echo "== prefill attention at 8192 queries, wgmma tilings (${t}s)"
((t)) && timeout "$t" python3 benchmarks/prefill_bench.py --attention-only bn64_s2_p1 \
  --output "$R/prefill_attention.json" 2>&1 | grep -E "wgmma|Error" | head -12
ls "$R"; (cd "$OUT" && tar czf s27d.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
