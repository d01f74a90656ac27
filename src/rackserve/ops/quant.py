"""Quantized weight formats (FP8 block-scaled, FP4 e2m1 with per-32 scales) and the
per-op references on them: dequantize, then the plain op (``ops/reference.py``). These are
the specification the Triton kernels (``ops/triton/fp8_gemm.py``, ``fused_moe_fp4.py``)
are tested against; on a CPU they are what runs.

Layouts (transformers' finegrained FP8 integration and DeepSeek's checkpoints):

- FP8: ``weight`` float8 e4m3 [N, K], scale [cdiv(N, 128), cdiv(K, 128)]; the real
  weight is ``weight[n, k] * scale[n // 128, k // 128]``.
- FP4: ``weight`` [N, K / 2] bytes, two e2m1 codes per byte (element 2j in the low nibble,
  2j+1 in the high one), scale [N, K / 32] per 32 inputs of a row.
- Scales are float32 or ue8m0: a power of two stored as its biased exponent byte,
  2 ** (byte - 127) (safetensors ``F8_E8M0``; in memory we keep the bytes as uint8).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rackserve.ops.reference import moe_experts

FP8_BLOCK = (128, 128)  # config.FP8_BLOCK (ops must not import config)
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP4_GROUP = 32  # inputs per FP4 scale
FP4_MAX = 6.0
# code -> value; codes 8..15 are the negatives of 0..7
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = E2M1_MAGNITUDES + tuple(-v for v in E2M1_MAGNITUDES)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Any stored scale (float, float8_e8m0fnu, or ue8m0 exponent bytes as uint8) -> fp32."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.to(torch.float32) - 127.0)
    if scale.dtype == torch.float8_e8m0fnu:
        return torch.exp2(scale.view(torch.uint8).to(torch.float32) - 127.0)
    return scale.to(torch.float32)


def float_to_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Powers of two (fp32) -> their exponent bytes (uint8); ValueError for any other value."""
    scale = scale.to(torch.float32)
    mantissa, exponent = torch.frexp(scale)  # scale = mantissa * 2**exponent, |m| in [0.5, 1)
    if not bool(((mantissa == 0.5) & (scale > 0)).all()):
        raise ValueError("scales are not all positive powers of two: they cannot be ue8m0")
    return (exponent - 1 + 127).clamp(0, 254).to(torch.uint8)


def stored_scale(scale_fp32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An fp32 scale in a parameter's storage dtype (float32, or uint8 ue8m0 bytes)."""
    return float_to_ue8m0(scale_fp32) if dtype == torch.uint8 else scale_fp32.to(dtype)


def _round_scale(scale: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    scale = scale.clamp_min(torch.finfo(torch.float32).tiny)
    return torch.exp2(torch.ceil(torch.log2(scale))) if ue8m0 else scale


# ---- FP8, one scale per 128 x 128 block ---------------------------------------------------
def _block_view(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, int, int]:
    """Pad [N, K] to whole blocks and view it as [Nb, bn, Kb, bk]."""
    n, k = w.shape
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=w.dtype, device=w.device)
    padded[:n, :k] = w
    return padded.view(nb, bn, kb, bk), n, k


def quantize_fp8(
    w: torch.Tensor, ue8m0: bool = False, block: tuple[int, int] = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] float -> (float8 e4m3 [N, K], fp32 scale [cdiv(N, 128), cdiv(K, 128)])."""
    blocks, n, k = _block_view(w.float(), block)
    scale = _round_scale(blocks.abs().amax(dim=(1, 3)) / FP8_MAX, ue8m0)  # [Nb, Kb]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(blocks.shape[0] * block[0], -1)[:n, :k].contiguous(), scale


def dequantize_fp8(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w: float8 [..., N, K]; scale: [..., cdiv(N, 128), cdiv(K, 128)] (any stored kind) ->
    [..., N, K] in ``dtype``; each block is scaled in fp32, then rounded once."""
    n, k = w.shape[-2:]
    s = scale_to_float(scale)
    bn, bk = FP8_BLOCK
    s = s.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (w.to(torch.float32) * s).to(dtype)


# ---- FP4 (e2m1), one scale per 32 inputs ---------------------------------------------------
def _e2m1_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K / 2] packed bytes (uint8/int8) -> [..., K] fp32 e2m1 values."""
    u8 = packed.contiguous().view(torch.uint8).long()
    table = _e2m1_table(packed.device)
    values = torch.stack([table[u8 & 0xF], table[u8 >> 4]], dim=-1)
    return values.view(*packed.shape[:-1], 2 * packed.shape[-1])


def quantize_fp4(w: torch.Tensor, ue8m0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [..., N, K] float (K % 32 == 0) -> (packed uint8 [..., N, K / 2], fp32 scale
    [..., N, K / 32]); each value rounds to the nearest e2m1 code (ties to the lower one)."""
    if w.shape[-1] % FP4_GROUP:
        raise ValueError(f"FP4 rows must be a multiple of {FP4_GROUP} long, got {w.shape[-1]}")
    groups = w.float().unflatten(-1, (-1, FP4_GROUP))  # [..., K/32, 32]
    scale = _round_scale(groups.abs().amax(dim=-1) / FP4_MAX, ue8m0)
    x = (groups / scale[..., None]).clamp(-FP4_MAX, FP4_MAX).flatten(-2)
    magnitudes = _e2m1_table(w.device)[:8]
    code = (x.abs()[..., None] - magnitudes).abs().argmin(dim=-1)  # nearest magnitude
    code = code + 8 * (x < 0)
    code = code.to(torch.uint8).unflatten(-1, (-1, 2))
    return code[..., 0] | (code[..., 1] << 4), scale


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """packed: [..., N, K / 2]; scale: [..., N, K / 32] -> [..., N, K] in ``dtype``."""
    values = unpack_fp4(packed).unflatten(-1, (-1, FP4_GROUP))
    return (values * scale_to_float(scale)[..., None]).flatten(-2).to(dtype)


# ---- ops: dequantize, then the plain op ----------------------------------------------------
def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int = 0
) -> torch.Tensor:
    """y = x @ dequant(weight)^T, the weight dequantized to x's dtype (as transformers does).

    x: [..., K]; weight: float8 [N, K]; scale: [cdiv(N, 128), cdiv(K, 128)] -> [..., N].
    groups > 0: a block-diagonal grouped linear (``wo_a``): x [T, G, in], weight
    [G * out, in] -> [T, G * out].
    """
    w = dequantize_fp8(weight, scale, x.dtype)
    if not groups:
        return F.linear(x, w)
    w = w.view(groups, -1, x.shape[-1])  # [G, out, in]
    return torch.einsum("tgi,goi->tgo", x, w).flatten(1)


def moe_experts_fp4(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """``moe_experts`` on FP4 experts: only the hit experts are dequantized (to x's dtype).

    x: [T, D]; topk_ids, topk_weights: [T, k]; w13: [E, 2I, D / 2] packed, w13_scale:
    [E, 2I, D / 32]; w2: [E, D, I / 2], w2_scale: [E, D, I / 32]. Returns [T, D].
    """
    hit = torch.unique(topk_ids.flatten())  # the reference may sync: it is the CPU path
    remap = torch.zeros(w13.shape[0], dtype=torch.int64, device=x.device)
    remap[hit] = torch.arange(hit.numel(), device=x.device)
    w13_hit = dequantize_fp4(w13[hit], w13_scale[hit], x.dtype)
    w2_hit = dequantize_fp4(w2[hit], w2_scale[hit], x.dtype)
    return moe_experts(x, remap[topk_ids], topk_weights, w13_hit, w2_hit, limit)
