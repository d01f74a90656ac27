#!/usr/bin/env bash
# Session 36's last short call (~240 s of device time left): bench forward's gate cases at the
# session's defaults (the router's logits in their own launch again), 10 runs each, cut to
# what is left of the budget (each case's line is printed as it ends).
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s36b.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-220}
source "$(dirname "$0")/../device_env.sh"
start_call
export -f forward_with
t=$(cap 200); echo "== bench forward, every gate (${t}s)"
((t)) && timeout "$t" bash -c 'forward_with pass "$1/forward_gates.json" --iters 10 --warmup 3 \
  --batch decode:1@4096 --batch decode:64@4096 --batch decode:256@4096 \
  --batch decode:64@65536 --batch prefill:2048 --batch prefill:8192 \
  --batch prefill:8192@65536' _ "$R"
ls "$R"; (cd "$OUT" && tar czf s36b.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
