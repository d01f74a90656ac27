#!/usr/bin/env bash
# Session 5's one device call (~8 minutes), most valuable first: the graph gap with the
# kernel-name diff (eager forward vs captured region vs replay, with and without the step
# metadata kernels), the forward gates (gpu_gates.sh forward), the split-K GEMV against
# cuBLAS and bench forward with it on, the GPU kernel tests, the fp32 fast-path test that
# failed on the GPU in session 3 (-x -vv -s), then bench decode at 1 and 64 requests next to
# transformers on the same checkpoint (as long as time is left). Results in $OUT.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s5.sh      (BUDGET_S: total seconds)
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-540}
source "$(dirname "$0")/../device_env.sh"
# arrays, not functions: `timeout` runs commands only
rs=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
FLASH=(--preset v4-flash --layers 4 --experts 64)
echo "commit ${RACKSERVE_COMMIT:-unknown}" | tee "$OUT/commit.txt"

t=$(cap 120); echo "== graph gap (${t}s)"
((t)) && timeout "$t" python3 benchmarks/graph_gap.py --batch decode:1@4096 \
  --output "$OUT/graph_gap.json" 2>&1 | tee "$OUT/graph_gap.log" | grep -vE "^\s*$"

t=$(cap 110); echo "== forward gates (${t}s)"
((t)) && PARTS="forward" OUT="$OUT" timeout "$t" bash benchmarks/gpu_gates.sh 2>&1 | tail -6

t=$(cap 100); echo "== GEMV vs cuBLAS (${t}s)"
((t)) && timeout "$t" python3 benchmarks/gemv_bench.py --output "$OUT/gemv_bench.json" 2>&1 \
  | tee "$OUT/gemv_bench.log" | grep -E "T=  1 |T=  8 |Error" | grep -vE "triton:"

t=$(cap 60); echo "== bench forward with the GEMV (RACKSERVE_GEMV=1) (${t}s)"
((t)) && RACKSERVE_GEMV=1 timeout "$t" "${rs[@]}" bench forward "${FLASH[@]}" --iters 20 \
  --warmup 3 --batch decode:1@4096 --batch decode:8@4096 --output "$OUT/forward_gemv.json" 2>&1 \
  | grep -E "^decode|Error"
t=$(cap 40)
((t)) && timeout "$t" "${rs[@]}" bench forward "${FLASH[@]}" --iters 20 --warmup 3 \
  --batch decode:8@4096 --output "$OUT/forward_b8.json" 2>&1 | grep -E "^decode|Error"

t=$(cap 150); echo "== GPU kernel tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -p no:cacheprovider -m gpu -rf tests/ops \
  tests/model/test_gpu_fastpath.py -k "not teacher_forced and not no_less_accurate" 2>&1 \
  | tee "$OUT/pytest_gpu.log" | grep -E "passed|failed|FAILED|Error" | tail -15

t=$(cap 60); echo "== the fp32 fast-path test that failed on the GPU (${t}s)"
((t)) && timeout "$t" python3 -m pytest -x -vv -s -p no:cacheprovider \
  tests/model/test_fast_path_cpu.py::test_fp32_fast_path_matches_reference 2>&1 \
  | tee "$OUT/pytest_fp32.log" | grep -E "scale|passed|failed|Error|assert" | tail -25

t=$(cap 150); echo "== bench decode vs transformers (${t}s)"
((t)) && timeout "$t" "${rs[@]}" model create "${FLASH[@]}" --dtype bfloat16 --no-mtp \
  --out /tmp/flash4 2>&1 | tail -1
for c in 1 64; do
  t=$(cap 60)
  ((t)) && [[ -d /tmp/flash4 ]] && timeout "$t" "${rs[@]}" bench decode --model /tmp/flash4 \
    --concurrency $c --context 512 --steps 30 --warmup 5 --kv-cache-memory 8000000000 \
    --output "$OUT/decode_$c.json" 2>&1 | tail -1
done
t=$(cap 150)
((t)) && [[ -d /tmp/flash4 ]] && timeout "$t" python3 benchmarks/hf_decode.py \
  --model /tmp/flash4 --batch 1,64 --context 512 --output "$OUT/hf_decode.json" 2>&1 | tail -2
python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
try:
    hf = {r["batch"]: r["step_ms"] for r in json.loads((out / "hf_decode.json").read_text())}
except (OSError, ValueError, KeyError) as e:
    sys.exit(f"no transformers comparison: {e}")
for c in (1, 64):
    try:
        d = json.loads((out / f"decode_{c}.json").read_text())
    except (OSError, ValueError) as e:
        print(f"decode x{c}: no engine record ({e})")
        continue
    print(f"decode x{c} @512: engine step {d['median_step_ms']:.2f} ms, transformers "
          f"{hf[c]:.2f} ms -> {hf[c] / d['median_step_ms']:.1f}x")
PY
echo "== done in ${SECONDS}s"
