#!/usr/bin/env bash
# gpu_s34a.sh cut to a short call (session 34, machines scarce): bench forward at decode:1 /
# 4 / 64, alternating, two passes, the defaults against session 33's three untimed changes
# in their old forms (old: see gpu_s34a.sh), the L2 prefetch on its own stream (prefetch),
# the attention's combine in its last split (combine), the lm_head on cuBLAS (cublas) and
# the one-launch mHC with the comb beside (fused: RACKSERVE_MHC_FUSED=1);
# then the GPU tests of the new code.
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s34b.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-330}
source "$(dirname "$0")/../device_env.sh"
start_call
norouter='import rackserve.ops.triton.moe_routed as m; m.ROUTER_IN_ALIGN_MAX_TOKENS = None'
old=$norouter'
exec(open("benchmarks/sessions/s33_old_forms.py").read())'
prefetch='import rackserve.ops as o; o.L2_PREFETCH_MAX_TOKENS = 16'
combine='import rackserve.ops.triton.sparse_attn as a; a.FUSED_COMBINE_MAX_SPLITS = 8'
cublas='import rackserve.ops as o; o.LOGITS_GEMV_MAX_TOKENS = None'
fused='import os; os.environ["RACKSERVE_MHC_FUSED"] = "1"'
for pass in 1 2; do
  for arm in new old prefetch combine cublas fused; do
    case $arm in
      new) code='pass' ;; old) code=$old ;; prefetch) code=$prefetch ;;
      combine) code=$combine ;; cublas) code=$cublas ;; fused) code=$fused ;;
    esac
    t=$(cap 40); echo "== bench forward, $arm, pass $pass (${t}s)"
    ((t)) && forward_with "$code" "$R/forward_${arm}_$pass.json" --batch decode:1@4096 \
      --batch decode:4@4096 --batch decode:64@4096 --iters 20 --warmup 3
  done
done
t=$(cap 80); echo "== pytest: the new code's GPU tests (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/ops/test_l2_prefetch.py tests/ops/test_sparse_attn.py \
  tests/bench/test_forward.py -k "prefetches_change or fused_combine or pipelined" \
  > "$R/pytest.log" 2>&1; tail -2 "$R/pytest.log"
ls "$R"; (cd "$OUT" && tar czf s34b.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
