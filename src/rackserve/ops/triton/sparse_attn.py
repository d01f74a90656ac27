"""Paged sparse decode attention: ``paged_sparse_attention``, equal to its
``ops.reference`` namesake (the row gather, ``sparse_attention`` and the optional inverse
RoPE of the output) in one or two launches.

Shape legend: S queries, H heads, Dh head dim, Wa window rows, Wb compressed rows,
M = Wa + Wb, R rope dims, P splits of the M rows::

    rows of query s:  0 ......... Wa-1 | Wa ............. Wa+Wb-1
                      kv_a[slots_a[s]] | kv_b[slots_b[s]][:, :Dh]
                      |-- split 0 --|-- split 1 --| ... |-- split P-1 --|   (BLOCK_N tiles)

P == 1: one launch writes the output. P > 1: the attention kernel writes per-split partials
(max, sum, acc) and a combine kernel merges them (kernels in ``sparse_attn_kernels.py``).
Grids and workspaces depend on the shapes only: no host syncs, CUDA-graph safe,
deterministic (the combine sums splits in a fixed order).
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton

from rackserve.ops.triton.common import pdl
from rackserve.ops.triton.fp8 import FP8_KV_DTYPE
from rackserve.ops.triton.norm_rope import rms_norm_rope
from rackserve.ops.triton.sparse_attn_kernels import sparse_attn_combine_kernel, sparse_attn_kernel
from rackserve.ops.triton.sparse_attn_wide_kernels import sparse_attn_wide_kernel

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Tiling:
    """Launch shapes (powers of two; see ``default_tiling``)."""

    block_h: int  # heads per program: the dots' M (>= 16)
    block_n: int  # rows per tile (>= 16)
    num_dv: int  # programs sharing a head block, each owning Dh / num_dv output columns
    num_splits: int  # target P; lowered so that no split is empty
    num_warps: int
    num_stages: int
    combine_block_h: int
    combine_warps: int
    split_p: bool = True  # 16-bit rows: PV with p = hi + lo (exact to ~16 bits; 1.5x FLOPs)
    pv_fp16: bool = False  # 16-bit rows, "wide" only: one PV dot of fp16 p and rows (11 bits)
    prefetch: bool = True  # load row tile i+1 into registers while tile i computes
    # "heads": ``sparse_attn_kernel`` (BLOCK_H heads per program); "wide": every head in one
    # program (``sparse_attn_wide_kernel``; block_h and prefetch unused there, num_dv 1 or 2)
    kernel: str = "heads"


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


KERNEL_ENV = "RACKSERVE_SPARSE_ATTN"  # "heads" (the default) or "wide": default_tiling's kernel
# from this many queries the wide kernel's PV is one fp16 dot (``Tiling.pv_fp16``), not
# split p's two (2x the minimal FLOPs at prefill, where both head-dim programs compute QK;
# 1.5x with fp16 PV). None: never. H200, bench forward, v4-flash, 4 layers, from 64 queries
# against never, two alternating passes in each of two calls (2026-12-02-h200-s12.md):
# decode:64@4096 4.56 / 4.53 against 4.63 / 4.68 ms, then 4.50 / 4.50 against 4.45 / 4.46;
# prefill:2048 15.6 / 15.7 against 15.4 / 15.4: inside the spread, so it stays off
PV_FP16_MIN_QUERIES: int | None = None


def default_tiling(
    num_queries: int,
    num_heads: int,
    head_dim: int,
    num_rows: int,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
) -> Tiling:
    """Launch shapes from S, H, Dh, M and the device (host ints only: graph-safe).

    The kernel comes from ``$RACKSERVE_SPARSE_ATTN`` ("heads", "wide", or unset: "wide" on
    a GPU from S = 64 queries, "heads" below; "wide" (``wide_tiling``) is taken for 16-bit
    rows and H <= 128 only), read at each call (a captured graph keeps its choice). Wide
    from S = 64 measured on the H200 (bench forward, v4-flash, 4 layers: decode:64@4096
    5.29 -> 5.19 ms, decode:256@4096 6.92 -> 6.86 ms; 2026-12-01-h200-s3-check-*.json).
    "heads" on a GPU: 16 heads per program (a [16, Dh] fp32 accumulator; 32 once the batch
    alone fills the SMs twice over, halving the L2 re-reads of the rows by the head blocks)
    and split the rows until the grid covers the SMs (S = 1, H = 64: 4 head blocks x up to
    33 splits; S >= 64: no split, no combine launch). On CPU (the Triton interpreter): few,
    large programs.
    """
    # fp32 rows on a GPU stay on "heads": the wide kernel's fp32 FMA dots spill (q alone is
    # 128 KB at H 64, Dh 512); fp32 is the tests' strict path, not a serving dtype
    fp32_gpu = dtype == torch.float32 and device.type == "cuda"
    choice = os.environ.get(KERNEL_ENV)
    if choice is None:
        choice = "wide" if device.type == "cuda" and num_queries >= 64 else "heads"
    if choice == "wide" and num_heads <= 128 and not fp32_gpu:
        return wide_tiling(num_queries, num_heads, head_dim, num_rows, device)
    if device.type != "cuda":
        return Tiling(16, 32, 1, 1, 4, 1, 16, 4)
    sms = _num_sms(device)
    # Measured on the H200 (benchmarks/results/2026-12-01-h200-m2.md; H 64, Dh 512): 32
    # heads per program from S = 64 (24.5 vs 33.7 us at 160 rows, 93 vs 137 us at 640) and
    # 64-row tiles from S = 128 (94 vs 107 us at 160 rows, 265 vs 366 us at 640 for S=256)
    block_h = 32 if num_queries >= 64 else 16
    block_n = 64 if num_queries >= 128 else 32
    tiles = max(1, triton.cdiv(num_rows, block_n))
    programs = num_queries * triton.cdiv(num_heads, block_h)
    splits = max(1, min(tiles, triton.cdiv(sms, programs)))
    # ptxas for sm_90 at Dh 512, BLOCK_N 32, prefetch: 8 warps 155 registers (16 heads) /
    # 209 (32 heads), no spills; 4 warps spill
    return Tiling(block_h, block_n, 1, splits, 8, 1, 16, 4)


def wide_tiling(
    num_queries: int, num_heads: int, head_dim: int, num_rows: int, device: torch.device
) -> Tiling:
    """Launch shapes of the "wide" kernel (every head in one program; each row tile read
    once from HBM for all heads, and once more from L2 by the program of the other half).

    On a GPU: two programs per (query, split), one per half of the head dim, 4 warps (one
    warpgroup: at H = 64 the dots' M is 64, and with 8 warps Triton 3.6 lays a chained dot
    out as [8, 1] warps, computing every row twice), 16-row tiles in a 5-stage pipeline
    through shared memory. Two reasons, read from the sm_90 TTGIR and ptxas (H 64, Dh 512):
    below 5 stages Triton 3.6 issues a tile's gathers after the previous tile's dots and
    waits for them at the top of the next iteration (``async_wait`` of everything), so no
    gather overlaps a dot; from 5 the wait leaves later tiles in flight. And 16-row tiles
    at 5 stages take 112 KB of shared memory and 219 registers: two programs per SM, one's
    softmax beside the other's dots (32-row tiles: 164 KB at 5 stages, 132 KB at 3, one
    program). H200, ``sparse_attention_bench.py`` (graph replay, 2026-12-03-h200-s18.md):
    S = 256 CSA 223.4 -> 163.1 us, HCA 76.7 -> 56.4; S = 64 CSA 72.4 -> 67.4, HCA 34.2 ->
    32.5 against 32-row tiles at 3 stages. The rows are split until S x 2 x splits covers
    the SMs twice (S = 64: 3 splits, S >= 132: none, no combine launch). On CPU: one
    program per query.
    """
    if device.type != "cuda":
        return Tiling(16, 32, 1, 1, 4, 1, 16, 4, kernel="wide")
    sms = _num_sms(device)
    block_n, num_dv = 16, 2
    tiles = max(1, triton.cdiv(num_rows, block_n))
    splits = max(1, min(tiles, triton.cdiv(2 * sms, num_queries * num_dv)))
    fp16 = PV_FP16_MIN_QUERIES is not None and num_queries >= PV_FP16_MIN_QUERIES
    return Tiling(
        64, block_n, num_dv, splits, 4, 5, 16, 4, prefetch=False, kernel="wide", pv_fp16=fp16
    )


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every output and workspace comes from here (tests fill them with NaN)."""
    return torch.empty(shape, dtype=dtype, device=device)


