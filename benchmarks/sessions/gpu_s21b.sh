#!/usr/bin/env bash
# Session 21, call 6 (~5 minutes): the wgmma prefill attention as the default (p
# double-buffered, 4 ring slots): its tests, the Triton prefill kernel's GPU tests, chunked
# prefill at V4-Flash sizes, the fp32 fast path and graph replay; then bench forward at
# every gate plus prefill:8192@65536.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s21b.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-330}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 170); echo "== GPU tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m "gpu or not gpu" tests/ops/test_prefill_attn_wgmma.py \
  -p no:cacheprovider -rf > "$R/pytest.log" 2>&1
((t)) && timeout "$t" python3 -m pytest -q -m gpu tests/ops/test_prefill_attn.py \
  tests/model/test_chunking_gpu.py tests/model/test_gpu_fastpath.py \
  -k "not teacher_forced and not no_less_accurate" -p no:cacheprovider -rf >> "$R/pytest.log" 2>&1
grep -E "passed|failed|Error" "$R/pytest.log" | tail -6
echo "== bench forward, every gate"
forward_with 'pass' "$R/forward_gates.json" --iters 20 --warmup 3 --batch decode:1@4096 \
  --batch decode:64@4096 --batch decode:256@4096 --batch decode:64@65536 \
  --batch prefill:2048 --batch prefill:8192 --batch prefill:8192@65536
ls "$R"; (cd "$OUT" && tar czf s21b.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
