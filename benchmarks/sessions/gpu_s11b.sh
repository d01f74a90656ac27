#!/usr/bin/env bash
# Session 11's second call (~7 minutes): issue 17's serving figures on one GPU, after 5794fb8
# (two engines share the GPU by per-instance --gpu-memory-utilization; a chunked prefill no
# longer kills the engine). pd_serving_bench over TCP: TTFT of 1 prefill + 1 decode + router
# against one aggregated engine at 1K / 4K / 16K tokens (each length warmed first), the ITL of
# 8 streams alone on each (the floor), then the ITL of 8 running streams
# (1500 tokens each, so they outlast the burst) while 32 requests of 4K tokens arrive, with
# the decode side's admission cap 4 and without it. Needs `scripts/device_wheels.sh all`.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s11b.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-420}
source "$(dirname "$0")/../device_env.sh"
start_call
python3 -m rackserve.cli model create --preset v4-flash --layers 4 --experts 16 \
  --dtype bfloat16 --out /tmp/pd_model > "$R/model_create.log" 2>&1
t=$(cap 400); echo "== P/D serving on one GPU over TCP (${t}s)"
((t)) && timeout "$t" python3 benchmarks/pd_serving_bench.py --model /tmp/pd_model --gpus 1 \
  --transport tcp --lengths 1024,4096,16384 --repeats 2 --running-tokens 1500 \
  --burst-delay-s 2 --logs "$R/pd_logs" --out "$R/pd_serving.json" 2>&1 \
  | grep -vE "^INFO|^\s*$" | tail -30
for f in "$R"/pd_logs/*.log; do
  grep -vE "^INFO|tensor/s|capturing CUDA" "$f" | tail -c 20000 > "$f.tail" && mv "$f.tail" "$f"
done
echo "== done in ${SECONDS}s"
