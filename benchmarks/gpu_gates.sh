#!/usr/bin/env bash
# Every gate of the GPU fast path's last two milestones (issues 13 and 14) in one device
# call, on whatever card comes (the gates are set on an H200; the card is in every record):
#   accuracy  the bf16 gates of the whole model: teacher-forced against the bf16 reference
#             (contexts 100, 600, 4096), no less accurate than it against fp32
#   forward   bench forward, v4-flash preset, 4 layers, 64 experts: decode 1 / 64 / 256 at
#             4096, decode:64@65536, prefill 2048 / 8192 / 8192@65536
#   decode    bench decode at 1 and 64 requests (sync and async) next to transformers on the
#             same checkpoint; step minus forward at 256 requests (async)
#   tests     the correctness gates: chunking invariance and prefix hits at v4-flash sizes,
#             fp32 fast path against the references, graph replay against eager, seeded
#             sampling batch-invariant, ring tables (cut to what is left of the budget)
# Usage: RACKSERVE_COMMIT=<sha> [PARTS="forward decode"] [BUDGET_S=585] bash benchmarks/gpu_gates.sh
# Results under $OUT/r, packed into $OUT/gates.tgz; benchmarks/gates.py prints the gates met
# or not (a table for the record) and writes them to gates.json.
set -uo pipefail
BUDGET_S=${BUDGET_S:-585}
PARTS=" ${PARTS:-accuracy forward decode tests} "
on() { [[ "$PARTS" == *" $1 "* ]]; }
source "$(dirname "$0")/device_env.sh"
start_call
on accuracy && accuracy_gates
on forward && forward_gates
if on decode; then
  decode_vs_transformers
  t=$(cap 45); echo "== bench decode, 256 requests, async: step minus forward (${t}s)"
  ((t)) && [[ -d /tmp/flash4 ]] && timeout "$t" "${rs[@]}" bench decode --model /tmp/flash4 \
    --concurrency 256 --context 512 --steps 30 --warmup 5 --kv-cache-memory 8000000000 \
    --async-scheduling --output "$R/decode_256_async.json" 2>&1 | tail -1
fi
if on tests; then
  t=$(cap 400); echo "== correctness gates (${t}s)"
  ((t)) && timeout "$t" "${pt[@]}" -s tests/model/test_chunking_gpu.py \
    tests/model/test_gpu_fastpath.py tests/runner/test_graph_sampling.py \
    tests/runner/test_ring_tables.py -m gpu -k "not teacher_forced and not no_less_accurate" \
    > "$R/pytest_gates.log" 2>&1
  grep -E "^hit|^chunks|passed|failed|skipped|FAILED" "$R/pytest_gates.log" | tail -16
fi
echo "== the gates"
python3 benchmarks/gates.py "$R" --output "$R/gates.json"
ls "$R"; (cd "$OUT" && tar czf gates.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
