#!/usr/bin/env bash
# Session 7's second device call (~9 minutes): where a speculative step's time goes
# (bench decode --profile: cProfile + torch.profiler, v4-flash preset at 2 layers and 16
# experts with its MTP layer: draft = target copy at batch 1, MTP at 32, no speculation at
# 32), then the first half of gpu_quant.sh (quantized kernel tests, bench forward bf16 and
# FP8 + FP4 experts). Every file goes into $OUT/s7b.tgz, refreshed after each section.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s7b.sh      (BUDGET_S: total seconds)
set -uo pipefail
OUT=${OUT:-out/gpu}
R="$OUT/r"
mkdir -p "$R"
BUDGET_S=${BUDGET_S:-570}
source "$(dirname "$0")/../device_env.sh"
rs=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
pack() { tar czf "$OUT/s7b.tgz" -C "$OUT" r; }
echo "commit ${RACKSERVE_COMMIT:-unknown}" | tee "$R/commit.txt"
MODEL=/tmp/flash2mtp
timeout 60 "${rs[@]}" model create --preset v4-flash --layers 2 --experts 16 --dtype bfloat16 \
  --out "$MODEL" 2>&1 | tail -1
prof() {  # name concurrency [spec json]
  local name=$1 conc=$2 spec=${3:-} t
  t=$(cap 55)
  ((t)) || return
  echo "== profile $name x$conc"
  timeout "$t" "${rs[@]}" bench decode --model "$MODEL" --concurrency "$conc" --context 1024 \
    --steps 10 --warmup 3 --kv-cache-memory 4000000000 ${spec:+--speculative-config "$spec"} \
    --profile "$R/profile_${name}_x${conc}.txt" --output "$R/decode_${name}_x${conc}.json" \
    2>&1 | grep -E "^decode|Error"
  pack
}
prof self_draft_k3 1 "{\"method\": \"draft_model\", \"num_speculative_tokens\": 3, \"model\": \"$MODEL\"}"
prof mtp_k3 32 '{"method": "mtp", "num_speculative_tokens": 3}'
prof plain 32

left=$((BUDGET_S - SECONDS - 5))
echo "== quantized: tests, forward bf16, forward fp8 + fp4 (${left}s)"
OUT="$R/quant" SECTIONS="tests forward_bf16 forward_fp4" timeout "$left" \
  bash "$(dirname "$0")/../gpu_quant.sh" 2>&1 | tail -40
pack
echo "== done in ${SECONDS}s"