def check_inputs(
    q: torch.Tensor,
    kv_a: torch.Tensor,
    slots_a: torch.Tensor,
    kv_b: torch.Tensor,
    slots_b: torch.Tensor,
    valid: torch.Tensor,
    sinks: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    q_norm_eps: float | None = None,
) -> None:
    """Raise ValueError naming the first argument that does not fit the op's contract."""
    if q.dim() != 3 or q.dtype not in _DTYPES:
        raise ValueError(f"q must be [S, H, Dh] in {_DTYPES}, got {tuple(q.shape)} {q.dtype}")
    s, h, dh = q.shape
    # the caches hold q's dtype, or both e4m3 (--kv-cache-dtype fp8: widened in registers)
    kv_dtype = FP8_KV_DTYPE if kv_a.dtype == FP8_KV_DTYPE else q.dtype
    for name, kv in (("kv_a", kv_a), ("kv_b", kv_b)):
        if kv.dim() != 2 or kv.shape[1] < dh or kv.dtype != kv_dtype:
            raise ValueError(
                f"{name} must be [N, >= {dh}] {kv_dtype} (rows by slot; both caches in "
                f"q's dtype or both float8_e4m3fn), got {tuple(kv.shape)} {kv.dtype}"
            )
        if kv.stride(1) != 1 and kv.shape[1] > 1:
            raise ValueError(f"{name} must have unit column stride, got strides {kv.stride()}")
    for name, slots in (("slots_a", slots_a), ("slots_b", slots_b)):
        if slots.dim() != 2 or slots.shape[0] != s or slots.dtype not in _INDEX_DTYPES:
            raise ValueError(
                f"{name} must be [{s}, W] int32/int64, got {tuple(slots.shape)} {slots.dtype}"
            )
    rows = slots_a.shape[1] + slots_b.shape[1]
    if tuple(valid.shape) != (s, rows) or valid.dtype != torch.bool:
        raise ValueError(
            f"valid must be [{s}, {rows}] bool, got {tuple(valid.shape)} {valid.dtype}"
        )
    if tuple(sinks.shape) != (h,):
        raise ValueError(f"sinks must be [{h}], got {tuple(sinks.shape)}")
    if (cos is None) != (sin is None):
        raise ValueError("cos and sin must be given together")
    if q_norm_eps is not None and cos is None:
        raise ValueError("a raw q (q_norm_eps) needs cos and sin: its norm is followed by RoPE")
    if cos is not None:
        half = cos.shape[-1] if cos.dim() == 2 else -1
        if cos.dim() != 2 or cos.shape[0] != s or tuple(sin.shape) != tuple(cos.shape):
            raise ValueError(
                f"cos, sin must both be [{s}, R/2], got {tuple(cos.shape)}, {tuple(sin.shape)}"
            )
        if 2 * half > dh or dh % 2:
            raise ValueError(f"rope dims {2 * half} do not fit head_dim {dh} (even, >= R)")
    tensors = (kv_a, slots_a, kv_b, slots_b, valid, sinks) + ((cos, sin) if cos is not None else ())
    for t in tensors:
        if t.device != q.device:
            raise ValueError(f"every input must be on {q.device}, got one on {t.device}")


