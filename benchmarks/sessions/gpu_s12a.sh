#!/usr/bin/env bash
# Prepared in session 11 for the next device call (~9.5 minutes): fair A/Bs of the switches
# that are off (or were picked from a biased microbenchmark), each variant twice in
# alternation so the spread between runs shows. 1. the GPU tests of the wide kernel's fp16 PV
# and the split K2; 2. sparse_attention_bench at 256 and 2048 queries: split p against fp16
# PV and against the never-timed transposed kernel (wide_t); 3. mhc_bench at 8192 (its
# variants now start from the bf16 tiling: K1's tilings were never compared fairly), and
# ncu of K1 there (about 380 us for 268 MB of streams: why); 4. bench forward (prefill:2048,
# prefill:8192, decode:64@4096) as now / fp16 PV from 64 queries / K2 split from 1024
# tokens / hc_post_pre's expand fused in K1 again (POST_APART off), then all four again.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s12a.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-560}
source "$(dirname "$0")/../device_env.sh"
start_call
pack() { tar czf "$OUT/s12a.tgz" -C "$OUT" r; }

t=$(cap 80); echo "== GPU tests: wide fp16 PV, split K2 (${t}s)"
((t)) && timeout "$t" python3 -m pytest -v -p no:cacheprovider -m "gpu or not gpu" -rf \
  tests/ops/test_sparse_attn.py tests/ops/test_mhc.py \
  -k "fp16 or (test_sparse_attn and v4_flash) or mixes_apart" > "$R/pytest.log" 2>&1
grep -E "PASSED|FAILED|ERROR" "$R/pytest.log" | awk '{print $2}' | sort | uniq -c
grep -E "^E  " "$R/pytest.log" | head -6
pack
t=$(cap 50); echo "== sparse_attention_bench 256, 2048 queries (${t}s)"
((t)) && timeout "$t" python3 benchmarks/sparse_attention_bench.py --queries 256 2048 \
  --variants wide_fp16_pv wide_t --output "$R/sparse_attention_bench.json" 2>&1 | grep -v reference
pack
t=$(cap 50); echo "== mhc_bench 8192: K1 / K2 tilings, fairly now (${t}s)"
((t)) && timeout "$t" python3 benchmarks/mhc_bench.py --tokens 8192 --output "$R/mhc_bench.json" \
  --ops hc_pre hc_post_pre --variants mixes128 mixes64 post_fused bf16x3 gemm_d*2 gemm_t128 \
  gemm_t128_w8 gemm_w8 gemm_t32 programs/2 programs*2 2>&1 | grep -E "hc_pre |hc_post_pre|Error"
pack
t=$(cap 40); echo "== ncu: mHC K1 (prenorm_gemm_kernel) of hc_pre at 8192 tokens (${t}s)"
((t)) && timeout "$t" ncu --clock-control none --kernel-name regex:prenorm_gemm \
  --launch-skip 2 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section Occupancy --section LaunchStats \
  python3 -c "import torch, mhc_bench as b
a = b._inputs(8192, 'cuda'); blk = (a['fn'], a['base'], a['scale'], a['norm_weight'], 20, 1e-6, 1e-6)
for _ in range(4): b.mhc.hc_pre(a['streams'], *blk)
torch.cuda.synchronize()" > "$R/ncu_k1.txt" 2>&1
grep -E "Duration|Throughput|Hit Rate|Achieved Occupancy|Registers|Stall|Warp Cycles|Bandwidth" \
  "$R/ncu_k1.txt" | head -30
pack
for pass in 1 2; do
  for v in "as_now|pass" "pv_fp16|attn.PV_FP16_MIN_QUERIES = 64" \
           "mixes_apart|mhc.MIXES_APART_MIN_TOKENS = 1024" \
           "post_fused|mhc.POST_APART_MIN_TOKENS = 10**9"; do
    name=${v%%|*}; code=${v#*|}
    limit=40; [[ $pass$name == 1as_now ]] && limit=60  # the first compiles the prefill kernels
    t=$(cap $limit); echo "== forward $name, pass $pass (${t}s)"
    ((t)) && timeout "$t" bash -c "$(declare -f forward_with); forward_with '$code' $R/${name}_$pass.json \
      --iters 10 --warmup 2 --batch prefill:2048 --batch prefill:8192 --batch decode:64@4096"
    pack
  done
done
echo "== done in ${SECONDS}s"
