"""Routed experts for prefill as two Triton GEMMs over expert-aligned row blocks, with the
gather of the token rows and the SwiGLU inside the first: ``moe_experts_tiled``, the same
contract as ``ops.reference.moe_experts``.

Shape legend: T tokens, k experts per token, P = T * k (token, slot) pairs (pair p is
token p // k, slot p % k), E experts, D hidden, I expert width, BM rows per block, R the
padded row capacity (a multiple of BM), B = R / BM blocks.

    align    (fused_moe.moe_align)       -> sorted_ids [R] (pair, P on padding), block_expert [B]
    gate_up  x[token] @ w13[e]^T, SwiGLU -> h [R, I] in x's dtype (one rounding, from fp32)
    down     h @ w2[e]^T                 -> y [P, D] in x's dtype, at each pair's own row
    combine  (prefill_moe.moe_unpermute)  -> out [T, D] = sum_j weights[t, j] y[t * k + j]

Against ``ops/grouped_moe.py`` (``F.grouped_mm`` over rows sorted by expert) this drops three
passes over the [P, D] / [P, 2I] activations: the gather of x's rows (each block loads its
tokens' rows straight from x), the [P, 2I] gate-up output and its SwiGLU pass (the epilogue
applies it to the fp32 accumulators and stores [P, I]), and the argsort behind the grouped
layout (the align kernels count). The down GEMM writes each pair's row where the combine
reads it, so the combine's reads are contiguous per token and no float atomics are used.

A gate-up program computes BN gate columns and the same BN up columns (two accumulators,
two dots per K step sharing the gathered A tile). Weight tiles (and the down GEMM's h
tiles) arrive by TMA through host-built descriptors of the contiguous [E * N, K] weights;
the gathered x rows by pointer loads. Programs are ordered in groups of ``group_m``
consecutive blocks that sweep every column tile together (the swizzle of Triton's matmul
tutorial): the blocks of one expert share each weight tile through L2, and a group's x
rows stay in L2 across its column tiles. Grids depend on the shapes only (no host sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from rackserve.ops.triton.common import round_as
from rackserve.ops.triton.fused_moe import moe_align
from rackserve.ops.triton.fused_moe_kernels import dot_acc, swiglu
from rackserve.ops.triton.prefill_moe import moe_unpermute


@dataclass(frozen=True)
class Tiling:
    """Launch shapes of the two GEMMs (powers of two)."""

    block_m: int  # rows per block; every expert's run is padded to a multiple of it
    gate_up_block_n: int  # I columns a gate-up program computes (2x that on the tensor cores)
    gate_up_block_k: int
    gate_up_warps: int
    gate_up_stages: int
    down_block_n: int
    down_block_k: int
    down_warps: int
    down_stages: int
    group_m: int = 8  # blocks a program group sweeps the column tiles with


def default_tiling(device: torch.device) -> Tiling:
    """On a GPU the tensor-core shapes of a compute-bound GEMM; on CPU (the interpreter)
    small tiles (the tests' experts are small)."""
    if device.type != "cuda":
        return Tiling(16, 16, 16, 4, 1, 16, 16, 4, 1, group_m=2)
    return Tiling(128, 128, 64, 8, 4, 128, 64, 8, 4)


def supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, tiling: Tiling) -> bool:
    """Whether the shapes tile without remainders (the kernels' K loops take no masks)."""
    inter, dim = w2.shape[2], w2.shape[1]
    return (
        x.dtype in (torch.bfloat16, torch.float16)
        and w13.dtype == x.dtype
        and w2.dtype == x.dtype
        and w13.is_contiguous()
        and w2.is_contiguous()
        and dim % tiling.gate_up_block_k == 0
        and dim % tiling.down_block_n == 0
        and inter % tiling.gate_up_block_n == 0
        and inter % tiling.down_block_k == 0
    )


