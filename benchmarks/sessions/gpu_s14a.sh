#!/usr/bin/env bash
# Session 14, calls 1 and 3 (~7 minutes): issue 17's TTFT on a model of V4-Flash's depth. The
# 4-layer checkpoint's prefill is 16-106 ms, so two HTTP hops weigh more there than they
# would on the real model; here 43 layers (8 routed experts: a prefill's FLOPs follow the
# top-6, not the expert count) against the same P/D pair. Engines eager: TTFT is a prefill
# forward (eager anyway) and the first token (carried, emitted on arrival).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s14a.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/../device_env.sh"
start_call
echo "== model create, 43 layers"
/usr/bin/time -f "%e s, %M KB" python3 -m rackserve.cli model create --preset v4-flash \
  --layers 43 --experts 8 --dtype bfloat16 --no-mtp --out /tmp/deep > "$R/model_create.log" 2>&1
tail -2 "$R/model_create.log"; du -sh /tmp/deep; echo "at ${SECONDS}s"
t=$(cap 480); echo "== P/D TTFT, 43 layers (${t}s)"
((t)) && timeout "$t" python3 benchmarks/pd_serving_bench.py --model /tmp/deep \
  --gpus 1 --transport tcp --lengths ${LENGTHS:-1024,4096,16384} --repeats ${REPEATS:-3} --ttft-only \
  --engine-arg=--enforce-eager --alt-routers plain --logs "$R/pd_logs" \
  --out "$R/pd_serving_deep.json" 2>&1 \
  | grep -vE "^INFO|^\s*$" | tail -12
for f in "$R"/pd_logs/*.log; do
  grep -vE "^INFO|tensor/s|capturing CUDA" "$f" | tail -c 20000 > "$f.tail" && mv "$f.tail" "$f"
done
echo "== done in ${SECONDS}s"
