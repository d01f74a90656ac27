#!/usr/bin/env bash
# Session 29, call 2 (written in session 29, which had no device time left): issue 14's
# decode gate against transformers on DeepSeek-V4's own checkpoint format, FP8 linears
# (128 x 128 block scales) and FP4 routed experts (e2m1, a ue8m0 scale per 32). With bf16
# weights the 20x at 64 requests needs the whole step at the H200's copy bandwidth
# (results/2026-12-06-s28.md, section 1); the FP4 experts carry a quarter of the expert
# bytes. The checkpoint: v4-flash, 4 layers, 64 experts, `model create --quantization fp8
# --expert-dtype fp4`; bench decode at 1 and 64 requests (sync, async) and transformers'
# decode step on it (accelerate and psutil carried in .whl/ since session 29; transformers
# <= 5.17 reads `expert_dtype` at config.json's top level, written there since session 29;
# its FP8 kernels come from the HF hub, so offline hf_decode.py has it dequantize the
# checkpoint to bf16 at load and says so in the record), then bench forward FP8 / FP4
# against bf16 at the decode gates. Records under $R/fp8_fp4.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s29b.sh     (BUDGET_S: seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-480}
source "$(dirname "$0")/../device_env.sh"
start_call
Q="$R/fp8_fp4"
mkdir -p "$Q"
python3 -c 'import accelerate, transformers; print("accelerate", accelerate.__version__,
  "transformers", transformers.__version__)' 2>&1 | tail -1
t=$(cap 170); echo "== model create, fp8 linears and fp4 experts (${t}s)"
((t)) && timeout "$t" "${rs[@]}" model create --preset v4-flash --layers 4 --experts 64 \
  --dtype bfloat16 --no-mtp --quantization fp8 --expert-dtype fp4 --out /tmp/flash4q 2>&1 | tail -1
engine_decode /tmp/flash4q "$Q"
t=$(cap 200); echo "== transformers on the fp8/fp4 checkpoint (${t}s)"
((t)) && [[ -d /tmp/flash4q ]] && timeout "$t" python3 benchmarks/hf_decode.py \
  --model /tmp/flash4q --batch 1,64 --context 512 --output "$Q/hf_decode.json" \
  > "$Q/hf_decode.log" 2>&1
grep -vE "Loading weights|Warning" "$Q/hf_decode.log" | tail -4
python3 benchmarks/hf_ratio.py "$Q" 1_sync 1_async 64_sync 64_async
python3 benchmarks/gates.py "$Q" --output "$Q/gates.json"
# the forward alone, FP8/FP4 against bf16 (bench forward quantizes the random weights itself)
t=$(cap 60); echo "== bench forward bf16 (${t}s)"
((t)) && forward_with 'pass' "$R/forward_bf16.json" --iters 20 --warmup 3 \
  --batch decode:1@4096 --batch decode:64@4096 --batch decode:256@4096
t=$(cap 60); echo "== bench forward fp8/fp4 (${t}s)"
((t)) && forward_with 'pass' "$Q/forward.json" --iters 20 --warmup 3 --quantization fp8 \
  --expert-dtype fp4 --batch decode:1@4096 --batch decode:64@4096 --batch decode:256@4096
ls -R "$R" | head -30; (cd "$OUT" && tar czf s29b.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
