#!/usr/bin/env bash
# Session 27, call 5 (~4 minutes): call 3's GPU tests, which its 120 s cut (the memory
# profile's runner test failed there, its report cut off), without the sm_90 compile tests
# (CI compiles them on the CPU); then where prefill:8192's GPU time goes with this session's
# defaults (profile_forward.py: the next lever for issue 13's 50%).
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s27f.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-300}
source "$(dirname "$0")/../device_env.sh"
start_call
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$R/gpu.txt"
t=$(cap 150); echo "== GPU tests: the memory profile, the wgmma attention (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/runner/test_memory_profile.py \
  tests/ops/test_prefill_attn_wgmma.py -k "not compiles" > "$R/pytest.log" 2>&1
grep -E "^E  |^FAILED|passed|failed" "$R/pytest.log" | head -12
t=$(cap 90); echo "== profile_forward prefill:8192 (${t}s)"
((t)) && timeout "$t" python3 benchmarks/profile_forward.py --batch prefill:8192 --top 30 \
  --output "$R/profile_prefill.json" 2>&1 | tail -32 | cut -c1-150
ls "$R"; (cd "$OUT" && tar czf s27f.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
