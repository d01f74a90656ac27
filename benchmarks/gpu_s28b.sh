#!/usr/bin/env bash
# Two opt-in switches for the batch-1 chain, last timed in sessions 6 and 16 when decode:1
# took 1.25-1.45 ms on the H200 (1.274 in session 27): the one-launch mHC (K1 + K2 in one
# launch at T <= 4, $RACKSERVE_MHC_FUSED; nine launches fewer a step) and programmatic
# dependent launch ($RACKSERVE_PDL, common.PDL_ON), each against the defaults, alternating,
# two passes, at decode:1 and decode:4. Written in session 27.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/gpu_s28b.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-300}
source "$(dirname "$0")/device_env.sh"
start_call
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$R/gpu.txt"
batches=(--batch decode:1@4096 --batch decode:4@4096 --iters 30 --warmup 5)
forward_ab default 'pass' mhc_fused 'import os; os.environ["RACKSERVE_MHC_FUSED"] = "1"' \
  "${batches[@]}"
forward_ab default_b 'pass' pdl 'import rackserve.ops.triton.common as c; c.PDL_ON = True' \
  "${batches[@]}"
ls "$R"; (cd "$OUT" && tar czf s28b.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
