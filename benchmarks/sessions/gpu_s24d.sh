#!/usr/bin/env bash
# Session 24, call 5 (~3.5 minutes): the fused MoE's V4-Flash GPU tests with round_h's
# tolerance (one bf16 spacing more: the reference rounds h as the kernel does), and the decode
# graphs writing every size's logits into one buffer (torch.mm out_dtype + out in a capture):
# replay bitwise against eager, the sampler graphs and the async feed on them.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s24d.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-230}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 50); echo "== fused MoE GPU tests (${t}s)"
f=tests/ops/test_fused_moe.py
((t)) && timeout "$t" "${pt[@]}" $f::test_v4_flash_sizes_on_gpu > "$R/pytest_moe.log" 2>&1
grep -E "^E  |passed|failed" "$R/pytest_moe.log" | head -8
t=$(cap 170); echo "== decode graphs on one logits buffer (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/model/test_gpu_fastpath.py::test_graph_replay_is_bit_identical_to_eager \
  tests/runner/test_graph_sampling.py -k "bit_identical or captured" > "$R/pytest_graphs.log" 2>&1
grep -E "^E  |passed|failed" "$R/pytest_graphs.log" | head -8
ls "$R"; (cd "$OUT" && tar czf s24d.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
