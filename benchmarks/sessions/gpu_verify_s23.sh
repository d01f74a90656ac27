#!/usr/bin/env bash
# The GPU checks session 23 ran out of device time for (~7 minutes): every graph path after
# the capture refactor (capture_region, frozen_gc, capture_step_graphs; 376b30e, 61c9a81),
# the rewritten async feed test, the prefill-graph test's mixed case, the speculation
# graphs; then l2_prefetch_probe (fixed after call 5), and sampling in the decode graphs
# A/B'd against eager sampling in alternating processes (bench decode, synchronous).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_verify_s23.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-420}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 200); echo "== graph tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider -rf \
  tests/model/test_gpu_fastpath.py tests/runner/test_graph_sampling.py \
  tests/spec_decode/test_spec_graphs_gpu.py tests/runner/test_ring_tables.py \
  -k "prefill_graph or bit_identical or captured or cuda or gpu" > "$R/pytest_graphs.log" 2>&1
tail -3 "$R/pytest_graphs.log"
t=$(cap 80); echo "== MoE align / sort tests (${t}s; 75fa072 shared their chunk load)"
((t)) && timeout "$t" python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider -rf \
  tests/ops/test_prefill_moe.py tests/ops/test_fused_moe.py -k "sort or align" \
  > "$R/pytest_moe.log" 2>&1
tail -3 "$R/pytest_moe.log"
t=$(cap 40); echo "== L2 prefetch probe (${t}s)"
((t)) && timeout "$t" python3 benchmarks/l2_prefetch_probe.py --n 8192 --k 4096 \
  --mb 0 16 32 48 --output "$R/l2_prefetch.json"
t=$(cap 120); echo "== model create (${t}s)"
((t)) && timeout "$t" python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))' \
  model create --preset v4-flash --layers 4 --experts 64 --dtype bfloat16 --no-mtp \
  --out /tmp/flash4 2>&1 | tail -1
pass=0
for side in graph eager graph eager; do  # synchronous steps: the host's time shows there
  pass=$((pass + 1))
  code='pass'
  [[ $side == eager ]] && code='import rackserve.runner.model_runner as m
m.in_graph_sampling = lambda *a: None'
  t=$(cap 40); echo "== bench decode, 1 request, sync, sampling $side (${t}s)"
  ((t)) && [[ -d /tmp/flash4 ]] && timeout "$t" python3 -c "import sys
exec(sys.argv[1])
from rackserve.cli import main; sys.exit(main(sys.argv[2:]))" "$code" bench decode \
    --model /tmp/flash4 --concurrency 1 --context 512 --steps 30 --warmup 5 \
    --kv-cache-memory 8000000000 --output "$R/decode_1_sync_${side}_$pass.json" 2>&1 | tail -1
done
ls "$R"; (cd "$OUT" && tar czf verify_s23.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
