#!/usr/bin/env bash
# Session 39, call 2: StepBuffers' upload through device.PinnedStaging (one concatenate and one
# split for a step's int64 inputs) against the old two-buffer staging
# (sessions/s39_old_upload.py), bench forward decode:1 and decode:64 on one machine, then the
# staging's GPU tests. Call 1 (fa9278e, the per-array views) measured decode:1 1.518 ms
# isolated against 1.453 back to back: 65 us of host staging, 26 us in session 38.
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s39b.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-200}
source "$(dirname "$0")/../device_env.sh"
start_call
export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks/sessions
old='import s39_old_upload'
t=$(cap 40); echo "== pytest: staging (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/runner/test_pinned_staging.py > "$R/staging_tests.log" 2>&1
tail -1 "$R/staging_tests.log"
for arm in new old; do
  code='pass'; [[ $arm == old ]] && code=$old
  t=$(cap 60); echo "== bench forward, $arm (${t}s)"
  ((t)) && forward_with "$code" "$R/forward_$arm.json" --iters 30 --warmup 3 \
    --batch decode:1@4096 --batch decode:64@4096
done
(cd "$OUT" && tar czf s39b.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
