#!/usr/bin/env bash
# Session 26, call 3 (~10 minutes; written in session 25): an A/B of the two switches
# gpu_s26a.sh favoured, then the bf16 accuracy gates of the whole model
# (teacher-forced against the bf16 reference), every gate of issues 13 and 14 in bench
# forward, the decode step against transformers on the same checkpoint, step minus forward
# at 256 requests (async); then, with what is left, bench decode sized by
# --gpu-memory-utilization (the KV budget's reserve logged next to the graphs' memory) and
# the chunking-invariance GPU test with the decode MoE's rounded h. The side-stream
# indexer's graph test (gpu_s26b.sh: it failed on parameters made under inference mode)
# runs after the transformers comparison.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s26c.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-585}
source "$(dirname "$0")/../device_env.sh"
start_call
# gpu_s26a.sh (H100, 05094b8): hc_post_pre's expand apart and the wgmma attention from 128
# tokens each had the lowest minimum at decode:256 and 128 in both passes (~1-2%); both at
# once against the defaults before they are adopted
forward_ab default 'pass' both128 'mhc.POST_APART_MIN_TOKENS = 128
import rackserve.ops as o; o.PREFILL_ATTENTION_MIN_TOKENS = 128' --batch decode:256@4096 \
  --batch decode:128@4096 --iters 20 --warmup 3
gates
decode_vs_transformers
t=$(cap 60); echo "== indexer beside q: graph replay against eager, after the fusion fix (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/model/test_gpu_fastpath.py::test_graph_replay_is_bit_identical_to_eager \
  -k True > "$R/pytest_beside.log" 2>&1
grep -E "^E  |passed|failed" "$R/pytest_beside.log" | head -4
t=$(cap 45); echo "== bench decode, 256 requests, async: step minus forward (${t}s)"
((t)) && [[ -d /tmp/flash4 ]] && timeout "$t" "${rs[@]}" bench decode --model /tmp/flash4 \
  --concurrency 256 --context 512 --steps 30 --warmup 5 --kv-cache-memory 8000000000 \
  --async-scheduling --output "$R/decode_256_async.json" 2>&1 | tail -1
decode_sized_by_utilization 60
t=$(cap 110); echo "== chunking invariance, fused MoE V4-Flash tests (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/ops/test_fused_moe.py::test_v4_flash_sizes_on_gpu \
  tests/model/test_chunking_gpu.py > "$R/pytest_chunking.log" 2>&1
grep -E "^E  |passed|failed" "$R/pytest_chunking.log" | head -6
ls "$R"; (cd "$OUT" && tar czf s26c.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
