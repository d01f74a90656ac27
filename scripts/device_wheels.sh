#!/usr/bin/env bash
# Download the wheels the GPU machine lacks (it has no network) into .whl/ (git-ignored).
# On the device:  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#                 export PYTHONPATH=/tmp/site:src
# Its image already has torch, triton, transformers, numpy, safetensors, tokenizers,
# xxhash, tqdm, pyyaml, jinja2, aiohttp, httpx, prometheus-client, matplotlib.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
PY=${PYTHON:-python3}
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64 manylinux_2_24_x86_64 manylinux_2_31_x86_64; do
  platforms+=(--platform "$p")
done
# engine messages and ZMQ (the CLI registers the router and kv-pool commands, which use it);
# accelerate (+ psutil) for transformers' pre-quantized FP8 / FP4 checkpoints
# (benchmarks/hf_decode.py); the server stack (fastapi, uvicorn, pydantic) with `all`
pkgs=(msgspec pyzmq accelerate psutil)
if [[ "${1:-}" == "all" ]]; then
  pkgs+=(fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection
    annotated-doc click h11 opentelemetry-api importlib-metadata zipp)
fi
for pkg in "${pkgs[@]}"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl "$pkg"
done
ls -1 .whl
