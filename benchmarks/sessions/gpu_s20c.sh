#!/usr/bin/env bash
# Session 20, call 3 (~9 minutes): the mHC K1 defaults of b195d03 / this commit (flat K1
# for calls without the expand, bf16x3 dots with fn's pieces cached, the expand apart for a
# fused MoE's slots from 128 tokens) against session 19's (3D K1 tiles, tf32x3, the expand
# fused below 1024 tokens): mHC and fast-path GPU tests, mhc_bench at 64 / 256 / 2048 /
# 8192, bench forward A/B at every gate, launches per layer, the decode:256 timeline.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s20c.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 120); echo "== GPU tests: mHC, graph replay, fp32 fast path (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m gpu tests/ops/test_mhc.py \
  tests/model/test_gpu_fastpath.py -k "not teacher_forced and not no_less_accurate" \
  -p no:cacheprovider -rf > "$R/pytest.log" 2>&1
tail -3 "$R/pytest.log"
t=$(cap 90); echo "== mhc_bench defaults (${t}s)"
((t)) && timeout "$t" python3 benchmarks/mhc_bench.py --tokens 64 256 2048 8192 \
  --ops hc_pre hc_post_pre --variants k1_3d --output "$R/mhc_bench.json" > /dev/null 2>&1
python3 - "$R/mhc_bench.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    if r.get("kind") == "mhc_bench" and r["impl"] != "reference":
        print(f"{r['op']:12s} T={r['tokens']:5d} {r['impl']:16s} graph {r['graph_time_us']:8.1f} us")
PY
GATES=(--iters 20 --warmup 3 --batch decode:1@4096 --batch decode:64@4096
  --batch decode:256@4096 --batch decode:64@65536 --batch prefill:2048 --batch prefill:8192)
OLD='override(mhc, "default_tiling", gemm_flat=False); mhc.BF16_DOT_PRECISION = "tf32x3"; mhc.SLOTS_APART_MIN_TOKENS = None'
forward_ab new "pass" s19 "$OLD" "${GATES[@]}"
t=$(cap 70); echo "== launches per layer (${t}s)"
((t)) && timeout "$t" python3 benchmarks/profile_forward.py --batch decode:1@4096 \
  --batch decode:64@4096 --batch decode:256@4096 --output "$R/launches.json" 2>&1 \
  | grep "^==" | cut -c1-300
t=$(cap 40); echo "== replay timeline, decode:256 (${t}s)"
((t)) && timeout "$t" python3 benchmarks/graph_gap.py --batch decode:256@4096 \
  --output "$R/graph_gap_256.json" > /dev/null 2>&1
ls "$R"; (cd "$OUT" && tar czf s20c.tgz r && rm -rf r)  # at most 8 files come back
echo "== done in ${SECONDS}s"