def normed_q(
    q: torch.Tensor, q_norm_eps: float | None, cos: torch.Tensor | None, sin: torch.Tensor | None
) -> torch.Tensor:
    """q as the kernels attend with it: a raw q (``q_norm_eps`` given) through the Triton
    ``rms_norm_rope`` (unweighted), for the kernels that do not norm it on their q load."""
    if q_norm_eps is None:
        return q
    return rms_norm_rope(q, None, q_norm_eps, cos, sin)


def paged_sparse_attention(
    q: torch.Tensor,
    kv_a: torch.Tensor,
    slots_a: torch.Tensor,
    kv_b: torch.Tensor,
    slots_b: torch.Tensor,
    valid: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    *,
    q_norm_eps: float | None = None,
    tiling: Tiling | None = None,
) -> torch.Tensor:
    """Fused ``ops.reference.paged_sparse_attention``: one launch, two with splits (a raw
    q, ``q_norm_eps``: one more, ``normed_q``).

    q: [S, H, Dh] (fp32/bf16/fp16); kv_a: [Na, >= Dh], kv_b: [Nb, >= Dh] cache views in q's
    dtype or both float8 e4m3 (1 byte per value read, widened to q's dtype in registers)
    with unit column stride (any row stride; only the first Dh columns are read);
    slots_a: [S, Wa], slots_b: [S, Wb] int32/int64 (Wb may be 0); valid: [S, Wa + Wb] bool
    (invalid rows are never read: their slots may hold anything); sinks: [H]; cos, sin:
    [S, R/2] or None (the inverse RoPE of the output's last R channels). Returns [S, H, Dh]
    in q's dtype.
    """
    check_inputs(q, kv_a, slots_a, kv_b, slots_b, valid, sinks, cos, sin, q_norm_eps)
    q = normed_q(q, q_norm_eps, cos, sin)
    num_queries, num_heads, head_dim = q.shape
    width_a, width_b = slots_a.shape[1], slots_b.shape[1]
    num_rows = width_a + width_b
    device = q.device
    out = _empty((num_queries, num_heads, head_dim), q.dtype, device)
    if num_queries == 0 or num_heads == 0:
        return out
    tiling = tiling or default_tiling(num_queries, num_heads, head_dim, num_rows, device, q.dtype)
    if q.stride(2) != 1:
        q = q.contiguous()
    slots_a, slots_b = slots_a.contiguous(), slots_b.contiguous()
    valid = valid.contiguous().view(torch.uint8)
    sinks = sinks.to(torch.float32).contiguous()
    rope = cos is not None
    if rope:
        cos, sin = cos.contiguous(), sin.contiguous()
    rope_start = head_dim - (cos.shape[1] * 2 if rope else 0)

    block_d = max(16, triton.next_power_of_2(head_dim))
    wide = tiling.kernel == "wide"
    if tiling.kernel not in ("heads", "wide"):
        raise ValueError(f"tiling.kernel must be 'heads' or 'wide', got {tiling.kernel!r}")
    if wide and num_heads > 128:
        raise ValueError(f"the wide kernel holds every head in one program: H={num_heads} > 128")
    num_dv = max(1, min(tiling.num_dv, 2 if wide else block_d // 16))
    block_dv = block_d // num_dv
    tiles = max(1, triton.cdiv(num_rows, tiling.block_n))
    rows_per_split = triton.cdiv(tiles, max(1, min(tiling.num_splits, tiles))) * tiling.block_n
    num_splits = max(1, triton.cdiv(num_rows, rows_per_split))
    single = num_splits == 1
    if single:
        part_acc = part_m = part_l = out  # unused
    else:
        part_acc = _empty((num_splits, num_queries, num_heads, head_dim), torch.float32, device)
        part_m = _empty((num_splits, num_queries, num_heads), torch.float32, device)
        part_l = _empty((num_splits, num_queries, num_heads), torch.float32, device)
    stride_ps = num_queries * num_heads * head_dim
    rope_args = (cos, sin) if rope else (out, out)
    rope_strides = (cos.stride(0), sin.stride(0)) if rope else (0, 0)
    common = dict(
        SINGLE=single,
        ROPE=rope,
        NUM_STAGES=tiling.num_stages,
        SPLIT_P=tiling.split_p and q.dtype != torch.float32,
        FP32_DOTS=q.dtype == torch.float32 or device.type != "cuda",
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
    )
    tensors = (q, kv_a, slots_a, kv_b, slots_b, valid, sinks, *rope_args, out)
    partials = (part_acc, part_m, part_l)
    strides = (
        q.stride(0),
        q.stride(1),
        kv_a.stride(0),
        kv_b.stride(0),
        slots_a.stride(0),
        slots_b.stride(0),
        valid.stride(0),
        *rope_strides,
        out.stride(0),
        out.stride(1),
        stride_ps,
    )
    qk_scale = scale * math.log2(math.e)
    if wide:
        sparse_attn_wide_kernel[(num_dv, num_queries, num_splits)](
            *tensors, *partials, num_heads, width_a, width_b, rows_per_split, rope_start,
            qk_scale, *strides, HEAD_DIM=head_dim, HALF=block_d // 2,
            BLOCK_H=max(16, triton.next_power_of_2(num_heads)), BLOCK_N=tiling.block_n,
            NUM_DV=num_dv, PV_FP16=tiling.pv_fp16 and q.dtype != torch.float32, **common,
            **pdl(q.device),
        )  # fmt: skip
        num_dv, block_dv = 1, block_d  # the combine's own column split
    else:
        head_blocks = triton.cdiv(num_heads, tiling.block_h)
        sparse_attn_kernel[(head_blocks * num_dv, num_queries, num_splits)](
            *tensors, *partials, num_heads, head_dim, width_a, width_b, rows_per_split,
            rope_start, qk_scale, *strides, BLOCK_H=tiling.block_h, BLOCK_N=tiling.block_n,
            BLOCK_D=block_d, BLOCK_DV=block_dv, NUM_DV=num_dv, PREFETCH=tiling.prefetch,
            **common, **pdl(q.device),
        )  # fmt: skip
    if single:
        return out
    combine_blocks = triton.cdiv(num_heads, tiling.combine_block_h)
    if device.type == "cuda":
        # the combine's own column split, so that enough programs read the partials: at
        # S = 1, H = 64 the 4 head blocks alone read 0.66 MB (HCA) / 2.6 MB (CSA) from 4 SMs
        # (5.5 / 11.8 us in the H200's batch-1 replay, 2026-12-03-h200-s16.md)
        want = triton.cdiv(2 * _num_sms(device), combine_blocks * num_queries)
        num_dv = max(num_dv, min(block_d // 64, triton.next_power_of_2(want)))
        block_dv = block_d // num_dv
    sparse_attn_combine_kernel[(combine_blocks * num_dv, num_queries)](
        part_acc,
        part_m,
        part_l,
        sinks,
        *rope_args,
        out,
        num_splits,
        num_heads,
        head_dim,
        rope_start,
        stride_ps,
        *rope_strides,
        out.stride(0),
        out.stride(1),
        BLOCK_H=tiling.combine_block_h,
        BLOCK_DV=block_dv,
        NUM_DV=num_dv,
        ROPE=rope,
        num_warps=tiling.combine_warps,
        **pdl(part_acc.device),
    )
    return out
