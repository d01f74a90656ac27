#!/usr/bin/env bash
# Session 26, call 5 (~2.5 minutes): the graphs' warm-ups on one stream and their cache
# emptied after capture (call 3: the graphs held 1.03 GiB against a 0.46 GiB reserve): the
# memory-profile GPU tests, then bench decode sized by --gpu-memory-utilization.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s26e.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-150}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 40); echo "== memory profile GPU tests (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/runner/test_memory_profile.py > "$R/pytest_memory.log" 2>&1
grep -E "^E  |passed|failed" "$R/pytest_memory.log" | head -4
flash4 50
decode_sized_by_utilization 60
ls "$R"; (cd "$OUT" && tar czf s26e.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
