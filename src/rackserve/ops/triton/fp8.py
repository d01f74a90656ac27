"""FP8 (e4m3) KV cache rows in the Triton kernels: one encoding rule, the reference's.

The reference stores a row as ``reference.as_stored(row.to(activation dtype), e4m3)``: no
scale (the cached rows are RMS-normed, |x| ~ 1), round to nearest even, saturating at +-448
(torch's CPU cast does that; its CUDA cast gives NaN past 448, so the reference clamps).
Writers round to the activation dtype first (``round_as``) and then encode, so their bytes
equal the reference's bit for bit.

Writers get the fp8 cache as a ``uint8`` view and store the codes of ``e4m3_bits``: the
encoding is integer arithmetic, because the Triton interpreter's float -> fp8 cast is wrong
(it wraps large values and rounds some to NaN); the cost is a few integer ops per stored
value, on rows written once per token. Readers load the fp8 rows as they are (1 byte per
value from HBM) and ``widen`` them in registers to the queries' dtype (exact: every e4m3
value is a bf16 / fp16 value).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rackserve.ops.triton.common import round_as

FP8_KV_DTYPE = torch.float8_e4m3fn


def is_fp8(t: torch.Tensor) -> bool:
    """Whether a cache tensor holds e4m3 rows (the ``--kv-cache-dtype fp8`` storage)."""
    return t.dtype == FP8_KV_DTYPE


def as_codes(t: torch.Tensor) -> torch.Tensor:
    """A writer's view of a cache: fp8 caches as their uint8 codes (see the module doc),
    other caches unchanged."""
    return t.view(torch.uint8) if is_fp8(t) else t


@triton.jit
def e4m3_bits(y):
    """fp32 y -> uint8 e4m3 codes: round to nearest even, saturating at +-448, -0 kept.

    Normal range (|y| >= 2^-6): the fp32 mantissa is rounded to 3 bits in the integer domain
    and the exponent rebased (bias 127 -> 7). Subnormals (|y| < 2^-6, steps of 2^-9): the
    fp32 add of 2^23 rounds |y| * 2^9 to an integer (nearest even) in its low mantissa bits.
    """
    bits = y.to(tl.uint32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.uint32)
    a = tl.minimum(tl.abs(y), 448.0)
    a_bits = a.to(tl.uint32, bitcast=True)
    rounded = a_bits + 0x7FFFF + ((a_bits >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)
    sub = (a * 512.0 + 8388608.0).to(tl.uint32, bitcast=True) - 0x4B000000
    code = tl.where(a >= 0.015625, normal, sub)
    return (code | sign).to(tl.uint8)


@triton.jit
def to_cache(y, ptr, ACT_DTYPE: tl.constexpr):
    """fp32 y as stored at ``ptr``: rounded to the activation dtype (nearest even), then, when
    ``ptr`` is an fp8 cache's uint8 view, encoded as e4m3 codes."""
    r = round_as(y, ACT_DTYPE)
    if ptr.dtype.element_ty == tl.uint8:  # (else: see ``widen``)
        return e4m3_bits(r)
    else:
        return r.to(ptr.dtype.element_ty)


@triton.jit
def widen(x, DTYPE: tl.constexpr):
    """Rows loaded from a cache, in ``DTYPE`` (the queries' dtype): fp8 rows are widened
    through fp32 (exact; the interpreter's direct fp8 -> bf16 cast is wrong), others as is.
    The ``else`` matters: the compiler resolves the ``if`` statically but still visits a
    statement after it, so a trailing ``return x`` was a second return of another type
    ("Inconsistent return types", seen on the H200; the interpreter runs plain Python)."""
    if x.dtype == tl.float8e4nv:
        return x.to(tl.float32).to(DTYPE)
    else:
        return x
