#!/usr/bin/env bash
# Session 23, call 3 (~5 minutes): why prefill:2048 swings from 12.6 to 17 ms between runs
# of the same code (call 2): the eager forward against the host's time to issue it and the
# same forward as one graph replay (prefill_graph_probe), where the host's time goes
# (host_probe, cProfile), and bench forward with Python's garbage collector off against on.
# Usage: RACKSERVE_COMMIT=<sha> bash benchmarks/sessions/gpu_s23c.sh     (BUDGET_S: total seconds)
set -uo pipefail
BUDGET_S=${BUDGET_S:-330}
source "$(dirname "$0")/../device_env.sh"
start_call
nproc; uptime
t=$(cap 80); echo "== prefill graph probe (${t}s)"
((t)) && timeout "$t" python3 benchmarks/prefill_graph_probe.py --batch prefill:2048 \
  --batch prefill:8192 --output "$R/prefill_graph.json"
forward_ab gcoff 'import gc
gc.disable()' gcon 'pass' --iters 20 --warmup 3 --batch prefill:2048
t=$(cap 80); echo "== host probe (${t}s)"
((t)) && timeout "$t" python3 benchmarks/host_probe.py --prefill prefill:2048 --top 25 \
  --output "$R/host_probe.json" | cut -c1-160 | tail -80
ls "$R"; (cd "$OUT" && tar czf s23c.tgz r && rm -rf r)
echo "== done in ${SECONDS}s"
