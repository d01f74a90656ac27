#!/usr/bin/env bash
# Session 13, call 4 (~6 minutes): P/D with the first token carried (the decode engine emits
# the prefill engine's t1 on arrival and pulls the whole prompt's KV): TTFT and the second
# token at 1K, steady ITL, and ITL of 8 streams under a burst of 32 x 4K arrivals with the
# cap of 4 and without it (session 12: p99 3.2 -> 7.2 ms capped, 3.9 -> 22.1 ms uncapped).
# Both engines on one GPU over tcp. Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s13d.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-450}
source "$(dirname "$0")/../device_env.sh"
start_call
python3 -m rackserve.cli model create --preset v4-flash --layers 4 --experts 16 \
  --dtype bfloat16 --out /tmp/pd_model > "$R/model_create.log" 2>&1
t=$(cap 420); echo "== P/D ITL under a burst over tcp (${t}s)"
((t)) && timeout "$t" python3 benchmarks/pd_serving_bench.py --model /tmp/pd_model \
  --gpus 1 --transport tcp --lengths 1024 --repeats 3 --burst 32 --burst-length 4096 \
  --running-tokens 1500 --burst-delay-s 2 \
  --logs "$R/pd_logs" --out "$R/pd_serving.json" 2>&1 | grep -vE "^INFO|^\s*$" | tail -14
for f in "$R"/pd_logs/*.log; do
  grep -vE "^INFO|tensor/s|capturing CUDA" "$f" | tail -c 20000 > "$f.tail" && mv "$f.tail" "$f"
done
tar czf "$OUT/s13d.tgz" -C "$OUT" r
echo "== done in ${SECONDS}s"
