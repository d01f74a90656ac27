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
