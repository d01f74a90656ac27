#!/usr/bin/env bash
# Prepared in session 12 for the next device call (~5 minutes): issue 17's TTFT again, now
# without an HTTP client built inside each measurement (pd_serving_bench keeps one: building
# one cost 17-30 ms on the CI host) and with the router's own histograms (its prefill round
# trip, its first byte) beside the engines'. Both engines on one GPU over tcp; on
# nvidia-h200-x2 pass GPUS=2 TRANSPORT=nccl.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s13b.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-330}
GPUS=${GPUS:-1}
TRANSPORT=${TRANSPORT:-tcp}
source "$(dirname "$0")/../device_env.sh"
start_call
python3 -m rackserve.cli model create --preset v4-flash --layers 4 --experts 16 \
  --dtype bfloat16 --out /tmp/pd_model > "$R/model_create.log" 2>&1
t=$(cap 300); echo "== P/D TTFT over $TRANSPORT (${t}s)"
((t)) && timeout "$t" python3 benchmarks/pd_serving_bench.py --model /tmp/pd_model \
  --gpus "$GPUS" --transport "$TRANSPORT" --lengths 1024,4096,16384 --repeats 5 --ttft-only \
  --logs "$R/pd_logs" --out "$R/pd_serving.json" 2>&1 | grep -vE "^INFO|^\s*$" | tail -12
for f in "$R"/pd_logs/*.log; do
  grep -vE "^INFO|tensor/s|capturing CUDA" "$f" | tail -c 20000 > "$f.tail" && mv "$f.tail" "$f"
done
tar czf "$OUT/s13b.tgz" -C "$OUT" r
echo "== done in ${SECONDS}s"
