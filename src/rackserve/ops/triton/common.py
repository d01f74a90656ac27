"""Helpers shared by the Triton kernels."""

from __future__ import annotations

import triton
import triton.language as tl


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
