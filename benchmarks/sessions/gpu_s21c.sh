#!/usr/bin/env bash
# Session 21, call 7 (~5 minutes): the GPU tests call 6 could not reach with the wgmma
# attention on by default: chunked prefill at V4-Flash sizes (whole / 512 / 97-token chunks
# within twice the bf16 reference's error), the Triton prefill kernel's V4-size tests, the
# fp32 fast path and graph replay against eager.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s21c.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-290}
source "$(dirname "$0")/../device_env.sh"
start_call
for f in tests/model/test_chunking_gpu.py tests/ops/test_prefill_attn.py \
  tests/model/test_gpu_fastpath.py; do
  t=$(cap 150); echo "== $f (${t}s)"
  ((t)) && timeout "$t" python3 -m pytest -q -m gpu "$f" -p no:cacheprovider -rf \
    -k "not teacher_forced and not no_less_accurate" >> "$R/pytest.log" 2>&1
  tail -1 "$R/pytest.log"
done
(cd "$OUT" && tar czf s21c.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
