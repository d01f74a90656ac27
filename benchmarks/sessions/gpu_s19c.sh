#!/usr/bin/env bash
# Session 19, call 3 (~9 minutes): the new defaults (the down kernel's grid with the n-tiles
# fastest, the Sinkhorn's one division per row) at every gate. Their GPU tests (and the
# graph replay's bit equality); bench forward at the gates, twice; bench decode next to
# transformers; the FP4 down kernel in both grid orders; the decode:256 replay timeline.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s19c.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/../device_env.sh"
start_call
GATES=(--iters 20 --warmup 3 --batch decode:1@4096 --batch decode:64@4096
  --batch decode:256@4096 --batch decode:64@65536 --batch prefill:2048 --batch prefill:8192)
t=$(cap 130); echo "== GPU tests: fused MoE, graph replay, fp32 fast path (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m gpu tests/ops/test_fused_moe.py \
  tests/model/test_gpu_fastpath.py -k "not teacher_forced and not no_less_accurate" \
  -p no:cacheprovider -rf > "$R/pytest.log" 2>&1
tail -4 "$R/pytest.log"
for pass in 1 2; do
  t=$(cap 60); echo "== bench forward, gates, pass $pass (${t}s)"
  ((t)) && forward_with "pass" "$R/forward_$pass.json" "${GATES[@]}"
done
decode_vs_transformers
t=$(cap 60); echo "== FP4 down kernel: grid orders (${t}s)"
((t)) && timeout "$t" python3 benchmarks/fp4_moe_sweep.py --tokens 64 256 \
  --variants tile_fastest --output "$R/fp4_order.json" 2>&1 | tail -6
t=$(cap 40); echo "== replay timeline, decode:256 (${t}s)"
((t)) && timeout "$t" python3 benchmarks/graph_gap.py --batch decode:256@4096 \
  --output "$R/graph_gap_256.json" > /dev/null 2>&1
ls "$R"; (cd "$OUT" && tar czf s19c.tgz r && rm -rf r)  # at most 8 files come back
echo "== done in ${SECONDS}s"
