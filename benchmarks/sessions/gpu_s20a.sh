#!/usr/bin/env bash
# Session 20, call 1 (~9 minutes): the flat mHC K1 (streams read as [T, N*D] rows in 2D
# tiles; ``mhc.Tiling.gemm_flat``) against the [T, N, D] tiles: its GPU tests, mhc_bench at
# 64 / 256 / 2048 / 8192 tokens with variants around it (and the expand apart at decode
# sizes), the host's time per op of an eager prefill:2048 forward (and behind a GPU sleep:
# does any call wait on the GPU?), bench forward A/B flat vs 3D at the prefill gates and
# decode:64 / 256.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s20a.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-540}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 100); echo "== GPU tests: mHC (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m gpu tests/ops/test_mhc.py -p no:cacheprovider \
  -rf > "$R/pytest_mhc.log" 2>&1
tail -3 "$R/pytest_mhc.log"
t=$(cap 80); echo "== host per op, prefill:2048 (${t}s)"
((t)) && timeout "$t" python3 benchmarks/host_probe.py --prefill prefill:2048 --top 25 \
  --output "$R/host_ops.json" 2>&1 | grep -E "^prefill" | cut -c1-1500
t=$(cap 170); echo "== mhc_bench (${t}s)"
((t)) && timeout "$t" python3 benchmarks/mhc_bench.py --tokens 64 256 2048 8192 \
  --ops hc_pre hc_post_pre --variants k1_3d "k1_d*4" k1_w8 apart_expand "gemm_d*2" \
  "programs*2" bf16x3 gemm_t32 --output "$R/mhc_bench.json" 2>&1 | tail -3
python3 - "$R/mhc_bench.json" <<'PY' 2>/dev/null
import json, sys
for r in json.load(open(sys.argv[1])):
    if r.get("kind") == "mhc_bench" and r["impl"] != "reference":
        print(f"{r['op']:12s} T={r['tokens']:5d} {r['impl']:22s} graph {r['graph_time_us']:8.1f} us"
              f"  err {r.get('max_abs_err', 0):.2e}")
PY
GATES=(--iters 20 --warmup 3 --batch decode:64@4096 --batch decode:256@4096
  --batch prefill:2048 --batch prefill:8192)
forward_ab flat "pass" k1_3d 'override(mhc, "default_tiling", gemm_flat=False)' "${GATES[@]}"
ls "$R"; (cd "$OUT" && tar czf s20a.tgz r && rm -rf r)  # at most 8 files come back
echo "== done in ${SECONDS}s"
