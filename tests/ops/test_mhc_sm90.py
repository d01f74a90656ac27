"""mHC's K1 (``prenorm_gemm_kernel``) compiled for sm_90 (no GPU: Triton's bundled ptxas) in
the launch shapes that ``mhc.default_tiling`` picks for V4-Flash's streams (N 4, D 4096, bf16)
and in the expand-fused candidates an A/B times (``mhc.EXPAND_K1_*``): no spills.

Session 45 found the defaults' expand-fused K1 at 17-127 tokens (32 tokens x 32 columns,
tf32x3) keeping 1000 bytes of stack, 482 spill instructions; at decode:64 on an H100 it took
18 us a call where the flat K1 without the expand took 5 (session 43's replay)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from rackserve.ops.triton import mhc

from sm90 import stack_bytes

N, D = 4, 4096
STACK_BYTES = 16  # ptxas' stack bytes K1 may keep
SHARED_BYTES = 227 * 1024


def _launch(tiling: mhc.Tiling, expand: bool) -> dict:
    """K1's constexprs, warps and stages as ``mhc_launch._launch`` specializes them for bf16
    streams on a GPU (``expand``: hc_post_pre, the expand in K1's prologue)."""
    precision = tiling.gemm_precision
    if expand and tiling.expand_precision is not None:
        precision = tiling.expand_precision
    return {
        "N": N, "BLOCK_N": N, "BLOCK_T": 1 if tiling.gemm_gemv else tiling.gemm_block_t,
        "BLOCK_M": 32, "BLOCK_D": tiling.gemm_block_d, "FUSE_POST": expand, "SLOTS": False,
        "PRECISION": precision, "GEMV": tiling.gemm_gemv, "NATIVE_BF16": True,
        "FLAT": not expand and tiling.gemm_flat, "PDL": True,
        "PER_STREAM": expand and tiling.expand_per_stream and not tiling.gemm_gemv,
        "num_warps": tiling.gemm_warps, "num_stages": tiling.gemm_stages or 3,
    }  # fmt: skip


def compile_report(launch: dict) -> dict:
    """Stack and shared bytes and the dots of K1 compiled for sm_90 (this file as a script:
    the interpreter cannot compile)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rackserve.ops.triton.mhc_kernels import prenorm_gemm_kernel as fn

    options = {k: launch.pop(k) for k in ("num_warps", "num_stages")}
    pieces = launch["PRECISION"] == "bf16x3"  # fn's three bf16 pieces
    types = {"x_ptr": "*bf16", "block_out_ptr": "*bf16", "new_ptr": "*bf16",
             "w_ptr": "*bf16" if pieces else "*fp32", "slot_ids_ptr": "*i32"}  # fmt: skip
    names = list(fn.arg_names)
    sig = {n: "constexpr" if n in launch else types.get(n, "*fp32" if n.endswith("_ptr")
           else "i32") for n in names}  # fmt: skip
    aligned = [n for n in names if n.endswith("_ptr") or n.startswith("stride")]
    aligned += ["hidden", "d_per_split"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=launch, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = kernel.asm["ptx"]
    return {"stack_bytes": stack_bytes(kernel), "shared_bytes": kernel.metadata.shared,
            "dots": ptx.count("wgmma.mma_async") + ptx.count("mma.sync")}  # fmt: skip


def _defaults() -> dict[int, mhc.Tiling]:
    """The default tilings by token count, on an H200 (132 SMs)."""
    sms, mhc._num_sms = mhc._num_sms, lambda device: 132
    try:
        cuda = torch.device("cuda")
        return {t: mhc.default_tiling(t, N, D, cuda, torch.bfloat16) for t in TOKENS}
    finally:
        mhc._num_sms = sms


TOKENS = (1, 4, 16, 64, 256, 2048, 8192)
CANDIDATES = [(64, n) for n in mhc.EXPAND_K1_DECODE] + [(8192, n) for n in mhc.EXPAND_K1_PREFILL]


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    """Every launch below compiled in one process (each test reads its own report)."""
    defaults = _defaults()
    launches = {f"default_{t}": _launch(tiling, not tiling.post_apart) for t, tiling in
                defaults.items()}  # fmt: skip
    every = mhc.EXPAND_K1_DECODE | mhc.EXPAND_K1_PREFILL
    for t, name in CANDIDATES:
        launches[name] = _launch(mhc.expand_k1_tiling(defaults[t], every[name]), True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, __file__, json.dumps(launches)], env=env, capture_output=True,
        text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


SPILLS = "the defaults' expand-fused K1 at 5-127 tokens, tf32x3 (session 45; A/B pending)"


@pytest.mark.parametrize(
    "num_tokens",
    [pytest.param(t, marks=pytest.mark.xfail(strict=True, reason=SPILLS)) if t in (16, 64)
     else t for t in TOKENS],
)  # fmt: skip
def test_default_k1_compiles_for_sm90_without_spills(num_tokens, reports):
    """hc_post_pre's K1 (the expand in its prologue below ``POST_APART_MIN_TOKENS``, else
    the flat K1 after hc_post's own expand) at the default launch shapes."""
    report = reports[f"default_{num_tokens}"]
    assert report["stack_bytes"] <= STACK_BYTES, report
    assert report["shared_bytes"] <= SHARED_BYTES, report


@pytest.mark.parametrize("num_tokens, name", CANDIDATES)
def test_expand_k1_candidates_compile_for_sm90_without_spills(num_tokens, name, reports):
    """Each expand-fused candidate an A/B times (at a decode or a prefill size) compiles
    without spills, within shared memory, with its dot on the tensor cores."""
    report = reports[name]
    assert report["stack_bytes"] <= STACK_BYTES, report
    assert report["shared_bytes"] <= SHARED_BYTES, report
    assert report["dots"] > 0


if __name__ == "__main__":
    launches = json.loads(sys.argv[1])
    print(json.dumps({name: compile_report(launch) for name, launch in launches.items()}))
