#!/usr/bin/env bash
# Session 31, after adopting call 1's winners (the GEMV's one-wave split count, the mHC's
# comb beside up to 16 tokens): their GPU tests, then bench forward at decode:1, 8 and 64,
# the new defaults against session 30's (ceil split count, one K2 launch), alternating; the
# decode:1 replay timeline at the new defaults.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s31c.sh     (BUDGET_S: seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-200}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 45); echo "== pytest gemv + comb_beside (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/ops/test_gemv.py tests/ops/test_mhc.py \
  -k "gemv or comb_beside or one_wave" 2>&1 | tail -2
old='import dataclasses, rackserve.ops.triton.gemv as g
mhc.COMB_BESIDE_MAX_TOKENS = None
base = g.default_tiling
def ceil_tiling(n, k, device):
    t = base(n, k, device)
    if device.type != "cuda":
        return t
    blocks = -(-n // t.block_n)
    splits = max(1, min(-(-2 * g._num_sms(device) // blocks), k // 512, -(-k // t.block_k)))
    return dataclasses.replace(t, splits=splits)
g.default_tiling = ceil_tiling'
forward_ab s30 "$old" s31 'pass' --batch decode:1@4096 --batch decode:8@4096 \
  --batch decode:64@4096 --iters 30 --warmup 5
replay_timelines 60 "$R/graph_gap.json" decode:1@4096
ls "$R"; (cd "$OUT" && tar czf s31c.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
