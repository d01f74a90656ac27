#!/usr/bin/env bash
# A short speculative-decoding call (~4 minutes; gpu_spec.sh is the full one): bench decode
# on the v4-flash preset (4 layers, 64 experts, bf16, MTP layer) without speculation and with
# a draft identical to the target (K = 3: acceptance 1) at batch 1 and 32, plus MTP K = 3 at
# 32. Results: one JSON per run in $OUT/spec.tgz and the summary table.
set -uo pipefail
OUT=${OUT:-out/gpu_spec}
R="$OUT/r"
mkdir -p "$R"
source "$(dirname "$0")/device_env.sh"
RS=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
MODEL=/tmp/flash4mtp
BUDGET_S=${BUDGET_S:-220}
timeout 110 "${RS[@]}" model create --preset v4-flash --layers 4 --experts 64 --dtype bfloat16 \
  --out "$MODEL" 2>&1 | tail -1
run() {  # name concurrency [spec json]
  local name=$1 conc=$2 spec=${3:-} t
  t=$(cap 60)
  ((t)) || return
  echo "== $name x$conc"
  timeout "$t" "${RS[@]}" bench decode --model "$MODEL" --concurrency "$conc" \
    --context 1024 --steps 20 --warmup 3 --kv-cache-memory 8000000000 \
    ${spec:+--speculative-config "$spec"} --output "$R/decode_${name}_x${conc}.json" 2>&1 | tail -2
  tar czf "$OUT/spec.tgz" -C "$OUT" r
}
self="{\"method\": \"draft_model\", \"num_speculative_tokens\": 3, \"model\": \"$MODEL\"}"
run plain 1
run self_draft_k3 1 "$self"
run plain 32
run self_draft_k3 32 "$self"
run mtp_k3 32 '{"method": "mtp", "num_speculative_tokens": 3}'
echo "== done in ${SECONDS}s"
