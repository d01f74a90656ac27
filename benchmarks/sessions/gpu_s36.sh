#!/usr/bin/env bash
# Prepared in session 36 (its second call never ran): on an H200 with 450 s of budget, every
# gate (gpu_gates.sh: the gates are set on that card). Elsewhere: the router's logits in
# their own launch (the default since session 36's call 1) against the route + align launch
# computing them (ROUTER_IN_ALIGN_MAX_TOKENS = 15) in 8 slices (inalign, session 33's form)
# and in 32 (inalign32), bench forward at decode:1, alternating, two passes; the GPU tests of
# the router and the embedding; the gate cases of bench forward (when 150 s are left); then
# where a speculative step's time goes (bench decode --profile, MTP K = 3 at 32 requests
# against no speculation, v4-flash 4 layers 64 experts with its MTP layer).
# Usage: RACKSERVE_COMMIT=<sha> BUDGET_S=<seconds> bash benchmarks/sessions/gpu_s36.sh
set -uo pipefail
BUDGET_S=${BUDGET_S:-540}
if ((BUDGET_S >= 450)) && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  exec bash "$(dirname "$0")/../gpu_gates.sh"
fi
source "$(dirname "$0")/../device_env.sh"
start_call
inalign='import rackserve.ops.triton.moe_routed as m; m.ROUTER_IN_ALIGN_MAX_TOKENS = 15'
inalign32=$inalign'
splits = m._router_splits
m._router_splits = lambda x, w: (lambda s: s and (32, s[1]))(splits(x, w))'
for pass in 1 2; do
  for arm in apart inalign inalign32; do
    case $arm in apart) code='pass' ;; inalign) code=$inalign ;; inalign32) code=$inalign32 ;; esac
    t=$(cap 30); echo "== bench forward, $arm, pass $pass (${t}s)"
    ((t)) && forward_with "$code" "$R/forward_${arm}_$pass.json" --batch decode:1@4096 \
      --iters 30 --warmup 5
  done
done
t=$(cap 60); echo "== pytest: router, embedding (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/ops/test_moe_routed.py tests/ops/test_embed.py \
  > "$R/pytest.log" 2>&1; tail -2 "$R/pytest.log"
(( BUDGET_S - SECONDS > 150 )) && forward_gates
MODEL=/tmp/flash4mtp
t=$(cap 90); echo "== model create, MTP layer (${t}s)"
((t)) && timeout "$t" "${rs[@]}" model create --preset v4-flash --layers 4 --experts 64 \
  --dtype bfloat16 --out "$MODEL" 2>&1 | tail -1
prof() {  # name [spec json]
  local name=$1 spec=${2:-} t
  t=$(cap 70); echo "== bench decode --profile, $name x32 (${t}s)"
  ((t)) && [[ -d $MODEL ]] && timeout "$t" "${rs[@]}" bench decode --model "$MODEL" \
    --concurrency 32 --context 1024 --steps 12 --warmup 3 --kv-cache-memory 8000000000 \
    ${spec:+--speculative-config "$spec"} --profile "$R/profile_${name}_x32.txt" \
    --output "$R/decode_${name}_x32.json" 2>&1 | grep -E "^decode|Error"
}
prof mtp_k3 '{"method": "mtp", "num_speculative_tokens": 3}'
prof plain
ls "$R"; (cd "$OUT" && tar czf s36.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
