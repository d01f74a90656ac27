#!/usr/bin/env bash
# Prepared in session 11 for the next device call (~7 minutes): issue 17 on one GPU after
# the tcp data path's copies went (83f01ee) and the bench's streams asked for logprobs (every
# token a chunk, c8eef47). 1. pd_transfer_bench over TCP, streamed as serving pulls, and the
# whole-region path, at 1K / 16K / 128K tokens; 2. pd_serving_bench as gpu_s11b.sh: TTFT of
# P/D against aggregated (each length warmed), the steady ITL of 8 streams on each side, the
# ITL of 8 streams under a burst of 32 x 4K-token requests with cap 4 and without.
# On nvidia-h200-x2 pass GPUS=2 TRANSPORT=nccl; PREFILL_CHUNK=1024 gives the prefill engine
# --long-prefill-token-threshold (a 4K prompt's KV then streams while its later chunks run).
# Needs `scripts/device_wheels.sh all`.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s12b.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-450}
GPUS=${GPUS:-1}
TRANSPORT=${TRANSPORT:-tcp}
PREFILL_CHUNK=${PREFILL_CHUNK:-0}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 60); echo "== KV transfer, $TRANSPORT streamed and whole (${t}s)"
((t)) && timeout "$t" bash -c "python3 benchmarks/pd_transfer_bench.py --transport $TRANSPORT \
  --lengths 1024,16384,131072 --repeats 3 --out $R/pd_transfer_streamed.json; \
  python3 benchmarks/pd_transfer_bench.py --transport $TRANSPORT --whole \
  --lengths 1024,16384,131072 --repeats 3 --out $R/pd_transfer_whole.json" 2>&1 | grep tokens
python3 -m rackserve.cli model create --preset v4-flash --layers 4 --experts 16 \
  --dtype bfloat16 --out /tmp/pd_model > "$R/model_create.log" 2>&1
t=$(cap 380); echo "== P/D serving over $TRANSPORT (${t}s)"
((t)) && timeout "$t" python3 benchmarks/pd_serving_bench.py --model /tmp/pd_model \
  --gpus "$GPUS" --transport "$TRANSPORT" --lengths 1024,4096,16384 --repeats 2 \
  --running-tokens 1500 --burst-delay-s 2 --prefill-chunk "$PREFILL_CHUNK" --logs "$R/pd_logs" \
  --out "$R/pd_serving.json" 2>&1 \
  | grep -vE "^INFO|^\s*$" | tail -30
for f in "$R"/pd_logs/*.log; do
  grep -vE "^INFO|tensor/s|capturing CUDA" "$f" | tail -c 20000 > "$f.tail" && mv "$f.tail" "$f"
done
echo "== done in ${SECONDS}s"
