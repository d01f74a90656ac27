#!/usr/bin/env bash
# Session 26, call 1 (~9.5 minutes; written in session 25, whose machine never started).
# decode:256 is 0.25 ms short of issue 14's 70% (5.220 ms against 4.97, session 24). Four
# switches, each off its measured ground at these sizes, A/B'd in bench forward at
# decode:256 / 128 (decode:64 and 1 take none of them), sides alternating, two passes:
# - wgmma128: the Gluon wgmma attention (and the raw-q prologue) from 128 queries,
#   ops.PREFILL_ATTENTION_MIN_TOKENS 512 -> 128 (512 was set before that kernel existed; it
#   runs at 1.65-2x the split-KV decode kernel at 8192 queries; decode:256's attention: 333 us);
# - postapart128: hc_post_pre's expand in its own launch from 128 tokens,
#   mhc.POST_APART_MIN_TOKENS 1024 -> 128 (session 24's decode:256 timeline: the
#   expand-fused K1 after attention 27 us, the apart pair after the MoE 12 + 6);
# - mixesapart128: K2 as a mixes launch and a collapse launch from 128 tokens,
#   mhc.MIXES_APART_MIN_TOKENS 2048 -> 128 (hc_finish took 12 us a launch at 256 tokens);
# - indexer128: the prefill indexer from 128 queries, ops.PREFILL_ATTN_MIN_TOKENS 512 -> 128
#   (the CSA layer's logits + top-k took 50 us at 256 queries);
# - all four at once, and the defaults.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s26a.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-585}
source "$(dirname "$0")/../device_env.sh"
start_call
wgmma='import rackserve.ops as o; o.PREFILL_ATTENTION_MIN_TOKENS = 128'
post='mhc.POST_APART_MIN_TOKENS = 128'
mixes='mhc.MIXES_APART_MIN_TOKENS = 128'
indexer='import rackserve.ops as o; o.PREFILL_ATTN_MIN_TOKENS = 128'
for pass in 1 2; do
  for side in default wgmma128 postapart128 mixesapart128 indexer128 all; do
    case $side in
      wgmma128) code=$wgmma ;;
      postapart128) code=$post ;;
      mixesapart128) code=$mixes ;;
      indexer128) code=$indexer ;;
      all) code="$wgmma; $post; $mixes; o.PREFILL_ATTN_MIN_TOKENS = 128" ;;
      *) code='pass' ;;
    esac
    t=$(cap 50); echo "== bench forward, $side, pass $pass (${t}s)"
    ((t)) && timeout "$t" bash -c "$(declare -f forward_with); forward_with \"\$@\"" _ "$code" \
      "$R/forward_${side}_$pass.json" --batch decode:256@4096 --batch decode:128@4096 \
      --iters 20 --warmup 3
  done
done
ls "$R"; (cd "$OUT" && tar czf s26a.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
