"""FP4 weight tiles for the fused MoE kernels (``fused_moe_fp4.py``): one K step's packed
bytes and scales loaded as stored, then decoded to values in registers.

Layout: [N, K / 2] bytes a matrix, input 2j in the low nibble and 2j+1 in the high one; one
scale per 32 inputs of a row ([N, K / 32], fp32 or ue8m0 bytes). A decoded tile is (even
inputs, odd inputs) [BK / 2, BN], so the dots need no interleaving shuffle. Decoders: e2m1
by arithmetic (``_e2m1``), through fp16 bit patterns (``_e2m1_bits``), and for bf16 dots with
ue8m0 scales on a GPU two weights per bf16x2 instruction pair in inline PTX
(``fp4_decode_bf16``); the first two give fp32 values, scaled in fp32.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _e2m1(code):
    """4-bit e2m1 codes (int32) -> fp32: sign, 2 exponent bits, 1 mantissa bit."""
    e = (code >> 1) & 3
    m = code & 1
    magnitude = tl.where(e == 0, m.to(tl.float32) * 0.5, ((2 + m) << e).to(tl.float32) * 0.25)
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _e2m1_bits(code):
    """The same values in fewer ops: the code's 3 magnitude bits placed in an fp16's low
    exponent bits and top mantissa bit, and its sign in the sign bit, make the fp16 value
    e2m1 * 2^-14 exactly (e = 0 lands in the subnormals: m * 2^-15 = 0.5 m * 2^-14);
    widened and scaled by 2^14 (exact), that is ``_e2m1``."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _fp4_raw(w_ptrs, w_mask, s_ptrs, s_mask):
    """A step's raw tile, as stored: [BK / 2, BN] packed bytes and [BK / 32, BN] scales
    (fp32, or ue8m0 bytes). Nothing consumes them here, so a prefetched load stays in
    flight while the step before it computes."""
    return tl.load(w_ptrs, mask=w_mask, other=0), tl.load(s_ptrs, mask=s_mask, other=0)


@triton.jit
def _per_input(scale, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BK / 32, BN] scales -> [BK / 2, BN]: each scale row covers 16 bytes (32 inputs)."""
    scale = tl.broadcast_to(scale[:, None, :], (BLOCK_K // 32, 16, BLOCK_N))
    return tl.reshape(scale, (BLOCK_K // 2, BLOCK_N))


@triton.jit
def fp4_decode(packed, scale, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
               FP16_BITS: tl.constexpr):  # fmt: skip
    """A raw tile -> (even inputs, odd inputs) [BK / 2, BN], scaled, fp32 (FP16_BITS:
    through fp16 bit patterns). Masked scales load as 0 and their bytes as 0: value 0.
    (``fp4_decode_bf16`` is the inline-PTX one: a separate function, since a jitted
    function's branches must return one type.)"""
    packed = packed.to(tl.int32)
    if scale.dtype == tl.uint8:  # ue8m0: 2 ** (byte - 127) exactly, the float's exponent
        scale = (scale.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    else:
        scale = scale.to(tl.float32)
    scale = _per_input(scale, BLOCK_K, BLOCK_N)
    if FP16_BITS:
        return _e2m1_bits(packed & 15) * scale, _e2m1_bits(packed >> 4) * scale
    else:
        return _e2m1(packed & 15) * scale, _e2m1(packed >> 4) * scale


# Two e2m1 codes per 16-bit lane pair -> bf16x2, scaled. Per 32-bit input (4 packed bytes,
# elements 0-3): the bytes spread to one per 16-bit lane (prmt), each code's sign to bit 15
# of its lane and its 3 magnitude bits to bits 8:6 (the bf16's low exponent bits and top
# mantissa bit), which makes the bf16 value e2m1 * 2^-126 exactly (e = 0 lands in the
# subnormals: m * 2^-127 = 0.5 m * 2^-126); then * 2^126 and * the scale (bf16 fma with -0:
# exact, the scale a power of two). Outputs: even inputs (low nibbles) of elements 0-1 and
# 2-3, then odd inputs (high nibbles); inputs: the packed bytes, the scales of elements 0-1
# and 2-3 (bf16x2). 7 instructions per 2 weights, against ~20 for the fp32 decoders.
_E2M1X2_ASM = tl.constexpr(
    """
{
.reg .b32 x, t, s, m, c, z;
mov.b32 m, 0x01C001C0;
mov.b32 c, 0x7E807E80;
mov.b32 z, 0x80008000;
prmt.b32 x, $4, 0, 0x4140;
and.b32 s, x, 0x00080008; shl.b32 s, s, 12; shl.b32 t, x, 6; lop3.b32 t, t, m, s, 0xEA;
fma.rn.bf16x2 t, t, c, z; fma.rn.bf16x2 $0, t, $5, z;
and.b32 s, x, 0x00800080; shl.b32 s, s, 8; shl.b32 t, x, 2; lop3.b32 t, t, m, s, 0xEA;
fma.rn.bf16x2 t, t, c, z; fma.rn.bf16x2 $2, t, $5, z;
prmt.b32 x, $4, 0, 0x4342;
and.b32 s, x, 0x00080008; shl.b32 s, s, 12; shl.b32 t, x, 6; lop3.b32 t, t, m, s, 0xEA;
fma.rn.bf16x2 t, t, c, z; fma.rn.bf16x2 $1, t, $6, z;
and.b32 s, x, 0x00800080; shl.b32 s, s, 8; shl.b32 t, x, 2; lop3.b32 t, t, m, s, 0xEA;
fma.rn.bf16x2 t, t, c, z; fma.rn.bf16x2 $3, t, $6, z;
}
"""
)


@triton.jit
def fp4_decode_bf16(packed, scale, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """``fp4_decode`` for bf16 dots with ue8m0 scales: (even, odd) [BK / 2, BN] bf16, the
    dequantized weights exactly (an e2m1 value times a power of two), two per instruction
    pair (``_E2M1X2_ASM``). The scale byte b is 2^(b - 127): the bf16 whose exponent field
    is b (b = 0: the subnormal 2^-127)."""
    b = scale.to(tl.int32)
    bits = tl.where(b == 0, 0x40, b << 7).to(tl.int16)
    scale = _per_input(bits.to(tl.bfloat16, bitcast=True), BLOCK_K, BLOCK_N)
    return tl.inline_asm_elementwise(
        _E2M1X2_ASM, "=r,=r,=r,=r,r,r,r", [packed, scale], dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True, pack=4,
    )  # fmt: skip


@triton.jit
def step_raw(w_rows, s_rows, k0, width, col_ok, BLOCK_K: tl.constexpr):
    """The raw tile of the K step at input ``k0`` (of ``width``) for the weight rows
    ``w_rows`` / ``s_rows`` [1, BN] (pointers to each row's start); past the end: masked."""
    # byte j of a step holds inputs 2j, 2j+1. The alignment hints (k0 is a multiple of
    # BLOCK_K, widths of 32: ``_check``) make the packed loads 16-byte vectors: without them
    # sm_90 got one ld.global.b8 per byte
    byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    byte = tl.max_contiguous(tl.multiple_of(byte, BLOCK_K // 2), BLOCK_K // 2)
    group = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    w_mask = (byte < tl.multiple_of(width // 2, 16))[:, None] & col_ok[None, :]
    s_mask = (group < width // 32)[:, None] & col_ok[None, :]
    return _fp4_raw(w_rows + byte[:, None], w_mask, s_rows + group[:, None], s_mask)
