#!/usr/bin/env bash
# The grouped prefill MoE's rows written from each token's row (grouped_moe.PERMUTE_BY_TOKEN,
# the default since session 27: x read once) against the gather by sorted row (index_select:
# 1.15 ms for 4 layers of prefill:8192 on the H100, each x row read k times in expert
# order), on an H200 (session 27 timed it on an H100 only): its GPU tests, then bench
# forward A/B at the prefill gates, two passes.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s28a.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-200}
source "$(dirname "$0")/../device_env.sh"
start_call
t=$(cap 40); echo "== the permute kernel's tests (${t}s)"
((t)) && timeout "$t" "${pt[@]}" tests/ops/test_prefill_moe.py tests/ops/test_grouped_moe.py \
  > "$R/pytest.log" 2>&1
grep -E "^E  |^FAILED|passed|failed" "$R/pytest.log" | head -6
forward_ab gather 'import rackserve.ops.grouped_moe as g; g.PERMUTE_BY_TOKEN = False' by_token 'pass' \
  --batch prefill:2048 --batch prefill:8192 --batch prefill:8192@65536 --iters 10 --warmup 2
# the embedding's expansion into the 4 streams (deepseek_v4.py: expand().contiguous(), a
# strided elementwise copy: 0.32 ms at 8192 tokens on the H100, profile_forward, session
# 27) against torch.cat (a vectorized batched copy), alone
t=$(cap 30); echo "== streams expansion at 8192 tokens (${t}s)"
((t)) && timeout "$t" python3 -c "
import torch, triton.testing as tt
x = torch.randn(8192, 4096, device='cuda').bfloat16()
for name, fn in {'expand_contiguous': lambda: x.unsqueeze(1).expand(-1, 4, -1).contiguous(),
                 'cat': lambda: torch.cat([x] * 4, dim=1).view(8192, 4, 4096)}.items():
    assert torch.equal(fn(), x.unsqueeze(1).expand(-1, 4, -1))
    print(name, round(1e3 * tt.do_bench(fn, return_mode='median'), 1), 'us')
" | tee "$R/streams_expand.txt"
ls "$R"; (cd "$OUT" && tar czf s28a.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
