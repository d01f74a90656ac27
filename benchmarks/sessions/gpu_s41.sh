#!/usr/bin/env bash
# Session 41, call 1. On an H200 (the gates' card; its figures are still session 28's):
# bench forward's gate batches (forward_gates). On any card: decode:1's isolated step split
# into its stage and the graph launch (sessions/s41_step_host.py). On an H200: the lm_head's
# logits on cuBLAS against the split-K GEMV (the default since session 30, measured on H100s only; session 24's H200
# ran cuBLAS's lm_head at 242 us, ~4.4 TB/s) at decode:1 / 4, alternating, two passes. On
# any card: the lean staging's host time (sessions/s40_stage_host.py: daaf5f4 was timed on
# the CPU only) and its GPU tests; then, on an H200, bench decode against transformers with
# what is left.
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s41.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/../device_env.sh"
start_call
h200=0
grep -q H200 "$R/gpu.txt" && h200=1
((h200)) && forward_gates
t=$(cap 80); echo "== decode:1 step: the stage against the replay's launch (${t}s)"
((t)) && timeout "$t" python3 benchmarks/sessions/s41_step_host.py | tee "$R/step_host.jsonl"
if ((h200)); then
  forward_ab gemv_head 'pass' cublas_head 'import rackserve.ops as o; o.LOGITS_GEMV_MAX_TOKENS = None' \
    --batch decode:1@4096 --batch decode:4@4096 --iters 30 --warmup 5
fi
t=$(cap 70); echo "== staging host time (${t}s)"
((t)) && PYTHONPATH=$PYTHONPATH:$PWD/benchmarks/sessions timeout "$t" \
  python3 benchmarks/sessions/s40_stage_host.py | tee "$R/stage_host.jsonl"
t=$(cap 120); echo "== pytest: PinnedStaging and the captured sampling fed from it (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/runner/test_pinned_staging.py \
  tests/runner/test_graph_sampling.py > "$R/staging_tests.log" 2>&1
tail -1 "$R/staging_tests.log"
((h200)) && decode_vs_transformers
echo "== the gates"
python3 benchmarks/gates.py "$R" --output "$R/gates.json"
ls "$R"; (cd "$OUT" && tar czf s41.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
