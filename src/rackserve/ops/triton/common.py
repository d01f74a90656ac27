"""Helpers shared by the Triton kernels."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Programmatic dependent launch (PDL) between the Triton kernels of a step: a kernel
# launched with it may start while the one before it finishes (its blocks are scheduled and
# wait in ``pdl_wait``), which hides most of a boundary's launch latency. Inside a CUDA graph
# on the H200 (benchmarks/pdl_probe.py, 64 one-program kernels): 1.05 -> 0.68 us a
# boundary. $RACKSERVE_PDL=0: plain launches.
PDL_ENV = "RACKSERVE_PDL"


def pdl(device: torch.device) -> dict[str, bool]:
    """A launch's PDL arguments: the kernels' ``PDL`` constexpr and Triton's ``launch_pdl``
    (on a CUDA device unless $RACKSERVE_PDL is "0"; never under the interpreter)."""
    on = device.type == "cuda" and os.environ.get(PDL_ENV, "1") == "1"
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """A PDL kernel's first statement: wait until the kernel before it has finished and its
    writes are visible, then let the next kernel's blocks be scheduled. Every program runs
    it before anything else (early returns included), so each kernel's body still runs
    after the whole previous kernel, as without PDL: what overlaps is launch and scheduling."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def round_as(y, dtype: tl.constexpr):
    """y (fp32) rounded to ``dtype`` (nearest even) and returned as fp32.

    bfloat16 is rounded by hand: the Triton interpreter's float32 -> bfloat16 cast truncates
    (CPU tests would see 1-ulp errors); on the GPU this is the same RTNE as the hardware cast.
    """
    if dtype == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        y = tl.where(y == y, rounded.to(tl.float32, bitcast=True), y)  # NaN stays NaN
    return y.to(dtype).to(tl.float32)
