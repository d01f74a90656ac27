#!/usr/bin/env bash
# Session 7's first device call (~7 minutes): launches per decoder layer from the profiler
# (kernels attributed to each layer's record_function range: decode 1, 64 and 256 at 4096),
# then the short speculative-decoding call after the selection kernel's runtime K
# (gpu_spec_short.sh: no speculation vs draft = target copy at batch 1 and 32, MTP at 32).
# Every file goes into $OUT/s7.tgz, refreshed after each section.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s7.sh      (BUDGET_S: total seconds)
set -uo pipefail
OUT=${OUT:-out/gpu}
R="$OUT/r"
mkdir -p "$R"
BUDGET_S=${BUDGET_S:-520}
source "$(dirname "$0")/../device_env.sh"
pack() { tar czf "$OUT/s7.tgz" -C "$OUT" r; }
echo "commit ${RACKSERVE_COMMIT:-unknown}" | tee "$R/commit.txt"

t=$(cap 80); echo "== launches per layer (${t}s)"
((t)) && timeout "$t" python3 benchmarks/profile_forward.py --batch decode:1@4096 \
  --batch decode:64@4096 --batch decode:256@4096 --top 40 --output "$R/profile.json" 2>&1 \
  | grep -E "^==|Error"
pack

left=$((BUDGET_S - SECONDS - 10))
echo "== speculative decoding (${left}s)"
OUT="$R" BUDGET_S=$left bash "$(dirname "$0")/../gpu_spec_short.sh" 2>&1 | tail -30
pack
echo "== done in ${SECONDS}s"
