#!/usr/bin/env bash
# Session 22, call 1 (~8 minutes): the wgmma prefill attention's tests at HEAD (d6596d0's
# row-mask helper never ran on a GPU), every bench forward gate, where prefill's GPU time
# goes at 2048 / 8192 tokens (profile, graph replay against eager), the MoE's stages alone,
# and the decode step against transformers on the same checkpoint.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s22a.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 90); echo "== wgmma tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m "gpu or not gpu" tests/ops/test_prefill_attn_wgmma.py \
  -p no:cacheprovider -rf > "$R/pytest.log" 2>&1
tail -1 "$R/pytest.log"
echo "== bench forward, every gate"
forward_with 'pass' "$R/forward_gates.json" --iters 20 --warmup 3 --batch decode:1@4096 \
  --batch decode:64@4096 --batch decode:256@4096 --batch decode:64@65536 \
  --batch prefill:2048 --batch prefill:8192 --batch prefill:8192@65536
t=$(cap 60); echo "== MoE stages (${t}s)"
((t)) && timeout "$t" python3 benchmarks/moe_stages_bench.py --tokens 2048 8192 \
  --output "$R/moe_stages.json"
t=$(cap 70); echo "== prefill graph probe (${t}s)"
((t)) && timeout "$t" python3 benchmarks/prefill_graph_probe.py --batch prefill:2048 \
  --batch prefill:8192 --output "$R/prefill_graph.json"
t=$(cap 70); echo "== profile (${t}s)"
((t)) && timeout "$t" python3 benchmarks/profile_forward.py --batch prefill:2048 \
  --batch prefill:8192 --top 40 --output "$R/profile_prefill.json" | grep -v "^ *$" | cut -c1-150 | tail -90
decode_vs_transformers
ls "$R"; (cd "$OUT" && tar czf s22a.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