def moe_experts_tiled(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
    tiling: Tiling | None = None,
) -> torch.Tensor:
    """x [T, D]; topk_ids [T, k] in [0, E); topk_weights [T, k]; w13 [E, 2I, D]; w2 [E, D, I]
    -> [T, D] in x's dtype."""
    tiling = tiling or default_tiling(x.device)
    if not supported(x, w13, w2, tiling):
        raise ValueError(
            f"moe_experts_tiled: 16-bit x, contiguous w13 / w2 of x's dtype, D and I multiples "
            f"of the tiles; got "
            f"x {x.dtype} {tuple(x.shape)}, w13 {w13.dtype} {tuple(w13.shape)}, w2 "
            f"{w2.dtype} {tuple(w2.shape)}"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    num_tokens, top_k = topk_ids.shape
    if num_tokens * top_k == 0:
        return torch.zeros_like(x)
    sorted_ids, block_expert = moe_align(topk_ids.contiguous(), w13.shape[0], tiling.block_m)
    h = gate_up(x, w13, sorted_ids, block_expert, top_k, limit, tiling)
    y = down(h, w2, sorted_ids, block_expert, num_tokens * top_k, tiling)
    pairs = torch.arange(y.shape[0], device=x.device, dtype=torch.int32).view(num_tokens, top_k)
    return moe_unpermute(y, pairs, topk_weights)


def gate_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    top_k: int,
    limit: float,
    tiling: Tiling,
) -> torch.Tensor:
    """The first GEMM over the align's blocks -> h [R, I] in x's dtype (padding rows hold
    token 0's values; the down GEMM does not store them)."""
    num_experts, two_inter, dim = w13.shape
    inter = two_inter // 2
    num_blocks = block_expert.shape[0]
    h = torch.empty(num_blocks * tiling.block_m, inter, dtype=x.dtype, device=x.device)
    grid = (num_blocks * (inter // tiling.gate_up_block_n),)
    w_desc = TensorDescriptor.from_tensor(
        w13.view(-1, dim), [tiling.gate_up_block_n, tiling.gate_up_block_k]
    )
    grouped_gate_up_kernel[grid](
        x, w_desc, h, sorted_ids, block_expert, x.shape[0] * top_k, top_k, dim, inter,
        num_experts, float(limit), x.stride(0), h.stride(0), num_blocks,
        BLOCK_M=tiling.block_m, BLOCK_N=tiling.gate_up_block_n, BLOCK_K=tiling.gate_up_block_k,
        GROUP_M=tiling.group_m, FP32_DOT=_fp32_dot(x), num_warps=tiling.gate_up_warps,
        num_stages=tiling.gate_up_stages,
    )  # fmt: skip
    return h


def down(
    h: torch.Tensor,
    w2: torch.Tensor,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_pairs: int,
    tiling: Tiling,
) -> torch.Tensor:
    """The second GEMM -> y [P, D] in h's dtype, each pair's result at its own row."""
    num_experts, dim, inter = w2.shape
    num_blocks = block_expert.shape[0]
    y = torch.empty(num_pairs, dim, dtype=h.dtype, device=h.device)
    grid = (num_blocks * (dim // tiling.down_block_n),)
    h_desc = TensorDescriptor.from_tensor(h, [tiling.block_m, tiling.down_block_k])
    w_desc = TensorDescriptor.from_tensor(
        w2.view(-1, inter), [tiling.down_block_n, tiling.down_block_k]
    )
    grouped_down_kernel[grid](
        h_desc, w_desc, y, sorted_ids, block_expert, num_pairs, dim, inter, num_experts,
        y.stride(0), num_blocks, BLOCK_M=tiling.block_m, BLOCK_N=tiling.down_block_n,
        BLOCK_K=tiling.down_block_k, GROUP_M=tiling.group_m, FP32_DOT=_fp32_dot(h),
        num_warps=tiling.down_warps, num_stages=tiling.down_stages,
    )  # fmt: skip
    return y


def _fp32_dot(x: torch.Tensor) -> bool:
    """fp32 dots under the interpreter (CPU), whose 16-bit tl.dot is wrong."""
    return x.device.type == "cpu"


@triton.jit
def _program_tile(num_blocks, num_tiles, GROUP_M: tl.constexpr):
    """(block, column tile) of this program: groups of GROUP_M consecutive blocks, each
    group's programs over all its blocks and column tiles together, block fastest."""
    pid = tl.program_id(0)
    per_group = GROUP_M * num_tiles
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(num_blocks - first, GROUP_M)
    local = pid % per_group
    return first + local % size, local // size


@triton.jit
def _block(sorted_ptr, block_expert_ptr, num_blocks, num_tiles, BLOCK_M: tl.constexpr,
           GROUP_M: tl.constexpr):  # fmt: skip
    """This program's (block, column tile, expert (E past the used blocks), rows [BLOCK_M]
    of the aligned order, pair at each row (P on padding rows))."""
    block, tile = _program_tile(num_blocks, num_tiles, GROUP_M)
    expert = tl.load(block_expert_ptr + block)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    return block, tile, expert, rows, tl.load(sorted_ptr + rows)


@triton.jit
def grouped_gate_up_kernel(
    x_ptr,  # [T, D]
    w_desc,  # w13 as [E * 2I, D]: [BLOCK_N, BLOCK_K] tiles
    h_ptr,  # [R, I] out
    sorted_ptr,  # [R] int32: the pair at each row, P on padding rows
    block_expert_ptr,  # [B] int32: E past the used blocks
    num_pairs,
    top_k,
    dim,
    inter,
    num_experts,
    limit,
    stride_xt,
    stride_ht,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    _, tile, expert, rows, pair = _block(
        sorted_ptr, block_expert_ptr, num_blocks, inter // BLOCK_N, BLOCK_M, GROUP_M
    )
    if expert >= num_experts:
        return
    token = tl.where(pair < num_pairs, pair // top_k, 0)  # padding rows read token 0
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token.to(tl.int64)[:, None] * stride_xt + ks[None, :]
    gate_row = expert * 2 * inter + tile * BLOCK_N  # w13's gate rows of this tile
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, dim, BLOCK_K):
        a = tl.load(a_ptrs)
        acc_gate = dot_acc(a, w_desc.load([gate_row, k]).T, acc_gate, FP32_DOT)
        acc_up = dot_acc(a, w_desc.load([gate_row + inter, k]).T, acc_up, FP32_DOT)
        a_ptrs += BLOCK_K
    act = swiglu(acc_gate, acc_up, limit)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ty = h_ptr.dtype.element_ty
    h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * stride_ht + cols[None, :]
    tl.store(h_ptrs, round_as(act, out_ty).to(out_ty))


@triton.jit
def grouped_down_kernel(
    h_desc,  # h [R, I]: [BLOCK_M, BLOCK_K] tiles
    w_desc,  # w2 as [E * D, I]: [BLOCK_N, BLOCK_K] tiles
    y_ptr,  # [P, D] out: the pair's own row
    sorted_ptr,
    block_expert_ptr,
    num_pairs,
    dim,
    inter,
    num_experts,
    stride_yp,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    block, tile, expert, _, pair = _block(
        sorted_ptr, block_expert_ptr, num_blocks, dim // BLOCK_N, BLOCK_M, GROUP_M
    )
    if expert >= num_experts:
        return
    w_row = expert * dim + tile * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, inter, BLOCK_K):
        a = h_desc.load([block * BLOCK_M, k])
        acc = dot_acc(a, w_desc.load([w_row, k]).T, acc, FP32_DOT)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    out_ty = y_ptr.dtype.element_ty
    y_ptrs = y_ptr + pair.to(tl.int64)[:, None] * stride_yp + cols[None, :]
    tl.store(y_ptrs, round_as(acc, out_ty).to(out_ty), mask=(pair < num_pairs)[:, None])
