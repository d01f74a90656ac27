#!/usr/bin/env bash
# Session 33, when one call is all the device time there is: session 33's three decode changes
# (the step's static inputs copied straight from the staging buffer; one token's MoE align
# without the scans; wq_b's GEMV norming its input, ops.NORMED_GEMV_MAX_TOKENS) against
# session 32's forms of all three ("old") and of the last alone ("nonorm"), and the sparse
# attention unsplit where a query reads <= 256 rows ("nosplit", an override), bench forward at
# decode:1 and 4, alternating, two passes; the GPU tests of the changes; bench forward's gate cases;
# route + align alone at T = 1; the decode:1 replay timeline.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s33b.sh     (BUDGET_S: seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-570}
source "$(dirname "$0")/../device_env.sh"
start_call
nonorm='import rackserve.ops as o; o.NORMED_GEMV_MAX_TOKENS = None'
old=$nonorm'
import numpy as np
import rackserve.ops.triton.moe_routed as m
from rackserve.runner import cuda_graph as cg
m.ALIGN_ONE_TOKEN = False
def old_stage(self, key, inputs, table_writes, feed=None, extra=None):
    b = key[0]
    pad = b - len(inputs.input_ids)
    rows = np.asarray(inputs.rows, dtype=np.int64)[inputs.token_req]
    ids, positions = inputs.input_ids, inputs.positions
    if pad:
        zeros = np.zeros(pad, dtype=np.int64)
        ids, positions = np.concatenate([ids, zeros]), np.concatenate([positions, zeros])
        rows = np.concatenate([rows, np.full(pad, self.buffers.null_row, dtype=np.int64)])
    ids_d, pos_d, rows_d, w_index, w_values = self.buffers.upload([ids, positions, rows, *table_writes])
    self.buffers.apply_writes(w_index, w_values)
    for dst, src in zip(self.inputs(b)[:3], (ids_d, pos_d, rows_d)):
        dst.copy_(src)
cg._StepGraphs.stage = old_stage'
nosplit='base = attn.default_tiling
def one_split(*a, **k):
    t = base(*a, **k)
    return dataclasses.replace(t, num_splits=1) if a[3] <= 256 else t
attn.default_tiling = one_split'
for pass in 1 2; do
  for arm in old new nonorm nosplit; do
    case $arm in
      old) code=$old ;; new) code='pass' ;; nonorm) code=$nonorm ;; nosplit) code=$nosplit ;;
    esac
    t=$(cap 45); echo "== bench forward, $arm, pass $pass (${t}s)"
    ((t)) && forward_with "$code" "$R/forward_${arm}_$pass.json" --batch decode:1@4096 \
      --batch decode:4@4096 --iters 30 --warmup 5
  done
done
t=$(cap 60); echo "== pytest: static inputs, one-token align (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/runner/test_cuda_graph.py tests/ops/test_moe_routed.py \
  tests/ops/test_gemv.py -k "upload_writes or one_token or shared_beside or normed" > "$R/pytest.log" 2>&1; tail -2 "$R/pytest.log"
# the gate cases (no limit of their own: ~2 min), when as much is left
(( BUDGET_S - SECONDS > 150 )) && forward_gates
t=$(cap 30); echo "== latency_kernels route (${t}s)"
((t)) && timeout "$t" python3 benchmarks/latency_kernels.py --tokens 1 --parts route \
  --output "$R/latency_route.json" 2>&1 | grep -E "one-token|bt1 c16 w4|bt16 c64 w4"
replay_timelines 50 "$R/graph_gap.json" decode:1@4096
ls "$R"; (cd "$OUT" && tar czf s33b.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
