#!/usr/bin/env bash
# Session 8's fourth device call (~9 minutes): bench decode at 1 and 64 requests (64 also
# with --async-scheduling) next to transformers on the same bf16 checkpoint (call 3's
# model create ran out of its 60 s), then the FP4 MoE with its new middle tiling (64-wide
# gate-up tiles through tl.dot_scaled): its GPU tests, the sweep at 256 tokens and bench
# forward decode with FP8 linears and FP4 experts.
# Every file goes into $OUT/s8d.tgz, refreshed after each section.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s8d.sh      (BUDGET_S: total seconds)
set -uo pipefail
OUT=${OUT:-out/gpu}
R="$OUT/r"
mkdir -p "$R"
BUDGET_S=${BUDGET_S:-570}
source "$(dirname "$0")/../device_env.sh"
rs=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
FLASH=(--preset v4-flash --layers 4 --experts 64)
pack() { tar czf "$OUT/s8d.tgz" -C "$OUT" r; }
echo "commit ${RACKSERVE_COMMIT:-unknown}" | tee "$R/commit.txt"
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)' | tee "$R/env.txt"

t=$(cap 170); echo "== bench decode vs transformers (${t}s)"
((t)) && timeout "$t" "${rs[@]}" model create "${FLASH[@]}" --dtype bfloat16 --no-mtp \
  --out /tmp/flash4 2>&1 | tail -1
for run in "1:" "64:" "64:--async-scheduling"; do
  c=${run%%:*} a=${run#*:}
  t=$(cap 45)
  ((t)) && [[ -d /tmp/flash4 ]] && timeout "$t" "${rs[@]}" bench decode --model /tmp/flash4 \
    --concurrency $c --context 512 --steps 30 --warmup 5 --kv-cache-memory 8000000000 $a \
    --output "$R/decode_$c${a:+_async}.json" 2>&1 | tail -1
done
t=$(cap 120)
((t)) && [[ -d /tmp/flash4 ]] && timeout "$t" python3 benchmarks/hf_decode.py \
  --model /tmp/flash4 --batch 1,64 --context 512 --output "$R/hf_decode.json" 2>&1 | tail -2
python3 - "$R" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
try:
    hf = {r["batch"]: r["step_ms"] for r in json.loads((out / "hf_decode.json").read_text())}
except (OSError, ValueError, KeyError) as e:
    sys.exit(f"no transformers comparison: {e}")
for name in ("decode_1", "decode_64", "decode_64_async"):
    try:
        d = json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError) as e:
        print(f"{name}: no engine record ({e})")
        continue
    c = d["concurrency"]
    print(f"{name} @512: engine step {d['median_step_ms']:.2f} ms, transformers "
          f"{hf[c]:.2f} ms -> {hf[c] / d['median_step_ms']:.1f}x")
PY
pack
t=$(cap 70); echo "== FP4 MoE GPU tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/ops/test_fp4_moe.py \
  "tests/model/test_quant_gpu.py::test_kernels_at_v4_flash_sizes" 2>&1 \
  | tee "$R/pytest_fp4.log" | tail -4
pack

t=$(cap 60); echo "== FP4 MoE sweep (${t}s)"
((t)) && timeout "$t" python3 benchmarks/fp4_moe_sweep.py --tokens 256 --output "$R/fp4_sweep.json" 2>&1 \
  | grep -E "^T=|Error" | tail -40
pack

t=$(cap 90); echo "== bench forward, FP8 linears + FP4 experts (${t}s)"
((t)) && timeout "$t" "${rs[@]}" bench forward "${FLASH[@]}" --iters 20 --warmup 3 \
  --quantization fp8 --expert-dtype fp4 --batch decode:1@4096 --batch decode:8@4096 \
  --batch decode:64@4096 --batch decode:256@4096 --output "$R/forward_fp8_fp4.json" 2>&1 \
  | grep -E "^decode|Error"
pack

echo "== done in ${SECONDS}s"
