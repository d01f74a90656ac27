#!/usr/bin/env bash
# Speculative decoding on one GPU, one device call: `bench decode` on the v4-flash preset
# (4 layers, 64 experts, bf16, with its MTP layer) without speculation, with MTP K = 1..3,
# and with a draft identical to the target (K = 3: acceptance 1, the mechanics' ceiling),
# at batch 1 and 32. Random weights: acceptance rates of MTP mean nothing; compare tokens
# per step and the cost per verified token. Results: one JSON per run under $OUT.
# Uniform verify steps and the draft model's chained steps replay CUDA graphs
# (spec_decode/graphs.py), as the baseline replays its decode graphs; first, a check that
# those graphs give the eager engine's tokens (MTP and draft model, greedy and seeded).
set -uo pipefail
OUT=${OUT:-out/gpu_spec}
mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
RS=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
timeout 300 python3 -m pytest -q -m gpu tests/spec_decode/test_spec_graphs_gpu.py 2>&1 \
  | tail -3 | tee "$OUT/graphs_vs_eager.txt"
MODEL=/tmp/flash4mtp
CONTEXT=${CONTEXT:-1024}
PRESET=${PRESET:-v4-flash}  # PRESET=tiny DTYPE=float32: a CPU smoke run of this script
DTYPE=${DTYPE:-bfloat16}
timeout 120 "${RS[@]}" model create --preset "$PRESET" --layers 4 --experts 64 --dtype "$DTYPE" \
  --out "$MODEL" 2>&1 | tail -1
run() {  # name concurrency [spec json]
  local name=$1 conc=$2 spec=${3:-}
  echo "== $name x$conc"
  timeout 120 "${RS[@]}" bench decode --model "$MODEL" --concurrency "$conc" --context "$CONTEXT" \
    --steps 20 --warmup 3 --kv-cache-memory 8000000000 ${spec:+--speculative-config "$spec"} \
    --output "$OUT/decode_${name}_x${conc}.json" 2>&1 | tail -1
}
for conc in 1 32; do
  run plain "$conc"
  for k in 1 2 3; do
    run "mtp_k$k" "$conc" "{\"method\": \"mtp\", \"num_speculative_tokens\": $k}"
  done
  run self_draft_k3 "$conc" \
    "{\"method\": \"draft_model\", \"num_speculative_tokens\": 3, \"model\": \"$MODEL\"}"
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
rows = []
for f in sorted(pathlib.Path(sys.argv[1]).glob("decode_*.json")):
    r = json.loads(f.read_text())
    rows.append((f.stem, r["median_step_ms"], r.get("output_tokens_per_step", 1.0),
                 r["output_tokens_per_s"], r.get("spec_decode_acceptance_length", 1.0)))
print(f"{'run':28s} {'step ms':>8s} {'tok/step':>8s} {'tok/s':>9s} {'accept len':>10s}")
for name, ms, per_step, tps, length in rows:
    print(f"{name:28s} {ms:8.2f} {per_step:8.2f} {tps:9.0f} {length:10.2f}")
PY
