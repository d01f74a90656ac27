#!/usr/bin/env bash
# Session 23, call 2 (~7 minutes): the raw-q attention's GPU tests (call 1 cut them off at its
# cap), the MoE sort with the counts read 16 segments a load (moe_stages_bench), bench
# forward prefill with the fused q against the prologue's q (alternating, three passes), and
# where prefill's GPU time goes now (profile_forward).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s23b.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-500}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 100); echo "== attention tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider -rf -x \
  tests/ops/test_attn_prologue.py tests/ops/test_prefill_attn.py tests/ops/test_sparse_attn.py \
  tests/ops/test_prefill_attn_wgmma.py tests/model/test_fast_path_cpu.py \
  -k "raw_q or without_q or fast_path or holes" > "$R/pytest_attn.log" 2>&1
tail -3 "$R/pytest_attn.log"
t=$(cap 60); echo "== MoE sort tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider -rf \
  tests/ops/test_prefill_moe.py tests/ops/test_fused_moe.py -k "sort or align" > "$R/pytest_moe.log" 2>&1
tail -3 "$R/pytest_moe.log"
t=$(cap 60); echo "== MoE stages (${t}s)"
((t)) && timeout "$t" python3 -c "import json, sys, moe_stages_bench as b
b.TILINGS = []
json.dump(b.run((2048, 8192)), open(sys.argv[1], 'w'), indent=1)" "$R/moe_stages.json" \
  | grep -E "metadata|sort|gather|grouped"
forward_ab rawq 'pass' prologue 'import rackserve.ops as o
o.Kernels.attention_norms_q = lambda self, q: False' --iters 20 --warmup 3 \
  --batch prefill:2048 --batch prefill:8192
t=$(cap 60); echo "== bench forward, rawq, pass 3 (${t}s)"
((t)) && forward_with 'pass' "$R/forward_rawq_3.json" --iters 20 --warmup 3 --batch prefill:2048
t=$(cap 80); echo "== profile (${t}s)"
((t)) && timeout "$t" python3 benchmarks/profile_forward.py --batch prefill:2048 \
  --batch prefill:8192 --top 40 --output "$R/profile_prefill.json" | grep -v "^ *$" | cut -c1-150 | tail -90
ls "$R"; (cd "$OUT" && tar czf s23b.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
