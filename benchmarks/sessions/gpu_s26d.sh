#!/usr/bin/env bash
# Session 26, call 4 (~4 minutes): after adopting hc_post_pre's expand apart and the wgmma
# attention from 128 tokens (gpu_s26c.sh's A/B), the GPU tests those paths now take at
# decode:128-256 (graph replay bit-identical to eager, with and without the side-stream
# indexer; the teacher-forced bf16 accuracy gate), then every gate in bench forward.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s26d.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-240}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 60); echo "== graph replay against eager (${t}s)"
((t)) && timeout "$t" "${pt[@]}" \
  tests/model/test_gpu_fastpath.py::test_graph_replay_is_bit_identical_to_eager \
  > "$R/pytest_graphs.log" 2>&1
grep -E "^E  |passed|failed" "$R/pytest_graphs.log" | head -4
t=$(cap 100); echo "== teacher-forced bf16 accuracy (${t}s)"
((t)) && timeout "$t" "${pt[@]}" -s tests/model/test_gpu_fastpath.py -k teacher_forced \
  > "$R/pytest_accuracy.log" 2>&1
grep -E "^E  |context|passed|failed" "$R/pytest_accuracy.log" | head -6
forward_gates
ls "$R"; (cd "$OUT" && tar czf s26d.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
