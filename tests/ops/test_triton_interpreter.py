"""The interpreter shim of ``tests/triton_interpreter.py``: installed under the interpreter,
helpers inside a launch are not patched again, and kernels compute what they did."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's own patching"
)


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _plus_one(x):
    return _twice(x) + 1


@triton.jit
def _kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, _plus_one(x) + _twice(x))


def test_helpers_inside_a_launch_are_patched_once(monkeypatch):
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "skips_nested", False), "shim not installed"

    patches = []
    builtin = interpreter._patch_builtin
    monkeypatch.setattr(
        interpreter, "_patch_builtin", lambda pkg, *a: patches.append(pkg) or builtin(pkg, *a)
    )
    x = torch.arange(8, dtype=torch.float32)
    out = torch.empty_like(x)
    _kernel[(1,)](x, out, BLOCK=8)
    assert torch.equal(out, 4 * x + 1)
    # tl patched by the launch, not again by the three helper calls (each would, unpatched)
    assert patches.count(tl) == 1, patches
    # the launch restored the language: tl.arange is Triton's own builtin again
    assert tl.core.is_builtin(tl.arange)
