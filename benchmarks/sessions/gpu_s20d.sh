#!/usr/bin/env bash
# Session 20, call 4 (~9 minutes): the mHC defaults after call 3 (the flat K1 with bf16x3
# dots where K1 does not expand, fn's pieces cached; tf32x3 where it expands; a fused MoE's
# slots expanded apart from 128 tokens) against session 19's (3D K1 tiles, tf32x3, the
# expand fused below 1024 tokens): mHC and fast-path GPU tests, bench forward A/B at every
# gate, bench decode vs transformers, the decode:256 timeline.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s20d.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 120); echo "== GPU tests: mHC, graph replay, fp32 fast path (${t}s)"
((t)) && timeout "$t" python3 -m pytest -q -m gpu tests/ops/test_mhc.py \
  tests/model/test_gpu_fastpath.py -k "not teacher_forced and not no_less_accurate" \
  -p no:cacheprovider -rf > "$R/pytest.log" 2>&1
tail -3 "$R/pytest.log"
GATES=(--iters 20 --warmup 3 --batch decode:1@4096 --batch decode:64@4096
  --batch decode:256@4096 --batch decode:64@65536 --batch prefill:2048 --batch prefill:8192)
OLD='override(mhc, "default_tiling", gemm_flat=False); mhc.BF16_DOT_PRECISION = "tf32x3"; mhc.SLOTS_APART_MIN_TOKENS = None'
forward_ab new "pass" s19 "$OLD" "${GATES[@]}"
decode_vs_transformers
t=$(cap 40); echo "== replay timeline, decode:256 (${t}s)"
((t)) && timeout "$t" python3 benchmarks/graph_gap.py --batch decode:256@4096 \
  --output "$R/graph_gap_256.json" > /dev/null 2>&1
ls "$R"; (cd "$OUT" && tar czf s20d.tgz r && rm -rf r)  # at most 8 files come back
echo "== done in ${SECONDS}s"
