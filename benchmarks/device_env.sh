# Sourced by the gpu_*.sh scripts on the device: installs the wheels carried in .whl/
# (scripts/device_wheels.sh: what the device image lacks) into /tmp/site and puts them, the
# sources and benchmarks/ on PYTHONPATH.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1
# the rackserve CLI from the sources, and pytest with the GPU tests selected
rs=(python3 -c 'import sys; from rackserve.cli import main; sys.exit(main(sys.argv[1:]))')
pt=(python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider -rf --tb=short)
# seconds a step of a budgeted script may take ($BUDGET_S in all, counted by $SECONDS): its
# own limit $1, cut to what is left of the budget; 0 (skip it) under 20 s
cap() { local left=$((BUDGET_S - SECONDS)); ((left > $1)) && echo "$1" || echo $((left > 20 ? left : 0)); }
# a budgeted call's start: results under $R ($OUT/r), the commit it ran recorded there
# $RACKSERVE_COMMIT: give the hash as text in the run's command; `$(git log ...)` there reads
# the device copy's history, which can stop at the session's first call (session 27)
start_call() {
  OUT=${OUT:-out/gpu}
  R="$OUT/r"
  mkdir -p "$R"
  echo "commit ${RACKSERVE_COMMIT:-unknown}" | tee "$R/commit.txt"
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$R/gpu.txt"
}
# bench forward of the v4-flash preset (4 layers, 64 experts) with module switches set in
# the process first: $1 python statements (``mhc`` and ``attn`` are rackserve.ops.triton's
# mhc and sparse_attn; ``override(module, "default_tiling", field=value, ...)`` makes a
# tiling function return its dataclass with those fields replaced), $2 the record's path,
# the rest bench forward's own flags
forward_with() {
  local code=$1 output=$2
  shift 2
  python3 -c "import dataclasses, sys
import rackserve.ops.triton.mhc as mhc, rackserve.ops.triton.sparse_attn as attn
def override(module, name, **fields):
    original = getattr(module, name)
    setattr(module, name, lambda *a, **k: dataclasses.replace(original(*a, **k), **fields))
exec(sys.argv[1])
from rackserve.cli import main; sys.exit(main(sys.argv[2:]))" "$code" bench forward \
    --preset v4-flash --layers 4 --experts 64 --output "$output" "$@" 2>&1 \
    | grep --line-buffered -E "^prefill|^decode|Error"
}
# bench decode at 1 and 64 requests, --async-scheduling then synchronous (context 512), on
# the checkpoint $1: records $2/decode_<requests>_<mode>.json, each run cut to 75 s (async)
# or 45 s (sync) of what is left of $BUDGET_S
engine_decode() {
  local model=$1 dir=$2 c mode t flag
  for c in 1 64; do
    # the gates' figures are the async ones (sessions 6, 8): first, with the time to compile
    # the kernels of a new batch size and capture its graphs (session 41: the 64-request
    # sync run, then first, spent its 45 s capturing)
    for mode in async sync; do
      flag=(--no-async-scheduling); [[ $mode == async ]] && flag=(--async-scheduling)
      t=$(cap $([[ $mode == async ]] && echo 75 || echo 45))
      echo "== bench decode, $c requests, $mode (${t}s)"
      ((t)) && [[ -d $model ]] && timeout "$t" "${rs[@]}" bench decode --model "$model" \
        --concurrency $c --context 512 --steps 30 --warmup 5 --kv-cache-memory 8000000000 \
        "${flag[@]}" --output "$dir/decode_${c}_$mode.json" 2>&1 | tail -1
    done
  done
}
# engine_decode next to transformers' decode step on the same checkpoint (v4-flash, 4
# layers, 64 experts, context 512), records and the ratios under $R; the steps' limits cut
# to what is left of $BUDGET_S
decode_vs_transformers() {
  local t
  flash4 170
  engine_decode /tmp/flash4 "$R"
  t=$(cap 150); echo "== transformers (${t}s)"
  ((t)) && [[ -d /tmp/flash4 ]] && timeout "$t" python3 benchmarks/hf_decode.py \
    --model /tmp/flash4 --batch 1,64 --context 512 --output "$R/hf_decode.json" 2>&1 | tail -2
  python3 benchmarks/hf_ratio.py "$R" 1_sync 1_async 64_sync 64_async
}
# bench forward A/B, alternating, two passes: $1 $2 the first side's name and module
# switches (forward_with's $1), $3 $4 the second's, the rest bench forward's flags; records
# $R/forward_<name>_<pass>.json, each run cut to 60 s of what is left of $BUDGET_S
forward_ab() {
  local name_a=$1 code_a=$2 name_b=$3 code_b=$4 pass t
  shift 4
  for pass in 1 2; do
    t=$(cap 60); echo "== bench forward, $name_a, pass $pass (${t}s)"
    ((t)) && forward_with "$code_a" "$R/forward_${name_a}_$pass.json" "$@"
    t=$(cap 60); echo "== bench forward, $name_b, pass $pass (${t}s)"
    ((t)) && forward_with "$code_b" "$R/forward_${name_b}_$pass.json" "$@"
  done
}
# the graph-replay timelines (graph_gap.py: kernel by kernel, where a step's time goes) of
# the bench forward batches $3.. into $2, cut to $1 s of what is left of $BUDGET_S
replay_timelines() {
  local limit=$1 output=$2 t b args=()
  shift 2
  for b in "$@"; do args+=(--batch "$b"); done
  t=$(cap "$limit"); echo "== graph_gap $* (${t}s)"
  ((t)) && timeout "$t" python3 -c "import runpy, sys
sys.path.insert(0, 'benchmarks')  # graph_gap imports bench_timing
sys.argv = ['graph_gap.py'] + sys.argv[1:]
runpy.run_path('benchmarks/graph_gap.py', run_name='__main__')" "${args[@]}" \
    --output "$output" 2>&1 | tail -3
}
# every gate of issues 13 and 14 in one bench forward: $R/forward_gates.json
forward_gates() {
  echo "== bench forward, every gate"
  forward_with 'pass' "$R/forward_gates.json" --iters 20 --warmup 3 --batch decode:1@4096 \
    --batch decode:64@4096 --batch decode:256@4096 --batch decode:64@65536 \
    --batch prefill:2048 --batch prefill:8192 --batch prefill:8192@65536
}
# the bf16 accuracy gates of the whole model (teacher-forced against the bf16 reference, no
# less accurate than it against fp32; cut to 170 s of what is left of $BUDGET_S):
# $R/pytest_accuracy.log
accuracy_gates() {
  local t
  t=$(cap 170); echo "== bf16 accuracy gates (${t}s)"
  ((t)) && timeout "$t" "${pt[@]}" -s tests/model/test_gpu_fastpath.py \
    -k "teacher_forced or no_less_accurate" > "$R/pytest_accuracy.log" 2>&1
  grep -E "^E  |context|median|passed|failed" "$R/pytest_accuracy.log" | head -12
}
# accuracy_gates, then forward_gates; records under $R
gates() {
  accuracy_gates
  forward_gates
}
# the V4-Flash checkpoint bench decode reads (v4-flash, 4 layers, 64 experts, bf16) at
# /tmp/flash4, made unless there; cut to $1 s of what is left of $BUDGET_S
flash4() {
  local t
  [[ -d /tmp/flash4 ]] && return
  t=$(cap "$1"); echo "== model create (${t}s)"
  ((t)) && timeout "$t" "${rs[@]}" \
    model create --preset v4-flash --layers 4 --experts 64 --dtype bfloat16 --no-mtp \
    --device cuda --out /tmp/flash4 2>&1 | tail -1
}
# the same with its MTP layer at /tmp/flash4mtp (speculation); cut to $1 s. Both drawn on
# the GPU (--device cuda): on the CPU they took 70-90 s, past a 70 s cap twice in session 38
# (the GPU's time not measured yet)
flash4mtp() {
  local t
  [[ -d /tmp/flash4mtp ]] && return
  t=$(cap "$1"); echo "== model create, MTP layer (${t}s)"
  ((t)) && timeout "$t" "${rs[@]}" \
    model create --preset v4-flash --layers 4 --experts 64 --dtype bfloat16 --device cuda \
    --out /tmp/flash4mtp 2>&1 | tail -1
}
# bench decode at 64 requests with the KV cache sized by --gpu-memory-utilization (the
# reserve logged beside the graphs' memory): $R/decode_64_budget.{json,log}; cut to $1 s
decode_sized_by_utilization() {
  local t
  t=$(cap "$1"); echo "== bench decode sized by --gpu-memory-utilization (${t}s)"
  ((t)) && [[ -d /tmp/flash4 ]] && timeout "$t" "${rs[@]}" \
    bench decode --model /tmp/flash4 --concurrency 64 --context 512 --steps 20 --warmup 5 \
    --output "$R/decode_64_budget.json" > "$R/decode_64_budget.log" 2>&1
  grep -E "memory:|CUDA graphs|KV cache|decode x|Error" "$R/decode_64_budget.log" | head -8
}
# bench decode --profile at 32 requests, context 1024, on the checkpoint $MODEL: $1 the
# record's name, $2 its limit (cut to what is left of $BUDGET_S), $3 a speculative config
# (JSON, optional); records $R/decode_<name>_x32.json and $R/profile_<name>_x32.txt, and
# prints the profile's device timeline
decode_profile() {
  local name=$1 limit=$2 spec=${3:-} t
  t=$(cap "$limit"); echo "== bench decode --profile, $name x32 (${t}s)"
  ((t)) && [[ -d $MODEL ]] && timeout "$t" "${rs[@]}" bench decode --model "$MODEL" \
    --concurrency 32 --context 1024 --steps 12 --warmup 3 --kv-cache-memory 8000000000 \
    ${spec:+--speculative-config "$spec"} --profile "$R/profile_${name}_x32.txt" \
    --output "$R/decode_${name}_x32.json" 2>&1 | grep -E "^decode|Error"
  [[ -f $R/profile_${name}_x32.txt ]] && sed -n '/== device timeline/,$p' \
    "$R/profile_${name}_x32.txt" | head -14
}
