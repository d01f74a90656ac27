#!/usr/bin/env bash
# Session 26, call 5 (~2.5 minutes): the graphs' warm-ups on one stream and their cache
# emptied after capture (call 3: the graphs held 1.03 GiB against a 0.46 GiB reserve): the
# memory-profile GPU tests, then bench decode sized by --gpu-memory-utilization.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/gpu_s26e.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-150}
source "$(dirname "$0")/device_env.sh"
start_call
rs=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
t=$(cap 40); echo "== memory profile GPU tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider -rf \
  --tb=short tests/runner/test_memory_profile.py > "$R/pytest_memory.log" 2>&1
grep -E "^E  |passed|failed" "$R/pytest_memory.log" | head -4
t=$(cap 50); echo "== model create (${t}s)"
((t)) && timeout "$t" "${rs[@]}" model create --preset v4-flash --layers 4 --experts 64 \
  --dtype bfloat16 --no-mtp --out /tmp/flash4 2>&1 | tail -1
t=$(cap 60); echo "== bench decode sized by --gpu-memory-utilization (${t}s)"
((t)) && [[ -d /tmp/flash4 ]] && timeout "$t" "${rs[@]}" bench decode --model /tmp/flash4 \
  --concurrency 64 --context 512 --steps 20 --warmup 5 --output "$R/decode_64_budget.json" \
  > "$R/decode_64_budget.log" 2>&1
grep -E "memory:|CUDA graphs|KV cache|decode x|Error" "$R/decode_64_budget.log" | head -8
ls "$R"; (cd "$OUT" && tar czf s26e.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
