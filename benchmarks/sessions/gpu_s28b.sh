#!/usr/bin/env bash
# (Run at 1148c6f: the L2 prefetch it times was removed after this run, session 28.)
# Three opt-in switches for the batch-1 chain, each against the defaults, alternating, two
# passes, at decode:1 and decode:4: the L2 prefetch of each next weight stream before the
# latency-bound kernels (ops.L2_PREFETCH_MAX_TOKENS, session 27, untimed; its GPU test
# first), and two last timed in sessions 6 and 16 when decode:1 took 1.25-1.45 ms on the
# H200 (1.274 in session 27): the one-launch mHC (K1 + K2 in one launch at T <= 4,
# $RACKSERVE_MHC_FUSED; nine launches fewer a step) and programmatic dependent launch
# ($RACKSERVE_PDL, common.PDL_ON). Written in session 27.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s28b.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-360}
source "$(dirname "$0")/../device_env.sh"
start_call
batches=(--batch decode:1@4096 --batch decode:4@4096 --iters 30 --warmup 5)
t=$(cap 60); echo "== the prefetch's GPU test (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/ops/test_l2_prefetch.py > "$R/pytest.log" 2>&1
grep -E "^E  |^FAILED|passed|failed" "$R/pytest.log" | head -6
forward_ab default_p 'pass' prefetch 'import rackserve.ops as o; o.L2_PREFETCH_MAX_TOKENS = 16' \
  "${batches[@]}"
forward_ab default 'pass' mhc_fused 'import os; os.environ["RACKSERVE_MHC_FUSED"] = "1"' \
  "${batches[@]}"
forward_ab default_b 'pass' pdl 'import rackserve.ops.triton.common as c; c.PDL_ON = True' \
  "${batches[@]}"
ls "$R"; (cd "$OUT" && tar czf s28b.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
