"""Compile what the interpreter ran for the H200 (sm_90), on a machine without a GPU.

Triton's interpreter runs a kernel as plain Python, so code that the compiler rejects can
pass every CPU test. On 2026-12-01 every fp8-KV reader failed to compile on the H200
("Inconsistent return types": a static ``if`` that returns, then a trailing ``return``)
after passing the interpreter tests. :func:`recorded_launches` records each interpreted
launch as a compile spec (the kernel, its argument types, its constexprs, warps and
stages); :func:`compile_for_sm90` compiles the distinct specs in a subprocess, with real
``@triton.jit`` kernels, through Triton's bundled ptxas.

The CPU launches set the kernels' fp32-dot flags (the interpreter's bf16 dot is wrong);
for 16-bit launches :func:`gpu_variants` adds the spec with those flags off, which is what
the GPU runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import torch

# constexprs that the CPU path turns on for exact fp32 dots, off on a GPU for 16-bit inputs
FP32_DOT_FLAGS = ("FP32_DOT", "FP32_DOTS", "DOT_FP32", "IEEE")
_TYPES = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
    torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv",
}  # fmt: skip
# constexprs that only a GPU turns on (ops the interpreter lacks, e.g. tl.dot_scaled)
GPU_ONLY_FLAGS = ("DOT_SCALED", "NATIVE_BF16", "ASM_DECODE", "LIBDEVICE")
_OPTIONS = ("num_warps", "num_stages")


def _arg_type(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def _spec(fn, args: tuple, kwargs: dict) -> dict:
    """One interpreted launch as a compile spec (JSON-able)."""
    inner = fn.fn
    names = list(fn.arg_names)
    constexpr = {
        n for n, a in inner.__annotations__.items() if "constexpr" in str(a) and n in names
    }
    bound = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    signature, consts, aligned = {}, {}, []
    for name in names:
        value = bound.get(name)
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if name in constexpr or value is None or (is_int and value == 1):
            # the JIT makes an int equal to 1 a constexpr too (a unit stride: vector loads)
            signature[name] = "constexpr"
            consts[name] = getattr(value, "value", value)  # tl.dtype etc. stay as reprs
        else:
            signature[name] = _arg_type(value)
            # as the JIT specializes: pointers, and ints divisible by 16 (bools are not)
            if isinstance(value, torch.Tensor) or (is_int and value % 16 == 0):
                aligned.append(name)
    consts = {k: (v if isinstance(v, (bool, int, float, str, type(None))) else repr(v))
              for k, v in consts.items()}  # fmt: skip
    options = {k: kwargs[k] for k in _OPTIONS if k in kwargs}
    return {
        "module": inner.__module__, "kernel": inner.__name__, "signature": signature,
        "constexprs": consts, "aligned": aligned, "options": options,
    }  # fmt: skip


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[dict]]:
    """``with recorded_launches() as specs: ...``: every interpreted Triton launch inside,
    as a compile spec (launches from inside a kernel are not launches)."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run
    specs: list[dict] = []

    def run(fn, *args, **kwargs):
        if not kwargs.get("warmup"):
            specs.append(_spec(fn, args, kwargs))
        return original(fn, *args, **kwargs)

    InterpretedFunction.run = run
    try:
        yield specs
    finally:
        InterpretedFunction.run = original


def gpu_variants(specs: list[dict]) -> list[dict]:
    """The distinct specs, plus for 16-bit launches the same with the fp32-dot flags off,
    plus for launches with GPU-only flags the same with each of those on (and fp32 dots
    off)."""
    out: dict[str, dict] = {}
    for spec in specs:
        variants = [spec]
        consts = spec["constexprs"]
        sixteen = any(t in ("*bf16", "*fp16") for t in spec["signature"].values())
        flags = dict.fromkeys((f for f in FP32_DOT_FLAGS if consts.get(f) is True), False)
        if sixteen and flags:
            variants.append(spec | {"constexprs": consts | flags})
        for flag in (f for f in GPU_ONLY_FLAGS if consts.get(f) is False):  # one at a time
            variants.append(spec | {"constexprs": consts | flags | {flag: True}})
        for v in variants:
            out.setdefault(json.dumps(v, sort_keys=True), v)
    return list(out.values())


_COMPILER = r"""
import importlib, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton.language as tl

def constexpr(name, value):
    if isinstance(value, str) and value.startswith("triton.language."):
        return getattr(tl, value.rsplit(".", 1)[1])
    return value

failures, byte_loads, resources = [], [], []
for spec in json.load(sys.stdin):
    fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    sig = spec["signature"]
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n in spec["aligned"]}
    consts = {k: constexpr(k, v) for k, v in spec["constexprs"].items()}
    try:
        compiled = triton.compile(
            ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
            target=GPUTarget("cuda", 90, 32), options=spec["options"])
    except Exception as e:
        failures.append({"kernel": spec["kernel"], "constexprs": spec["constexprs"],
                         "error": str(e)[-800:]})
        continue
    ptx = compiled.asm["ptx"]
    # one-byte global loads, direct or through cp.async (size operand 0x1)
    narrow = ptx.count("ld.global.b8") + ptx.count("ld.global.u8")
    narrow += len(re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*, 0x1,", ptx))
    byte_loads.append({"kernel": spec["kernel"], "constexprs": spec["constexprs"],
                       "count": narrow})
    # shared memory, and the copies each async_wait of the TTGIR leaves in flight
    ttgir = compiled.asm["ttgir"]
    waits = [int(n) for n in re.findall(r"ttg\.async_wait[^\n]*\{num = (\d+)", ttgir)]
    resources.append({"kernel": spec["kernel"], "constexprs": spec["constexprs"],
                      "options": spec["options"], "shared": compiled.metadata.shared,
                      "async_waits": waits})
print(json.dumps({"failures": failures, "byte_loads": byte_loads, "resources": resources}))
"""


def compile_for_sm90(specs: list[dict], timeout: float = 900) -> list[dict]:
    """Compile ``specs`` for sm_90 in a subprocess (real JIT kernels: no interpreter);
    returns the failures (kernel, constexprs, error)."""
    return compile_report(specs, timeout)["failures"]


def compile_report(specs: list[dict], timeout: float = 900) -> dict:
    """``{"failures": [...], "byte_loads": [{kernel, constexprs, count}], "resources":
    [{kernel, constexprs, options, shared, async_waits}]}``: the compile failures, and for
    each spec that compiled its one-byte global loads per thread in the PTX (a packed
    weight read a byte at a time streams at a few percent of bandwidth), its shared memory
    in bytes and, per ``ttg.async_wait`` of its TTGIR, the copies that wait leaves in flight
    (all zero: no gather overlaps the compute that follows it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILER], input=json.dumps(specs), capture_output=True,
        text=True, env=env, timeout=timeout, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the sm_90 compiler process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
