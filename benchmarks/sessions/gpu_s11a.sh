#!/usr/bin/env bash
# Session 11's first call after gpu_s10a.sh (~8 minutes): why the split K2
# (Tiling.mixes_block_t) is not bitwise equal to one launch on the GPU (max |diff| and the
# count of unequal elements, one launch and two against the reference, at the test's shapes
# and at V4-Flash's 8192 x 4096), mhc_bench's K2 / K1 variants at 2048 and 8192 tokens,
# then issue 17's serving figures on one GPU (pd_serving_bench over TCP: TTFT of 1 prefill
# + 1 decode + router against one aggregated engine, ITL under a burst with and without the
# admission cap). Needs `scripts/device_wheels.sh all` (the server stack) in .whl/.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s11a.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-480}
source "$(dirname "$0")/../device_env.sh"
start_call
export PYTHONPATH=$PYTHONPATH:$PWD/tests:$PWD/tests/ops

t=$(cap 60); echo "== split K2 against one launch (${t}s)"
((t)) && timeout "$t" python3 - > "$R/mixes_check.txt" 2>&1 <<'PY'
import dataclasses, torch
from rackserve.ops import reference
from rackserve.ops.triton import mhc
from test_mhc import gpu_like_tiling, hc_pre_args
for t, d, bt, dtype in [(37, 256, 16, torch.float32), (37, 256, 16, torch.bfloat16),
                        (5, 320, 32, torch.bfloat16), (8192, 4096, 128, torch.bfloat16)]:
    one = gpu_like_tiling(mhc, 1) if d < 4096 else mhc.default_tiling(t, 4, d, torch.device("cuda"))
    two = dataclasses.replace(one, mixes_block_t=bt)
    args = hc_pre_args(t, d, seed=70 + t, dtype=dtype)
    a, b = mhc.hc_pre(*args, tiling=one), mhc.hc_pre(*args, tiling=two)
    ref = reference.hc_pre(args[0].float(), *args[1:])
    for name, x, y, r in zip(("x", "post", "comb"), a, b, ref):
        x, y, r = x.float(), y.float(), r.float()
        print(f"T={t} D={d} {str(dtype):15s} {name:5s} one-vs-two max {(x - y).abs().max().item():.3e}"
              f" unequal {(x != y).sum().item()}/{x.numel()}  one-vs-ref {(x - r).abs().max().item():.3e}"
              f" two-vs-ref {(y - r).abs().max().item():.3e}", flush=True)
PY
cat "$R/mixes_check.txt"
t=$(cap 90); echo "== mhc_bench 2048, 8192 tokens (${t}s)"
((t)) && timeout "$t" python3 benchmarks/mhc_bench.py --tokens 8192 2048 --output "$R/mhc_bench.json" \
  --variants mixes128 mixes64 mixes128_w4 bf16x3 2>&1 | tee "$R/mhc_bench.txt" | grep -E "hc_pre |hc_post_pre|Error"
t=$(cap 330); echo "== P/D serving on one GPU over TCP (${t}s)"
if ((t)); then
  python3 -m rackserve.cli model create --preset v4-flash --layers 4 --experts 16 \
    --dtype bfloat16 --out /tmp/pd_model > "$R/model_create.log" 2>&1
  timeout "$t" python3 benchmarks/pd_serving_bench.py --model /tmp/pd_model --gpus 1 \
    --transport tcp --lengths 1024,4096,16384 --repeats 2 --logs "$R/pd_logs" \
    --out "$R/pd_serving.json" 2>&1 | grep -vE "^INFO|^\s*$" | tail -30
  for f in "$R"/pd_logs/*.log; do tail -c 20000 "$f" > "$f.tail" && mv "$f.tail" "$f"; done
fi
echo "== done in ${SECONDS}s"
