#!/usr/bin/env bash
# The decode gates in one device call (GPU fast path M2/M4): bench forward with CUDA graphs,
# launches per layer, the graph step's gap, bench decode at 1 and 64 requests next to
# transformers on the same checkpoint (and at 256, with and without --async-scheduling), then the GPU-marked kernel tests (as time allows).
# Results in $OUT. Usage: bash benchmarks/gpu_gates.sh
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"
# an array, not a function: `timeout` runs commands only
rs=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)' | tee "$OUT/env.txt"
FLASH=(--preset v4-flash --layers 4 --experts 64)
PARTS=" ${PARTS:-forward mhc profile gap decode tests} "  # which sections run
on() { [[ "$PARTS" == *" $1 "* ]]; }
on forward && {
echo "== bench forward"
timeout 100 "${rs[@]}" bench forward "${FLASH[@]}" --iters 20 --warmup 3 --batch decode:1@4096 \
  --batch decode:64@4096 --batch decode:256@4096 --batch decode:64@512 \
  --output "$OUT/forward.json" 2>&1 | grep -E "^decode|Error"
}
on mhc && {
echo "== bench forward decode:1 with the one-launch mHC (RACKSERVE_MHC_FUSED=1)"
RACKSERVE_MHC_FUSED=1 timeout 60 "${rs[@]}" bench forward "${FLASH[@]}" --iters 20 --warmup 3 \
  --batch decode:1@4096 --output "$OUT/forward_mhc_fused.json" 2>&1 | grep -E "^decode|Error"
}
on profile && {
echo "== launches per layer"
timeout 60 python3 benchmarks/profile_forward.py --batch decode:1@4096 --batch decode:64@4096 \
  --batch decode:256@4096 --top 20 --output "$OUT/profile.json" 2>&1 | grep -E "^==|Error"
}
on gap && {
echo "== graph gap"
timeout 40 python3 benchmarks/graph_gap.py --batch decode:1@4096 --output "$OUT/graph_gap.json" \
  2>&1 | grep -E "^\{|Error"
}
on decode && {
echo "== bench decode vs transformers (same checkpoint)"
timeout 60 "${rs[@]}" model create "${FLASH[@]}" --dtype bfloat16 --no-mtp --out /tmp/flash4 2>&1 | tail -1
for c in 1 64; do
  timeout 60 "${rs[@]}" bench decode --model /tmp/flash4 --concurrency $c --context 512 --steps 30 \
    --warmup 5 --kv-cache-memory 8000000000 --output "$OUT/decode_$c.json" 2>&1 | tail -1
done
# issue 14's CPU-side gate: step minus forward <= 0.3 ms at 256 requests, with and
# without --async-scheduling (the step of N+1 prepared while N runs)
for a in --no-async-scheduling --async-scheduling; do
  name=decode_256; [[ $a == --async-scheduling ]] && name=decode_256_async
  timeout 120 "${rs[@]}" bench decode --model /tmp/flash4 --concurrency 256 --context 512 --steps 30 \
    --warmup 5 --kv-cache-memory 8000000000 $a --output "$OUT/$name.json" 2>&1 | tail -1
done
timeout 150 python3 benchmarks/hf_decode.py --model /tmp/flash4 --batch 1,64 --context 512 \
  --output "$OUT/hf_decode.json" 2>&1 | tail -2
python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
hf = {r["batch"]: r["step_ms"] for r in json.loads((out / "hf_decode.json").read_text())}
for c in (1, 64):
    d = json.loads((out / f"decode_{c}.json").read_text())
    print(f"decode x{c} @512: engine step {d['median_step_ms']:.2f} ms, transformers "
          f"{hf[c]:.2f} ms -> {hf[c] / d['median_step_ms']:.1f}x")
PY
}
on tests && {
echo "== GPU kernel tests"
timeout "${TEST_S:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/ops \
  tests/model/test_gpu_fastpath.py -k "not teacher_forced and not no_less_accurate" 2>&1 \
  | tee "$OUT/pytest.log" | grep -E "passed|failed|FAILED" | tail -12
}
