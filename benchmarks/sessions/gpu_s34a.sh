#!/usr/bin/env bash
# Prepared in session 33: its three untimed decode changes against their old forms, bench
# forward alternating, two passes, at decode:1 / 4 / 64 (and prefill:8192 for the embedding):
#   old       all three old: the router's logits in a launch of their own
#             (moe_routed.ROUTER_IN_ALIGN_MAX_TOKENS = None), the embedding as a gather + a
#             copy (reference.embed_streams), the token mask and the expert counts' zeroing
#             as two launches beside the step metadata
#   norouter  the new forms but the router's
#   new       the defaults
# then session 32's prepared arms that never ran (session 34 left out two for time: the graph
# branch probe and the shared expert issued before the router): the
# one-launch mHC with the comb beside (RACKSERVE_MHC_FUSED=1), and the lm_head on cuBLAS
# (LOGITS_GEMV_MAX_TOKENS = None: the GEMV was measured on H100s only) at decode:1 / 4 / 64,
# and (added in session 34) the L2 prefetch beside the latency-bound chains
# (ops.L2_PREFETCH_MAX_TOKENS = 16: the next weight stream's first 16 MB, on a stream of its
# own, many programs) and the decode attention's combine in its last split
# (sparse_attn.FUSED_COMBINE_MAX_SPLITS = 8: HCA's 5 splits at decode:1); the GPU tests
# of all of it; the decode:1 replay timeline.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s34a.sh     (BUDGET_S: seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/../device_env.sh"
start_call
norouter='import rackserve.ops.triton.moe_routed as m; m.ROUTER_IN_ALIGN_MAX_TOKENS = None'
old=$norouter'
exec(open("benchmarks/sessions/s33_old_forms.py").read())'
for pass in 1 2; do
  for arm in old norouter new; do
    case $arm in old) code=$old ;; norouter) code=$norouter ;; new) code='pass' ;; esac
    t=$(cap 60); echo "== bench forward, $arm, pass $pass (${t}s)"
    ((t)) && forward_with "$code" "$R/forward_${arm}_$pass.json" --batch decode:1@4096 \
      --batch decode:4@4096 --batch decode:64@4096 --batch prefill:8192 --iters 20 --warmup 3
  done
done
t=$(cap 70); echo "== pytest: the changes' GPU tests (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/ops/test_moe_routed.py tests/ops/test_embed.py tests/ops/test_l2_prefetch.py \
  tests/ops/test_sparse_attn.py \
  tests/runner/test_graph_launches.py tests/runner/test_cuda_graph.py tests/model/test_gpu_fastpath.py \
  tests/bench/test_forward.py \
  -k "router_in or one_token or embed or matches_build or upload_writes or bit_identical_to_eager or pipelined or prefetches_change or fused_combine" \
  > "$R/pytest.log" 2>&1; tail -2 "$R/pytest.log"
fused='import os; os.environ["RACKSERVE_MHC_FUSED"] = "1"'
cublas='import rackserve.ops as o; o.LOGITS_GEMV_MAX_TOKENS = None'
prefetch='import rackserve.ops as o; o.L2_PREFETCH_MAX_TOKENS = 16'
combine='import rackserve.ops.triton.sparse_attn as a; a.FUSED_COMBINE_MAX_SPLITS = 8'
for pass in 1 2; do
  for arm in late prefetch combine fused cublas; do
    case $arm in
      late) code='pass' ;; fused) code=$fused ;; cublas) code=$cublas ;;
      prefetch) code=$prefetch ;; combine) code=$combine ;;
    esac
    t=$(cap 35); echo "== bench forward, $arm, pass $pass (${t}s)"
    ((t)) && forward_with "$code" "$R/forward_${arm}_$pass.json" --batch decode:1@4096 \
      --batch decode:4@4096 --batch decode:64@4096 --iters 30 --warmup 5
  done
done
replay_timelines 50 "$R/graph_gap.json" decode:1@4096
ls "$R"; (cd "$OUT" && tar czf s34a.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
