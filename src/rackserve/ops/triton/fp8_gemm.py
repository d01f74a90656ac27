"""FP8 block-scaled linear: ``fp8_linear``, equal to ``ops.quant.fp8_linear``.

Shape legend: M rows (tokens), K inputs, N outputs, G groups (the grouped ``wo_a``).

    y[m, g*N + n] = sum_k x[m, g, k] * w[g*N + n, k] * scale[(g*N + n) // 128, k // 128]

The weight stays float8 e4m3 in memory and is widened and scaled in registers: a K step
of at most 128 inputs sits in one scale block, so each weight column of a step takes one
scale, and the dot accumulates in fp32. Activations stay in
their dtype (bf16 on a GPU; no activation quantization). Decode (few rows) streams the
weight: narrow N tiles and a split over K fill the SMs; the split's partial sums land in a
[S, M, N] fp32 buffer summed in a fixed order (no atomics, CUDA-graph safe: every shape is
a function of the input shapes). Without a split the kernel writes the output (one launch).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rackserve.ops.triton.common import round_as

BLOCK = 128  # the scale block (ops.quant.FP8_BLOCK)
_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GemmTiling:
    block_m: int
    block_n: int
    block_k: int  # divides 128: a K step never straddles two scale blocks
    split_k: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_tiling(m: int, n: int, k: int, groups: int, device: torch.device) -> GemmTiling:
    """Host ints only. Decode (M <= 64): 16-64 row tiles, 64-wide N tiles, and a K split
    until the tiles make ~2 programs per SM. Prefill: 128x128 tiles."""
    if device.type != "cuda":  # the interpreter: few, wide programs
        return GemmTiling(16 if m <= 16 else 32, 64, 128, 1, 4, 1)
    if m > 64:
        return GemmTiling(128 if m >= 512 else 64, 128, 128, 1, 8, 3)
    block_m = max(16, triton.next_power_of_2(m))
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, 64) * max(groups, 1)
    k_steps = triton.cdiv(k, 128)
    split = 1
    while split * 2 <= k_steps and tiles * split * 2 <= 2 * _num_sms(device):
        split *= 2
    return GemmTiling(block_m, 64, 128, split, 4, 4)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output and workspace comes from here (tests fill them with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit
def fp8_gemm_kernel(
    x_ptr,  # [M, G, K] (any strides over M and G; K contiguous)
    w_ptr,  # [G * N, K] float8 e4m3, contiguous
    s_ptr,  # [cdiv(G * N, 128), cdiv(K, 128)] fp32
    out_ptr,  # [S, M, G * N] fp32 partial sums (S = split_k > 1), else [1, M, G * N] out
    m_size,
    n_size,  # N per group
    k_size,
    stride_xm,
    stride_xg,
    stride_wn,
    stride_sn,
    stride_os,
    stride_om,
    k_per_split,  # a multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_gs = tl.program_id(2)  # group * split_k + split
    num_splits = tl.cdiv(k_size, k_per_split)
    group = pid_gs // num_splits
    split = pid_gs % num_splits
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < m_size
    col_ok = cols < n_size
    wrow = group * n_size + cols  # rows of the weight (and of the output)
    ks = tl.arange(0, BLOCK_K)
    k_start = split * k_per_split
    x_base = x_ptr + rows[:, None].to(tl.int64) * stride_xm + group * stride_xg
    w_base = w_ptr + wrow[None, :].to(tl.int64) * stride_wn
    s_base = s_ptr + (wrow // 128) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, k_size), BLOCK_K):
        k_ok = (k0 + ks) < k_size
        a = tl.load(x_base + (k0 + ks)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        # widened through fp32 (the interpreter's direct fp8 -> bf16 cast is wrong) and
        # scaled per output column before the dot: w * s rounds to the activations' type as
        # the reference's dequantized weight does (exactly, for ue8m0 scales)
        scale = tl.load(s_base + k0 // 128, mask=col_ok, other=0.0)
        w = w.to(tl.float32) * scale[None, :]
        if IEEE:  # fp32 activations, or the interpreter (whose bf16 dot is not usable)
            acc = tl.dot(a.to(tl.float32), w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w.to(a.dtype), acc)
    out = out_ptr + split * stride_os + rows[:, None].to(tl.int64) * stride_om + wrow[None, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(out, round_as(acc, dtype).to(dtype), mask=row_ok[:, None] & col_ok[None, :])


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    groups: int = 0,
    *,
    tiling: GemmTiling | None = None,
) -> torch.Tensor:
    """x: [..., K] (groups = 0) or [T, G, K] (groups = G); weight: float8 e4m3 [G * N, K]
    (contiguous); scale: fp32 [cdiv(G * N, 128), cdiv(K, 128)]. Returns [..., N] /
    [T, G * N] in x's dtype."""
    if x.dtype not in _ACTIVATION_DTYPES:
        raise ValueError(f"x must be one of {_ACTIVATION_DTYPES}, got {x.dtype}")
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"weight must be float8_e4m3fn [N, K], got {weight.dtype} {weight.shape}")
    total_n, k = weight.shape
    expected = (triton.cdiv(total_n, BLOCK), triton.cdiv(k, BLOCK))
    if scale.dtype != torch.float32 or tuple(scale.shape) != expected:
        raise ValueError(f"scale must be fp32 {expected}, got {scale.dtype} {tuple(scale.shape)}")
    if x.shape[-1] != k:
        raise ValueError(f"x's last dim {x.shape[-1]} != the weight's K {k}")
    if groups:
        if x.dim() != 3 or x.shape[1] != groups or total_n % groups:
            raise ValueError(f"grouped x must be [T, {groups}, {k}], got {tuple(x.shape)}")
        x3, lead = x, (x.shape[0],)
    else:
        x3, lead = x.reshape(-1, 1, k), tuple(x.shape[:-1])
    g = max(groups, 1)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    m, n = x3.shape[0], total_n // g
    weight, scale = weight.contiguous(), scale.contiguous()
    t = tiling or default_tiling(m, n, k, g, x.device)
    if BLOCK % t.block_k:
        raise ValueError(f"block_k {t.block_k} must divide {BLOCK}")
    k_per_split = triton.cdiv(triton.cdiv(k, t.split_k), t.block_k) * t.block_k
    num_splits = triton.cdiv(k, k_per_split)
    # one split writes the output itself; partial sums are summed in fp32, in order
    parts_dtype = x.dtype if num_splits == 1 else torch.float32
    parts = _empty((num_splits, m, total_n), parts_dtype, x.device)
    if m:
        grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n), g * num_splits)
        fp8_gemm_kernel[grid](
            x3, weight, scale, parts, m, n, k,
            x3.stride(0), x3.stride(1), weight.stride(0), scale.stride(0),
            parts.stride(0), parts.stride(1), k_per_split,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
            IEEE=x.dtype == torch.float32 or x.device.type == "cpu",
            num_warps=t.num_warps, num_stages=t.num_stages,
        )  # fmt: skip
    out = parts[0] if num_splits == 1 else parts.sum(0).to(x.dtype)
    return out.view(*lead, total_n)
