#!/usr/bin/env bash
# Session 32: do a captured graph's two branches run side by side whatever their issue order
# (graph_branch_probe.py)? The shared expert's launches issued between the router's and the
# routed experts' (moe_routed.SHARED_ISSUED_LATE, the default) against before them, and the
# mHC's comb beside at 64 tokens with it: GPU tests, bench forward alternating, two passes;
# the one-launch mHC (RACKSERVE_MHC_FUSED=1) now with the comb beside, against the defaults
# at decode:1 and 4, and the sparse attention unsplit at <= 256 rows; the replay timelines at decode:1 and 64 (the step metadata in 5
# launches).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s32b.sh     (BUDGET_S: seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-420}
source "$(dirname "$0")/../device_env.sh"
start_call
echo "== graph_branch_probe"
for args in "--n 6 --us 5" "--n 6 --us 2" "--n 2 --us 5"; do
  timeout 40 python3 benchmarks/graph_branch_probe.py $args \
    --output "$R/probe_$(echo $args | tr -d ' -').json" 2>&1 | tail -1
done
t=$(cap 90); echo "== pytest shared beside, metadata, mHC fused + comb beside (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/ops/test_moe_routed.py tests/model/test_gpu_fastpath.py \
  tests/runner/test_graph_launches.py tests/runner/test_cuda_graph.py \
  tests/ops/test_mhc.py -k "shared_beside or (bit_identical_to_eager and shared) or \
  matches_build or comb_beside_in_a_captured or fused_launch_on_gpu" \
  > "$R/pytest.log" 2>&1; tail -3 "$R/pytest.log"
before='import rackserve.ops.triton.moe_routed as m; m.SHARED_ISSUED_LATE = False'
for pass in 1 2; do
  for arm in before after comb64; do
    case $arm in
      before) code=$before ;; after) code='pass' ;; comb64) code='mhc.COMB_BESIDE_MAX_TOKENS = 64' ;;
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
replay_timelines 50 "$R/graph_gap.json" decode:1@4096 decode:64@4096
ls "$R"; (cd "$OUT" && tar czf s32b.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
