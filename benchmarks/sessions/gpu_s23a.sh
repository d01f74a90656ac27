#!/usr/bin/env bash
# Session 23, call 1 (~7 minutes): the prefill attention takes wq_b's raw q and norms +
# rotates it on its q load (Kernels.attention_norms_q; the prologue skips q): its GPU tests
# and last session's MoE launch code on the GPU, bench forward prefill with the fused q
# against the prologue's q (alternating), then every forward gate.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s23a.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 150); echo "== attention tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider -rf \
  tests/ops/test_prefill_attn_wgmma.py tests/ops/test_attn_prologue.py \
  tests/ops/test_prefill_attn.py tests/ops/test_sparse_attn.py -k "raw_q or v4 or wgmma or prologue or holes or agrees or fast_path" \
  tests/model/test_fast_path_cpu.py > "$R/pytest_attn.log" 2>&1
tail -1 "$R/pytest_attn.log"
forward_ab rawq 'pass' prologue 'import rackserve.ops as o
o.Kernels.attention_norms_q = lambda self, q: False' --iters 10 --warmup 2 \
  --batch prefill:2048 --batch prefill:8192
echo "== bench forward, every gate"
forward_with 'pass' "$R/forward_gates.json" --iters 20 --warmup 3 --batch decode:1@4096 \
  --batch decode:64@4096 --batch decode:256@4096 --batch decode:64@65536 \
  --batch prefill:2048 --batch prefill:8192 --batch prefill:8192@65536
t=$(cap 120); echo "== MoE and indexer tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider -rf \
  tests/ops/test_prefill_moe.py tests/ops/test_fused_moe.py tests/ops/test_moe_routed.py \
  tests/ops/test_prefill_experts.py tests/ops/test_indexer.py tests/ops/test_indexer_topk.py \
  > "$R/pytest_moe.log" 2>&1
tail -1 "$R/pytest_moe.log"
ls "$R"; (cd "$OUT" && tar czf s23a.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
