#!/usr/bin/env bash
# Session 12's second device call (~9 minutes): 1. the GPU tests of what changed (pinned
# P/D staging, the wide kernel's fp16 PV from 64 queries, mHC's 128-token K1 tiles and split
# K2 from 4096 tokens); 2. mhc_bench at 2048 and 8192 tokens around the new defaults; 3.
# bench forward with the new defaults against session 11's (fp16 PV off, K2 in one launch,
# 64-token K1 tiles), two alternating passes; 4. the tcp KV pull with pinned staging (it
# ran at 0.35-0.45 GB/s into fresh pageable buffers); 5. P/D TTFT against aggregated with
# the overlapped router, five repeats a length, both engines on this GPU.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s12c.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-540}
source "$(dirname "$0")/../device_env.sh"
start_call
pack() { tar czf "$OUT/s12c.tgz" -C "$OUT" r; }

t=$(cap 70); echo "== GPU tests (${t}s)"
((t)) && timeout "$t" python3 -m pytest -v -p no:cacheprovider -m "gpu or not gpu" -rf \
  tests/disagg/test_streaming_wire.py tests/ops/test_sparse_attn.py tests/ops/test_mhc.py \
  -k "pinned or v4_flash or fp16 or mixes_apart or gpu" > "$R/pytest.log" 2>&1
grep -E "PASSED|FAILED|ERROR" "$R/pytest.log" | awk '{print $2}' | sort | uniq -c
grep -E "^E  " "$R/pytest.log" | head -6
pack
t=$(cap 60); echo "== mhc_bench 2048, 8192 (${t}s)"
((t)) && timeout "$t" python3 benchmarks/mhc_bench.py --tokens 2048 8192 --output \
  "$R/mhc_bench.json" --ops hc_pre hc_post_pre --variants s11 one_k2 k1_t64 mixes32 mixes64 \
  2>&1 | grep -E "hc_pre |hc_post_pre|Error"
pack
for pass in 1 2; do
  for v in "as_now|pass" \
           "s11|attn.PV_FP16_MIN_QUERIES = None; mhc.MIXES_APART_MIN_TOKENS = None; mhc.K1_WIDE_TILE_MIN_TOKENS = 10**9"; do
    name=${v%%|*}; code=${v#*|}
    limit=40; [[ $pass$name == 1as_now ]] && limit=60  # the first compiles the prefill kernels
    t=$(cap $limit); echo "== forward $name, pass $pass (${t}s)"
    ((t)) && timeout "$t" bash -c "$(declare -f forward_with); forward_with '$code' $R/${name}_$pass.json \
      --iters 10 --warmup 2 --batch prefill:2048 --batch prefill:8192 --batch decode:64@4096"
    pack
  done
done
t=$(cap 40); echo "== KV transfer, tcp streamed, pinned staging (${t}s)"
((t)) && timeout "$t" python3 benchmarks/pd_transfer_bench.py --transport tcp \
  --lengths 1024,16384,131072 --repeats 3 --out "$R/pd_transfer_streamed.json" 2>&1 | grep tokens
python3 -m rackserve.cli model create --preset v4-flash --layers 4 --experts 16 \
  --dtype bfloat16 --out /tmp/pd_model > "$R/model_create.log" 2>&1
t=$(cap 240); echo "== P/D TTFT over tcp (${t}s)"
((t)) && timeout "$t" python3 benchmarks/pd_serving_bench.py --model /tmp/pd_model \
  --gpus 1 --transport tcp --lengths 1024,4096,16384 --repeats 5 --ttft-only \
  --logs "$R/pd_logs" --out "$R/pd_serving.json" 2>&1 | grep -vE "^INFO|^\s*$" | tail -12
for f in "$R"/pd_logs/*.log; do
  grep -vE "^INFO|tensor/s|capturing CUDA" "$f" | tail -c 20000 > "$f.tail" && mv "$f.tail" "$f"
done
pack
echo "== done in ${SECONDS}s"
