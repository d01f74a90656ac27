#!/usr/bin/env bash
# Session 14, call 2 (~9 minutes): issue 17's TTFT on the 4-layer checkpoint of sessions 12-13
# (v4-flash, 16 experts, bf16), now with a streamed request's first token sent from the
# prefill engine's answer (router/first_token.py), the router without it ("plain") measured
# beside it on the same engines. Both engines on one GPU over tcp. Then prefill attention
# tilings with one warpgroup per program (issue 13), with their bf16-rule outliers.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s14b.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/../device_env.sh"
start_call
python3 -m rackserve.cli model create --preset v4-flash --layers 4 --experts 16 \
  --dtype bfloat16 --out /tmp/pd_model > "$R/model_create.log" 2>&1
t=$(cap 300); echo "== P/D TTFT, 4 layers (${t}s)"
((t)) && timeout "$t" python3 benchmarks/pd_serving_bench.py --model /tmp/pd_model \
  --gpus 1 --transport tcp --lengths 1024,4096,16384 --repeats 5 --ttft-only \
  --alt-routers plain --logs "$R/pd_logs" --out "$R/pd_serving.json" 2>&1 \
  | grep -vE "^INFO|^\s*$" | tail -12
for f in "$R"/pd_logs/*.log; do
  grep -vE "^INFO|tensor/s|capturing CUDA" "$f" | tail -c 20000 > "$f.tail" && mv "$f.tail" "$f"
done
t=$(cap 200); echo "== prefill attention tilings at 8192 queries (${t}s)"
((t)) && timeout "$t" python3 benchmarks/prefill_bench.py --output "$R/prefill_attn.json" \
  --attention-only dv2_w4,dv2_w4_rows,rows,rows_bn64 2>&1 | tail -14
echo "== done in ${SECONDS}s"
