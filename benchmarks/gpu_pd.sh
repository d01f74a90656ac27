#!/usr/bin/env bash
# P/D disaggregation on GPUs, one call (the lead runs it on the device machine):
#   bash benchmarks/gpu_pd.sh            # JSON under $OUT (default ./out/gpu_pd)
# 1. KV transfer bandwidth vs request length (1K..128K tokens, V4-Flash cache groups, bf16),
#    producer on GPU 0, consumer on GPU 1: NCCL, and TCP for reference (through host
#    memory); with one GPU both sides share it and only TCP runs.
# 2. TTFT of 1 prefill + 1 decode + router against one aggregated engine at low load (also
#    with the router's --overlap-transfer: the decode request goes out with the prefill one), and
#    the ITL of 8 running streams while 32 requests arrive at once, with the decode side's
#    admission cap (--max-kv-loads-per-step 4) and without it (0). Model: a random
#    checkpoint of the V4-Flash shapes cut to PD_LAYERS layers / PD_EXPERTS experts.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu_pd}
mkdir -p "$OUT"
PY=${PY:-python}
source benchmarks/device_env.sh  # the carried wheels (msgspec, pyzmq) and src/
GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
echo "GPUs visible: $GPUS"
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpus.csv"
if $PY -c "import nixl" 2>/dev/null; then echo "nixl importable"; else echo "nixl not installed"; fi
# NCCL refuses two ranks on one GPU: with one GPU lent, the KV goes through host memory.
if [ "$GPUS" -ge 2 ]; then TRANSPORT=nccl; else TRANSPORT=tcp; fi
echo "transport: $TRANSPORT"

echo "== 1. transfer bandwidth"
$PY benchmarks/pd_transfer_bench.py --transport "$TRANSPORT" --out "$OUT/pd_transfer_$TRANSPORT.json"
$PY benchmarks/pd_transfer_bench.py --transport tcp --lengths 1024,16384,131072 --repeats 2 \
    --out "$OUT/pd_transfer_tcp.json"

echo "== 2. TTFT overhead and ITL under a burst"
MODEL=${PD_MODEL:-$OUT/model}
if [ ! -f "$MODEL/config.json" ]; then
    $PY -m rackserve.cli model create --preset v4-flash --layers "${PD_LAYERS:-4}" \
        --experts "${PD_EXPERTS:-16}" --dtype bfloat16 --out "$MODEL"
fi
$PY benchmarks/pd_serving_bench.py --model "$MODEL" --gpus "$GPUS" --transport "$TRANSPORT" \
    --logs "$OUT/logs" --out "$OUT/pd_serving.json"
echo "done: $OUT"
