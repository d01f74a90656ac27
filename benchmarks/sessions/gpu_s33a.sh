#!/usr/bin/env bash
# Session 33: gpu_s32b.sh (below), and first the step's static inputs copied straight from the
# staging buffer (StepBuffers.upload's fields, one copy, no copy kernels) against the
# upload + three copy kernels of session 32 (old_stage below), bench forward at decode:1, 4
# and 64, alternating, two passes, with host_probe's stage timings; and one token's MoE align
# without the scans (moe_routed.ALIGN_ONE_TOKEN) against with them, in the same rotation
# (arm "scans"), with latency_kernels' route + align alone.
# Session 32: do a captured graph's two branches run side by side whatever their issue order
# (graph_branch_probe.py)? The shared expert's launches issued between the router's and the
# routed experts' (moe_routed.SHARED_ISSUED_LATE, the default) against before them, and the
# mHC's comb beside at 64 tokens with it: GPU tests, bench forward alternating, two passes;
# the one-launch mHC (RACKSERVE_MHC_FUSED=1) now with the comb beside, against the defaults
# # at decode:1 and 4, and the sparse attention unsplit at <= 256 rows (session 33: the replay
# timelines go with the gates' call).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s33a.sh     (BUDGET_S: seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/../device_env.sh"
start_call
echo "== graph_branch_probe"
for args in "--n 6 --us 5" "--n 6 --us 2" "--n 2 --us 5"; do
  timeout 40 python3 benchmarks/graph_branch_probe.py $args \
    --output "$R/probe_$(echo $args | tr -d ' -').json" 2>&1 | tail -1
done
old_stage='import numpy as np
from rackserve.runner import cuda_graph as cg
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
scans='import rackserve.ops.triton.moe_routed as m; m.ALIGN_ONE_TOKEN = False'
for pass in 1 2; do
  for arm in old scans new; do
    case $arm in old) code=$old_stage ;; scans) code=$scans ;; new) code='pass' ;; esac
    t=$(cap 45); echo "== bench forward, $arm, pass $pass (${t}s)"
    ((t)) && forward_with "$code" "$R/forward_${arm}_$pass.json" --batch decode:1@4096 \
      --batch decode:4@4096 --batch decode:64@4096 --iters 30 --warmup 5
  done
done
t=$(cap 40); echo "== latency_kernels route (${t}s)"
((t)) && timeout "$t" python3 benchmarks/latency_kernels.py --tokens 1 --parts route \
  --output "$R/latency_route.json" 2>&1 | grep -E "one-token|bt1 c16 w4|bt16 c64 w4"
t=$(cap 60); echo "== host_probe (${t}s)"
((t)) && timeout "$t" python3 benchmarks/host_probe.py --output "$R/host_probe.json" \
  --decode decode:1@4096 --decode decode:64@4096 2>&1 | tail -2
t=$(cap 60); echo "== pytest shared beside, metadata, mHC fused + comb beside (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/ops/test_moe_routed.py tests/model/test_gpu_fastpath.py \
  tests/runner/test_graph_launches.py tests/runner/test_cuda_graph.py \
  tests/ops/test_mhc.py -k "upload_writes or shared_beside or (bit_identical_to_eager and shared) or \
  matches_build or comb_beside_in_a_captured or fused_launch_on_gpu" \
  > "$R/pytest.log" 2>&1; tail -3 "$R/pytest.log"
before='import rackserve.ops.triton.moe_routed as m; m.SHARED_ISSUED_LATE = False'
for pass in 1 2; do
  for arm in before after; do
    case $arm in
      before) code=$before ;; after) code='pass' ;;
    esac
    t=$(cap 50); echo "== bench forward, $arm, pass $pass (${t}s)"
    ((t)) && forward_with "$code" "$R/forward_${arm}_$pass.json" --batch decode:4@4096 \
      --batch decode:64@4096 --batch decode:128@4096 --iters 30 --warmup 5
  done
done
# decode:1 / 4: the one-launch mHC with the comb beside; the sparse attention without its
# split (and combine launch) when a query reads at most 256 rows (HCA at 4096: 160 rows, 5
# splits of one 32-row tile and a combine launch now)
fused='import os; os.environ["RACKSERVE_MHC_FUSED"] = "1"'
nosplit='base = attn.default_tiling
def one_split(*a, **k):
    t = base(*a, **k)
    return dataclasses.replace(t, num_splits=1) if a[3] <= 256 else t
attn.default_tiling = one_split'
for pass in 1 2; do
  for arm in k1k2 fused nosplit; do
    case $arm in k1k2) code='pass' ;; fused) code=$fused ;; nosplit) code=$nosplit ;; esac
    t=$(cap 40); echo "== bench forward, $arm, pass $pass (${t}s)"
    ((t)) && forward_with "$code" "$R/forward_${arm}_$pass.json" --batch decode:1@4096 \
      --batch decode:4@4096 --iters 30 --warmup 5
  done
done
ls "$R"; (cd "$OUT" && tar czf s33a.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
