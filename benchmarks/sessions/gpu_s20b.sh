#!/usr/bin/env bash
# Session 20, call 2 (~6 minutes): mHC K1 launch shapes after call 1's bench forward A/B
# (flat K1: prefill:8192 51.5 against 50.7 ms for the [T, N, D] tiles). hc_pre at 2048 and
# 8192 tokens (K1 without the expand: flat or 3D, tf32x3 / bf16x3 / ieee, token tiles,
# columns a step, warps, programs); hc_post_pre at 64 and 256 with the expand apart.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s20b.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-400}
source "$(dirname "$0")/../device_env.sh"
start_call
V=(k1_3d k1_3d_bf16x3 bf16x3 "gemm_d*2" "k1_d*4" k1_w8 "k1_t*2" "k1_t/2" k1_ieee
  "programs*2" "programs/2")
t=$(cap 200); echo "== mhc_bench hc_pre 2048 8192 (${t}s)"
((t)) && timeout "$t" python3 benchmarks/mhc_bench.py --tokens 2048 8192 --ops hc_pre \
  --variants "${V[@]}" --output "$R/mhc_pre.json" 2>&1 | tail -3
t=$(cap 150); echo "== mhc_bench hc_post_pre 64 256 (${t}s)"
((t)) && timeout "$t" python3 benchmarks/mhc_bench.py --tokens 64 256 --ops hc_post_pre \
  --variants apart_expand "gemm_d*2" k1_w8 bf16x3 --output "$R/mhc_post_pre.json" 2>&1 | tail -3
for f in "$R"/mhc_pre.json "$R"/mhc_post_pre.json; do
python3 - "$f" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    if "error" in r:
        print(f"{r['op']:12s} T={r['tokens']:5d} {r['impl']:22s} {r['error'][:60]}")
    elif r.get("kind") == "mhc_bench" and r["impl"] != "reference":
        print(f"{r['op']:12s} T={r['tokens']:5d} {r['impl']:22s} graph {r['graph_time_us']:8.1f} us"
              f"  plain {r['time_us']:8.1f}  err {r.get('max_abs_err', 0):.2e}")
PY
done
ls "$R"; (cd "$OUT" && tar czf s20b.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
