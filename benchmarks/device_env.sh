# Sourced by the gpu_*.sh scripts on the device: installs the wheels carried in .whl/
# (scripts/device_wheels.sh: what the device image lacks) into /tmp/site and puts them, the
# sources and benchmarks/ on PYTHONPATH.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1
# seconds a step of a budgeted script may take ($BUDGET_S in all, counted by $SECONDS): its
# own limit $1, cut to what is left of the budget; 0 (skip it) under 20 s
cap() { local left=$((BUDGET_S - SECONDS)); ((left > $1)) && echo "$1" || echo $((left > 20 ? left : 0)); }
# a budgeted call's start: results under $R ($OUT/r), the commit it ran recorded there
start_call() {
  OUT=${OUT:-out/gpu}
  R="$OUT/r"
  mkdir -p "$R"
  echo "commit ${RACKSERVE_COMMIT:-unknown}" | tee "$R/commit.txt"
}
# bench forward of the v4-flash preset (4 layers, 64 experts) with module switches set in
# the process first: $1 python statements (``mhc`` and ``attn`` are rackserve.ops.triton's
# mhc and sparse_attn), $2 the record's path, the rest bench forward's own flags
forward_with() {
  local code=$1 output=$2
  shift 2
  python3 -c "import sys
import rackserve.ops.triton.mhc as mhc, rackserve.ops.triton.sparse_attn as attn
exec(sys.argv[1])
from rackserve.cli import main; sys.exit(main(sys.argv[2:]))" "$code" bench forward \
    --preset v4-flash --layers 4 --experts 64 --output "$output" "$@" 2>&1 \
    | grep -E "^prefill|^decode|Error"
}
