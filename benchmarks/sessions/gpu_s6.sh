#!/usr/bin/env bash
# Session 6's main device call (~9 minutes), most valuable first: the forward gates after
# the compress early exit (decode 1/8/64/256 at 4096, 64 at 512; decode:1 also with the
# Triton GEMV), launches per layer (profiler, with and without the GEMV), the graph gap at
# batch 1 and 256, the fused-MoE tiling sweep at 1 and 8 tokens, bench decode at 1/64/256
# requests (256 also with --async-scheduling) next to transformers on the same checkpoint,
# then the GPU-marked tests (8 workers). Every file goes into one archive, $OUT/s6.tgz
# (the device returns at most 8 files), refreshed after each section.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s6.sh      (BUDGET_S: total seconds)
set -uo pipefail
OUT=${OUT:-out/gpu}
R="$OUT/r"
mkdir -p "$R"
BUDGET_S=${BUDGET_S:-540}
source "$(dirname "$0")/../device_env.sh"
rs=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
FLASH=(--preset v4-flash --layers 4 --experts 64)
pack() { tar czf "$OUT/s6.tgz" -C "$OUT" r; }
echo "commit ${RACKSERVE_COMMIT:-unknown}" | tee "$R/commit.txt"
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)' | tee "$R/env.txt"

t=$(cap 90); echo "== bench forward (${t}s)"
((t)) && timeout "$t" "${rs[@]}" bench forward "${FLASH[@]}" --iters 20 --warmup 3 \
  --batch decode:1@4096 --batch decode:8@4096 --batch decode:64@4096 --batch decode:256@4096 \
  --batch decode:64@512 --output "$R/forward.json" 2>&1 | grep -E "^decode|Error"
t=$(cap 40)
((t)) && RACKSERVE_GEMV=1 timeout "$t" "${rs[@]}" bench forward "${FLASH[@]}" --iters 20 \
  --warmup 3 --batch decode:1@4096 --output "$R/forward_gemv.json" 2>&1 | grep -E "^decode|Error"
pack

t=$(cap 70); echo "== launches per layer (${t}s)"
((t)) && timeout "$t" python3 benchmarks/profile_forward.py --batch decode:1@4096 \
  --batch decode:64@4096 --batch decode:256@4096 --top 25 --output "$R/profile.json" 2>&1 \
  | grep -E "^==|launch|Error"
t=$(cap 40)
((t)) && RACKSERVE_GEMV=1 timeout "$t" python3 benchmarks/profile_forward.py \
  --batch decode:1@4096 --top 25 --output "$R/profile_gemv.json" 2>&1 | grep -E "^==|launch|Error"
pack

t=$(cap 100); echo "== graph gap (${t}s)"
((t)) && timeout "$t" python3 benchmarks/graph_gap.py --batch decode:1@4096 \
  --batch decode:256@4096 --output "$R/graph_gap.json" 2>&1 | tee "$R/graph_gap.log" \
  | grep -E "^==|^  \[|^\{" | head -40
pack

t=$(cap 80); echo "== fused MoE sweep at 1 and 8 tokens (${t}s)"
((t)) && timeout "$t" python3 benchmarks/fused_moe_bench.py --tokens 1 8 --no-reference \
  --output "$R/moe_sweep.json" 2>&1 | tail -3
python3 - "$R/moe_sweep.json" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"no sweep: {e}")
for r in sorted((r for r in rows if "graph_time_us" in r), key=lambda r: (r["tokens"], r["graph_time_us"]))[:40]:
    print(f"T={r['tokens']:3d} {r['impl']:28s} {r['graph_time_us']:7.1f} us {r['roofline_fraction']:.3f}")
PY
pack

t=$(cap 60); echo "== bench decode vs transformers (${t}s)"
((t)) && timeout "$t" "${rs[@]}" model create "${FLASH[@]}" --dtype bfloat16 --no-mtp \
  --out /tmp/flash4 2>&1 | tail -1
for c in 1 64 256; do
  for a in "" --async-scheduling; do
    [[ $c == 1 && -n $a ]] && continue
    t=$(cap 60)
    ((t)) && [[ -d /tmp/flash4 ]] && timeout "$t" "${rs[@]}" bench decode --model /tmp/flash4 \
      --concurrency $c --context 512 --steps 30 --warmup 5 --kv-cache-memory 8000000000 $a \
      --output "$R/decode_$c${a:+_async}.json" 2>&1 | tail -1
  done
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

t=$(cap 200); echo "== GPU-marked tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu -rf tests/ops \
  tests/model/test_gpu_fastpath.py 2>&1 | tee "$R/pytest_gpu.log" \
  | grep -E "passed|failed|FAILED|Error" | tail -15
pack
echo "== done in ${SECONDS}s"
